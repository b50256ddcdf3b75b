"""``harness.outcomes``: the one count of passed / failed / skipped tests."""

from __future__ import annotations

import pytest

from harness.outcomes import OutcomeCounts, count_outcomes


def test_counts_each_outcome_and_what_ran() -> None:
    counts = count_outcomes(["passed", "skipped", "failed", "passed", "skipped"])
    assert counts == OutcomeCounts(passed=2, failed=1, skipped=2)
    assert counts.ran == 3
    assert counts.as_dict() == {"passed": 2, "failed": 1, "skipped": 2}
    assert str(counts) == "2 passed, 1 failed, 2 skipped"


def test_nothing_counts_zero() -> None:
    assert count_outcomes([]) == OutcomeCounts(0, 0, 0)


def test_an_unknown_outcome_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'error'.*passed"):
        count_outcomes(["passed", "error"])
