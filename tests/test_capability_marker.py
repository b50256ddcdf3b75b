"""The ``capability`` marker and the counterexample notes, end to end through pytest (``run_suites``).

A throwaway suite runs against a subject that provides ``splice`` only: a declared capability the
subject lacks is a skip naming it, asking for an undeclared one is a failure, a test counts for a
capability only when it asked for it, ``--rr-capability`` selects by the marker, and a failing
property reports the counterexample it noted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.check.suites import CheckOutcome, run_suites

SUBJECT = """
from harness.subjects import Subject

SUBJECT = Subject(name="splice-only", splice=lambda prompt_len, attempts: None)
"""

SUITE = """
import pytest
from hypothesis import given, note, settings, strategies as st

from harness.testing.suite import require


@pytest.mark.capability("splice")
def test_asks_for_what_it_declares(subject):
    assert require(subject, "splice") is not None


@pytest.mark.capability("layouts")
def test_needs_what_the_subject_lacks(subject):
    raise AssertionError("never runs: the subject has no layouts")


@pytest.mark.capability("splice")
def test_asks_for_what_it_does_not_declare(subject):
    require(subject, "truncate")


@pytest.mark.capability("splice")
def test_declares_but_never_asks(subject):
    pass


@pytest.mark.capability("splice")
@settings(derandomize=True, database=None, max_examples=50)
@given(n=st.integers(0, 10))
def test_property_with_a_note(subject, n):
    require(subject, "splice")
    note(f"counterexample: n is {n}")
    assert n < 3, "n too big"
"""


@pytest.fixture
def suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "splice_only.py").write_text(SUBJECT)
    path = tmp_path / f"test_marked_{tmp_path.name}.py"  # a module name of its own per test
    path.write_text(SUITE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return path


def _by_name(outcomes: list[CheckOutcome]) -> dict[str, CheckOutcome]:
    return {o.nodeid.split("::")[-1]: o for o in outcomes}


def test_marker_skips_fails_and_counts_only_what_a_test_asked_for(suite: Path) -> None:
    outcomes = _by_name(run_suites("splice_only:SUBJECT", paths=[str(suite)])[0])
    asked = outcomes["test_asks_for_what_it_declares"]
    assert (asked.outcome, asked.capabilities) == ("passed", ("splice",))
    lacking = outcomes["test_needs_what_the_subject_lacks"]
    assert lacking.outcome == "skipped" and lacking.capabilities == ("layouts",)
    assert lacking.detail == "subject 'splice-only' does not provide 'layouts'"
    undeclared = outcomes["test_asks_for_what_it_does_not_declare"]
    assert undeclared.outcome == "failed" and "without declaring it" in undeclared.detail
    assert "@pytest.mark.capability('truncate')" in undeclared.detail
    never = outcomes["test_declares_but_never_asks"]
    assert (never.outcome, never.capabilities) == ("passed", ())  # observed, not declared


def test_rr_capability_selects_the_tests_that_declare_it(suite: Path) -> None:
    outcomes, _ = run_suites("splice_only:SUBJECT", paths=[str(suite)], capabilities=("layouts",))
    assert list(_by_name(outcomes)) == ["test_needs_what_the_subject_lacks"]


def test_a_failing_property_reports_the_counterexample_it_noted(suite: Path) -> None:
    outcomes, _ = run_suites("splice_only:SUBJECT", paths=[str(suite)], keyword="test_property_with_a_note")
    (failure,) = outcomes
    assert failure.outcome == "failed" and failure.detail == "n too big"
    assert failure.example == "n is 3"  # the shrunk example, in the suite's words; nothing else
