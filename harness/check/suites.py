"""Run the invariant suites in-process against a subject and collect one outcome per test.

``rrh check`` is a thin layer over pytest: the suites in ``suites/`` are the single definition of
every invariant, and this module runs them quietly and keeps what a report needs: for each test
its invariant (the docstring's first line), PASS/FAIL/skip, and for a failure the suite's own
assertion message in plain words plus, for a property-based test, the counterexample the suite
described with ``hypothesis.note`` (the plugin puts the notes on the report; nothing here reads
hypothesis's printed output).
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from harness.errors import HarnessError

#: ``progress(done, total, outcome)`` is called once per finished test (``total`` is the number of
#: selected tests, known once collection is over).
ProgressCallback = Callable[[int, int, "CheckOutcome"], None]


@dataclass(frozen=True)
class CheckOutcome:
    """The result of one test of a suite.

    ``outcome`` is pytest's: ``"passed"``, ``"failed"`` or ``"skipped"``; a suite file that cannot
    even be collected is one ``"failed"`` outcome whose ``detail`` names the error. ``detail`` is the
    failure's message in plain words (first line, no ``assert …`` rewriting noise) or the skip
    reason; ``example`` is the falsifying example of a property-based test in words ("" if none).
    """

    nodeid: str
    suite: str
    invariant: str
    outcome: str  # "passed" | "failed" | "skipped"
    detail: str
    seconds: float
    example: str = ""
    capabilities: tuple[str, ...] = ()
    conformance: bool = False  # a test of the harness's own backends (``conformance/``), not a suite


def suites_dir() -> Path:
    """Where the installed suites live (the ``suites`` package ships with the harness)."""
    import suites

    return Path(suites.__file__).parent


def conformance_dir() -> Path:
    """Where the conformance tests of the harness's own backends live: next to the suites (shipped
    like them). Run by path, never imported here: they sit above the runner (they test the gate)."""
    return suites_dir().parent / "conformance"


# --------------------------------------------------------------------------------------------
# failure text → plain words
# --------------------------------------------------------------------------------------------


def failure_message(message: str) -> str:
    """The first line of an exception's text as pytest reports it (``reprcrash.message``), in words.

    Without ``AssertionError:`` (pytest's ``assert 11 == 7`` rewriting is on the following lines and
    stays out); other exception types keep their name (``ValueError: …``). A bare ``assert x`` with
    no message gives ``"assert x"`` (the caller may have something better, see
    :func:`failure_summary`). An exception group's framing (``+ Exception Group …``, ``| …``) says
    nothing: its first real line is taken.
    """
    lines = [line for line in message.strip().splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    if first.startswith(("+ Exception Group", "| ")):
        real = [ln.strip(" |+-") for ln in lines if ln.strip(" |+-") and "Exception Group" not in ln]
        first = real[0] if real else first
    for prefix in ("AssertionError: ", "AssertionError"):
        if first.startswith(prefix):
            return first[len(prefix) :].strip()
    return first


def skip_reason(text: str) -> str:
    """A skip's own reason: its first line (notes that follow, such as the example hypothesis was
    running when an ``@example`` skipped, say nothing about why)."""
    lines = [ln.strip() for ln in text.removeprefix("Skipped: ").splitlines() if ln.strip()]
    return lines[0] if lines else "skipped"


def counterexample(notes: Sequence[str], already_said: str = "") -> str:
    """A failing example in words: the suite's ``hypothesis.note`` descriptions joined on one line,
    less those the failure message ``already_said`` (a splice message names its schedule)."""
    return "; ".join(_one_line(n) for n in notes if _one_line(n) and _one_line(n) not in already_said)


def _one_line(value: str) -> str:
    return re.sub(r"\s+", " ", value).strip()


def failure_summary(report: pytest.TestReport) -> tuple[str, str]:
    """``(message, example)`` of a failed test report in plain words: the failure's message (see
    :func:`failure_message`) and the suite's counterexample notes (see :func:`counterexample`)."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:  # a string longrepr (e.g. an internal error): its last line says most
        text = str(longrepr).strip()
        return (text.splitlines()[-1] if text else "failed"), ""
    message = failure_message(str(crash.message))
    if not message or message.startswith("assert "):
        # No message of its own: the failing source line says more than pytest's ``assert False``.
        source = _failing_source_line(longrepr)
        if source:
            message = f"{source} did not hold" + (f" ({message})" if message else "")
    notes: Any = dict(report.user_properties).get("rr_counterexample", ())
    return message or "failed", counterexample(notes, already_said=message)


