"""``rrh gate``: the regression gate for a new engine version (DESIGN §1, §4).

``rrh gate --engine E [--baseline PATH] [--update] [--output PATH]`` observes engine ``E`` — its
version, the routing convention it actually follows, the outcome of its invariant suites and its
metrics — and compares the observation with the baseline (``fixtures/baselines/<E>.json``), or with
``--update`` writes the observation as the new baseline (atomically). Exit status: 0 no regression,
1 regression (the readable diff says which field, its value and the expected value), 2 the gate
could not run (no baseline, engine not installed or unable to start here).

vLLM and SGLang keep one baseline per release (``fixtures/baselines/vllm-0.30.0.json``): ``--update``
writes the installed version's, and the gate compares the installed version with the baseline of
the newest release at or before it — so bumping vLLM shows what changed since the last release
recorded (row rule, dtype, layer axis, prefix-cache behaviour, disagreement, gap) as a diff.

The engines and what is observed of each are their adapters' (``harness.gate.adapters``:
``reference``, ``hf`` — transformers, ``vllm`` and ``sglang``); the gate runs each adapter's
invariant suites, builds the document, compares and writes it. A probe that fails is an error naming
the engine, the probe and the cause (exit 2), never a silent NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from harness.errors import HarnessError
from harness.gate.adapters import EngineAdapter, ObservationError, Suites, adapter
from harness.gate.baseline import BaselineError, load_baseline, new_baseline, save_baseline
from harness.gate.compare import GateReport, compare
from harness.outcomes import count_outcomes


class GateUnavailable(HarnessError, RuntimeError):
    """The gate cannot observe this engine on this machine."""


DESCRIPTION = (
    "Observe an engine (its version, the routing convention it follows, its invariant suites and its "
    "metrics) and compare the observation with its recorded baseline, fixtures/baselines/<engine>.json "
    "(vLLM, SGLang: <engine>-<version>.json of the newest recorded release at or before the installed one); "
    "with --update, record the observation as the new baseline. Exit status: 0 no regression, "
    "1 regression (a readable diff), 2 the gate could not run (engine not installed, no GPU, no or "
    "unreadable baseline)."
)
"""``rrh gate --help``'s description: the module docstring's second paragraph in plain text."""


def require_engine(engine: str) -> None:
    """``GateUnavailable`` when ``engine`` is not installed here.

    Checked before the baseline is read, so that a machine without vLLM hears "not installed"
    rather than "no baseline; record one with --update", which could not work either.
    """
    if adapter(engine).installed_version() is None:
        raise GateUnavailable(
            f"{engine}: not installed on this machine (pip install -e '.[{engine}]'); "
            "the gate observes the installed engine"
        )


PER_VERSION = ("vllm", "sglang")
"""Engines with one baseline per release (``<engine>-<version>.json``)."""


def baselines_dir() -> Path:
    """``fixtures/baselines`` of the checkout this harness runs from (else of the cwd)."""
    repo = Path(__file__).resolve().parents[2] / "fixtures"
    root = repo if repo.is_dir() else Path.cwd() / "fixtures"
    return root / "baselines"


def default_baseline(engine: str, version: str | None = None, *, update: bool = False) -> Path:
    """The baseline file of ``engine``.

    ``<engine>.json`` for the reference and transformers. For vLLM and SGLang (``version``: the
    installed one): with ``update`` the version's own file, else the recorded baseline of the newest
    release at or before ``version`` (the version's own file when none is recorded, so the error
    names it).
    """
    root = baselines_dir()
    if engine not in PER_VERSION or version is None:
        return root / f"{engine}.json"
    own = root / f"{engine}-{version}.json"
    if update:
        return own
    target = Version(version)
    recorded: list[tuple[Version, Path]] = []
    for path in root.glob(f"{engine}-*.json"):
        try:
            recorded.append((Version(path.stem.removeprefix(f"{engine}-")), path))
        except InvalidVersion:
            continue
    older = [(v, p) for v, p in recorded if v <= target]
    return max(older)[1] if older else own


def _stable_nodeid(nodeid: str) -> str:
    path, sep, rest = nodeid.partition("::")
    return Path(path).name + sep + rest


def run_invariants(suites: Suites) -> dict[str, str]:
    """Run an engine's suites in-process (derandomized hypothesis) and return ``{test: outcome}``."""
    from harness.check.suites import run_suites, suites_dir
    from harness.subjects import DEFAULT_SUBJECT

    root = suites_dir().parent  # the suites and the conformance tests sit side by side
    paths = [str(root / name) for name in suites.files] or None
    outcomes, log = run_suites(
        DEFAULT_SUBJECT,
        select=suites.select,
        paths=paths,
        extra=["--hypothesis-profile", "ci", "-p", "no:randomly"],
    )
    if not outcomes:
        raise GateUnavailable(f"no suite test ran (select {suites.select!r}); pytest said:\n{log[-2000:]}")
    return {_stable_nodeid(o.nodeid): o.outcome for o in outcomes}


