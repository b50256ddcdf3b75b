"""Run the invariant suites in-process against a subject and collect one outcome per test.

``rrh check`` is a thin layer over pytest: the suites in ``suites/`` are the single definition of
every invariant, and this module runs them quietly and keeps what a report needs.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings


@dataclass(frozen=True)
class CheckOutcome:
    """The result of one test of a suite."""

    nodeid: str
    suite: str
    invariant: str
    outcome: str  # "passed" | "failed" | "skipped"
    detail: str
    seconds: float


def suites_dir() -> Path:
    """Where the installed suites live (the ``suites`` package ships with the harness)."""
    import suites

    return Path(suites.__file__).parent


class _Collector:
    """A pytest plugin object that records each test's docstring and outcome."""

    def __init__(self) -> None:
        self.docs: dict[str, str] = {}
        self.outcomes: list[CheckOutcome] = []
        self._seen: set[str] = set()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
            label = doc.strip().splitlines()[0] if doc.strip() else item.name
            _, bracket, param = item.name.partition("[")
            self.docs[item.nodeid] = f"[{param} {label}" if bracket else label

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # One outcome per test: the call phase, or an earlier phase that skipped or failed.
        if report.nodeid in self._seen or (report.when != "call" and report.passed):
            return
        self._seen.add(report.nodeid)
        detail = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = str(report.longrepr[2]).removeprefix("Skipped: ")
        elif report.failed:
            detail = _failure_summary(report)
        module = report.nodeid.split("::")[0]
        self.outcomes.append(
            CheckOutcome(
                nodeid=report.nodeid,
                suite=Path(module).stem.removeprefix("test_"),
                invariant=self.docs.get(report.nodeid, report.nodeid.split("::")[-1]),
                outcome=report.outcome,
                detail=detail,
                seconds=report.duration,
            )
        )


def _failure_summary(report: pytest.TestReport) -> str:
    """The most telling line of a failure: the exception message, not the traceback."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).strip()
    return str(report.longrepr).strip().splitlines()[-1]


def run_suites(
    subject: str,
    *,
    select: str = "not slow and not gpu",
    paths: Sequence[str] | None = None,
    extra: Sequence[str] = (),
) -> tuple[list[CheckOutcome], str]:
    """Run the suites against ``subject`` (a ``module:attr`` spec) and return outcomes and pytest's log.

    ``extra`` are further pytest arguments (``-x``, ``--hypothesis-seed=N``). The hypothesis
    profile active before the run is restored after it, so a run inside a test session leaves the
    session's settings alone.
    """
    from harness import pytest_plugin

    collector = _Collector()
    profile = settings.get_current_profile_name()
    requested = list(pytest_plugin._requested)  # an enclosing test's own capabilities
    args = [
        *(paths or [str(suites_dir())]),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-m",
        select,
        "--rr-subject",
        subject,
        *extra,
    ]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            pytest.main(args, plugins=[collector])
    finally:
        settings.load_profile(profile)
        pytest_plugin._requested[:] = requested
    return collector.outcomes, log.getvalue()