def _failing_source_line(longrepr: Any) -> str:
    """The ``>``-marked source line of the innermost traceback entry, or ``""``."""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    if not entries:
        chain = getattr(longrepr, "chain", None) or []
        entries = chain[-1][0].reprentries if chain else []
    for entry in reversed(entries):
        for line in getattr(entry, "lines", []) or []:
            if line.startswith(">"):
                return _one_line(line[1:])
    return ""


# --------------------------------------------------------------------------------------------
# the pytest run
# --------------------------------------------------------------------------------------------


def _first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line (a sentence may wrap onto a second line)."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines()).strip()


class _Collector:
    """A pytest plugin object that records each test's docstring and outcome."""

    def __init__(self, progress: ProgressCallback | None = None) -> None:
        self.docs: dict[str, str] = {}
        self.conformance: set[str] = set()  # node ids of the tests under ``conformance_dir()``
        self.outcomes: list[CheckOutcome] = []
        self.total = 0
        self._seen: set[str] = set()
        self._progress = progress

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        conformance = conformance_dir().resolve()
        for item in items:
            doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
            label = _first_paragraph(doc) or item.name
            _, bracket, param = item.name.partition("[")
            self.docs[item.nodeid] = f"[{param} {label}" if bracket else label
            if Path(item.path).resolve().is_relative_to(conformance):
                self.conformance.add(item.nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if not report.failed:
            return
        text = str(report.longrepr).strip().splitlines()
        error = next(
            (ln[1:].strip() for ln in reversed(text) if ln.startswith("E ")), text[-1] if text else ""
        )
        self._add(
            CheckOutcome(
                nodeid=report.nodeid,
                suite=Path(report.nodeid.split("::")[0]).stem.removeprefix("test_"),
                invariant="the suite loads",
                outcome="failed",
                detail=f"the suite could not be collected: {error}",
                seconds=0.0,
            )
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # One outcome per test: the call phase, or an earlier phase that skipped or failed.
        if report.nodeid in self._seen or (report.when != "call" and report.passed):
            return
        self._seen.add(report.nodeid)
        detail, example = "", ""
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = skip_reason(str(report.longrepr[2]))
        elif report.failed:
            detail, example = failure_summary(report)
            if report.when != "call":
                detail = f"{report.when} failed: {detail}"
        module = report.nodeid.split("::")[0]
        caps: Any = dict(report.user_properties).get("rr_capabilities", ())
        self._add(
            CheckOutcome(
                nodeid=report.nodeid,
                suite=Path(module).stem.removeprefix("test_"),
                invariant=self.docs.get(report.nodeid, report.nodeid.split("::")[-1]),
                outcome=report.outcome,
                detail=detail,
                seconds=report.duration,
                example=example,
                capabilities=tuple(caps),
                conformance=report.nodeid in self.conformance,
            )
        )

    def _add(self, outcome: CheckOutcome) -> None:
        self.outcomes.append(outcome)
        if self._progress is not None:
            self._progress(len(self.outcomes), max(self.total, len(self.outcomes)), outcome)


def _suite_modules(*roots: Path) -> list[str]:
    """The names of the imported modules whose files lie under one of ``roots``.

    Compared as absolute path strings, against each root as given and resolved: resolving every
    module's path (thousands, with torch loaded) took 0.9 s per call, most of a kill run.
    """
    prefixes = tuple(
        {os.path.join(os.path.abspath(form), "") for root in roots for form in (root, root.resolve())}
    )
    files = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    return [
        name
        for name, file in files.items()
        if isinstance(file, str) and os.path.abspath(file).startswith(prefixes)
    ]


@contextlib.contextmanager
def fresh_suite_modules() -> Iterator[None]:
    """Import the suite modules anew for a nested run; the enclosing session's come back after.

    Hypothesis fixes a test's settings when its module is imported (``@settings(max_examples=…)``
    inherits the profile active then), so a nested run that reused an enclosing session's modules
    would run under that session's profile, not its own (a kill run would shrink and explain each
    failure: a 0.5 s kill took 45 s).
    """
    roots = (suites_dir(), conformance_dir())
    saved = {name: sys.modules.pop(name) for name in _suite_modules(*roots)}
    try:
        yield
    finally:
        for name in _suite_modules(*roots):
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread inside, the caller's count after.

    The suites' models are tiny, so a forward is dominated by thread hand-offs: on a 2-core machine
    the replay and layouts suites took four times the CPU time with torch's default of two threads
    (a clone's root ``conftest.py`` sets one thread for its own pytest runs; an installed wheel has
    no such file, so the run sets it itself).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _FreezeImports:
    """A pytest plugin: once collected, what the imports built is moved out of the collector's sight.

    torch, transformers, megatron-core and hypothesis build a few hundred thousand objects; every
    full garbage collection walks them again (pytest's closing collections, and the automatic ones
    during the tests): 2 s of the replay and layouts suites' CPU time. Objects the tests make are
    collected as before; what existed when collection ended is kept for the process, even once it
    is garbage (a previous nested run's suite modules). The same as a clone's root
    ``conftest.py``, for an installed wheel that has none.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        gc.collect()
        gc.freeze()


def run_suites(
    subject: str,
    *,
    select: str = "not slow and not gpu",
    paths: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    keyword: str | None = None,
    capabilities: Sequence[str] = (),
    progress: ProgressCallback | None = None,
) -> tuple[list[CheckOutcome], str]:
    """Run the suites against ``subject`` (a ``module:attr`` spec) and return outcomes and pytest's log.

    ``select`` is a marker expression (``-m``), ``keyword`` a ``-k`` expression (e.g. one
    transformers model family), ``capabilities`` keeps only the tests that declare one of them
    (``@pytest.mark.capability``), ``extra`` further pytest arguments (``-x``,
    ``--hypothesis-seed=N``). ``progress`` is called after each test. The hypothesis profile
    active before the run is restored after it, so a run inside a test session leaves the
    session's settings alone; so is torch's thread count (the run uses one: :func:`one_torch_thread`).
    The outcomes are in the suites' collection order, also when ``RRH_ORDER_SEED`` shuffled the run.
    """
    collector = _Collector(progress)
    log = _pytest(collector, subject, select, paths, keyword, capabilities, extra)
    # The report follows the suites' own order, whatever order they ran in (--rr-order-seed).
    collected = {nodeid: i for i, nodeid in enumerate(collector.docs)}
    outcomes = sorted(collector.outcomes, key=lambda o: collected.get(o.nodeid, len(collected)))
    return outcomes, log


def collect_suites(
    subject: str,
    *,
    select: str = "not slow and not gpu",
    paths: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    keyword: str | None = None,
) -> list[str]:
    """The node ids ``run_suites`` with the same arguments would run, in collection order, without
    running one (what ``python -m harness.verdicts --new`` compares with a recording)."""
    collector = _Collector()
    log = _pytest(collector, subject, select, paths, keyword, (), (*extra, "--collect-only"))
    failed = [o.detail for o in collector.outcomes if o.outcome == "failed"]
    if failed:
        raise HarnessError(f"{subject}: the suites could not be collected: {failed[0]}\n{log[-2000:]}")
    return list(collector.docs)


def _pytest(
    collector: _Collector,
    subject: str,
    select: str,
    paths: Sequence[str] | None,
    keyword: str | None,
    capabilities: Sequence[str],
    extra: Sequence[str],
) -> str:
    """One in-process pytest run of the suites against ``subject``, reported to ``collector``: its log."""
    profile = settings.get_current_profile_name()
    args = [
        *(paths or [str(suites_dir())]),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-m",
        select,
        *(["-k", keyword] if keyword else []),
        *(f"--rr-capability={name}" for name in capabilities),
        "--rr-subject",
        subject,
        *extra,
    ]
    log = io.StringIO()
    try:
        with (
            contextlib.redirect_stdout(log),
            contextlib.redirect_stderr(log),
            fresh_suite_modules(),
            one_torch_thread(),
        ):
            pytest.main(args, plugins=[collector, _FreezeImports()])
    finally:
        settings.load_profile(profile)
    return log.getvalue()