def observe(engine: str | EngineAdapter, *, suites: bool = True) -> dict[str, Any]:
    """Observe an engine (its name, or an adapter) as a baseline document: what its adapter sees, and
    the outcome of its invariant suites. ``EngineUnavailable`` if it cannot start here,
    ``ObservationError`` naming the probe that failed."""
    from harness import __version__

    engine_adapter = adapter(engine) if isinstance(engine, str) else engine
    seen = engine_adapter.observe()
    return new_baseline(
        seen.engine,
        seen.version,
        convention=seen.convention,
        observations=seen.observations,
        invariants=run_invariants(engine_adapter.suites) if suites else {},
        metrics=seen.metrics,
        figures=seen.figures,
        harness_version=__version__,
    )


def _installed(engine: str) -> str | None:
    """The installed version of a per-version engine (None for the others or when not installed)."""
    return adapter(engine).installed_version() if engine in PER_VERSION else None


def run_gate(
    engine: str,
    *,
    baseline: str | Path | None = None,
    update: bool = False,
    output: str | Path | None = None,
    suites: bool = True,
    observed: dict[str, Any] | None = None,
    stream: Any = None,
) -> int:
    """The gate; returns the exit status (0 ok, 1 regression, 2 could not run)."""
    out = stream or sys.stdout
    if baseline is not None:
        path = Path(baseline)
    else:
        path = default_baseline(engine, _installed(engine), update=update)
    if update and not suites and observed is None:
        print(
            "rrh gate: --update needs the suites (a baseline without invariants gates nothing)",
            file=sys.stderr,
        )
        return 2
    try:
        if observed is None:
            require_engine(engine)
        base = None if update else load_baseline(path)
    except GateUnavailable as err:
        print(f"rrh gate: cannot observe {engine}: {err}", file=sys.stderr)
        return 2
    except BaselineError as err:
        print(f"rrh gate: {err}", file=sys.stderr)
        return 2
    print(f"rrh gate: engine {engine}; observing (suites {'on' if suites else 'off'})…", file=out, flush=True)
    try:
        doc = observed if observed is not None else observe(engine, suites=suites)
    except ObservationError as err:
        print(f"rrh gate: a probe failed: {err}", file=sys.stderr)
        return 2
    except HarnessError as err:  # GateUnavailable, EngineUnavailable
        print(f"rrh gate: cannot observe {engine}: {err}", file=sys.stderr)
        return 2
    if output is not None and not _saved(doc, output):
        return 2
    failed = sorted(name for name, outcome in doc["invariants"].items() if outcome == "failed")
    conv = ", ".join(f"{k}={v}" for k, v in doc["convention"].items())
    print(f"{engine} {doc['version']}: convention {conv}", file=out)
    print(f"invariants: {count_outcomes(doc['invariants'].values())}", file=out)
    for name, entry in doc["metrics"].items():
        if entry["value"] is None:
            print(f"metric {name}: undefined: {entry['undefined']}", file=out)
    if update:
        if failed:
            print(
                f"rrh gate: not recording a baseline with failing invariants: {', '.join(failed)}",
                file=sys.stderr,
            )
            return 1
        if not _saved(doc, path):
            return 2
        print(f"baseline written: {path}", file=out)
        return 0
    assert base is not None
    if not doc["invariants"] and not suites:
        base = {**base, "invariants": {}}  # --no-suites: compare convention, observations and metrics only
    report: GateReport = compare(base, doc)
    print(f"compared with {path} ({base['engine']} {base['version']}):", file=out)
    print(report.format(), file=out)
    if not report.ok:
        print(
            f"rrh gate: FAILED — {len(report.regressions)} regression(s); after review, record the "
            f"new behaviour with: rrh gate --engine {engine} --update",
            file=out,
        )
        return 1
    print("rrh gate: OK", file=out)
    return 0


def _saved(doc: dict[str, Any], path: str | Path) -> bool:
    """Write ``doc`` to ``path``; on failure say why in one line (the caller exits 2)."""
    try:
        save_baseline(doc, path)
    except (OSError, BaselineError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        print(f"rrh gate: cannot write {path}: {reason}", file=sys.stderr)
        return False
    return True
