"""Counting test outcomes: how many invariants passed, failed and were skipped.

One function for every report that counts them (the terminal table, the JSON report, the mutant and
benign-zoo runs, the gate), so a new outcome or a changed rule is written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OUTCOMES = ("passed", "failed", "skipped")
"""pytest's outcomes of one test as the harness records them (``CheckOutcome.outcome``)."""


@dataclass(frozen=True)
class OutcomeCounts:
    """How many tests passed, failed and were skipped."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0

    @property
    def ran(self) -> int:
        """Tests that ran to a verdict (passed or failed): a run of only skips checked nothing."""
        return self.passed + self.failed

    def as_dict(self) -> dict[str, int]:
        """``{"passed": …, "failed": …, "skipped": …}`` (the JSON report's ``counts``)."""
        return {"passed": self.passed, "failed": self.failed, "skipped": self.skipped}

    def __str__(self) -> str:
        return f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"


def count_outcomes(outcomes: Iterable[str]) -> OutcomeCounts:
    """Count ``outcomes`` (each one of ``OUTCOMES``); ValueError naming any other value."""
    tally = dict.fromkeys(OUTCOMES, 0)
    for outcome in outcomes:
        if outcome not in tally:
            raise ValueError(f"outcome {outcome!r}: expected one of {OUTCOMES}")
        tally[outcome] += 1
    return OutcomeCounts(**tally)
