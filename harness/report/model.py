"""The ``rrh check`` report as a typed object: what one run found about one subject.

:class:`CheckReport` holds the suites' results per invariant, the mismatch lab(s), the environment,
what was not run and why. Its header line and verdict are derived from it
(:mod:`harness.report.verdict`), its JSON document made from it (:mod:`harness.report.document`),
never stored beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from harness.outcomes import OutcomeCounts, count_outcomes
from harness.report.environment import Environment

Mark = Literal["PASS", "FAIL", "skip"]
#: pytest's outcome → the report's mark.
MARKS: dict[str, Mark] = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}
LEGEND: dict[Mark, str] = {
    "PASS": "the invariant held on every case the suite generated (property-based: many random cases)",
    "FAIL": "a counterexample broke it; the smallest one found is shown in words — this is a bug to fix",
    "skip": "not checked: the subject lacks the capability, or this machine lacks the engine (reason shown)",
}

#: ``harness.metrics.accumulator.LogprobGap.as_dict()`` with nan as ``None``.
Gap = dict[str, float | int | None]


@dataclass(frozen=True)
class SubjectInfo:
    """The implementation under test: its ``module:attr``, its name, the capabilities it provides."""

    spec: str
    name: str
    capabilities: tuple[str, ...]


@dataclass(frozen=True)
class RunSummary:
    """One pytest run of the suites: which suites (``selection``), against which engine, how long."""

    name: str
    engine: str
    selection: str
    tests: int
    seconds: float
    note: str  # why the run was partial or did not happen; empty otherwise


@dataclass(frozen=True)
class InvariantResult:
    """One test of a suite: one invariant, possibly for one parameter (router family, dtype, model type).

    ``message``: the assertion in plain words (FAIL) or the reason (skip); ``example``: hypothesis's
    falsifying example in words (FAIL of a property-based test); ``capabilities``: what it called
    on the subject (a PASS without any checked the harness, not the subject).
    """

    nodeid: str
    run: str
    suite: str
    invariant: str
    result: Mark
    message: str
    example: str
    capabilities: tuple[str, ...]
    seconds: float


Counts = OutcomeCounts
"""How many invariants passed (on the subject or not), failed, were skipped (:mod:`harness.outcomes`)."""


@dataclass(frozen=True)
class Histogram:
    """|Δ log-prob| counts per bin of the lab's ``histogram_edges``; ``flipped_counts``: the same over
    the tokens whose routing had flipped (``None`` when the lab gave no flipped mask)."""

    tokens: int
    counts: tuple[int, ...]
    flipped_counts: tuple[int, ...] | None


@dataclass(frozen=True)
class ArmSummary:
    """One trainer setting of the lab ("no replay" or "R3"): routing disagreement and log-prob gap."""

    name: str
    disagreement: float | None  # fraction of (position, MoE layer) routes that differ (set comparison)
    token_disagreement: float | None  # fraction of positions with a differing route in any MoE layer
    per_layer_disagreement: tuple[float | None, ...]  # in the order of the lab's moe_layers
    gap: Gap
    gap_on_flipped: Gap
    abs_delta_histogram: Histogram | None  # None when the lab gave no per-token |Δ|


@dataclass(frozen=True)
class LabSummary:
    """One mismatch lab: rollouts vs a full-forward trainer recompute, without replay and with R3."""

    engine: str
    family: str
    config: dict[str, Any]  # harness.lab.LabConfig as a dict
    moe_layers: tuple[int, ...]
    flipped_tokens: int
    response_tokens: int
    seconds: float
    histogram_edges: tuple[float, ...]
    arms: tuple[ArmSummary, ArmSummary]  # without replay, with R3
    note: str


@dataclass(frozen=True)
class CheckReport:
    """Everything one ``rrh check`` found about one subject."""

    created: str  # ISO 8601 UTC
    command: str
    subject: SubjectInfo
    engine: str  # default | reference | hf | vllm
    family: str | None
    runs: tuple[RunSummary, ...]
    invariants: tuple[InvariantResult, ...]
    labs: tuple[LabSummary, ...]
    notes: tuple[str, ...]  # what the reader should know (parts not run, and why)
    errors: tuple[str, ...]  # checks that crashed instead of reporting; any fails the verdict
    environment: Environment
    wall_seconds: float

    def results(self, mark: Mark) -> list[InvariantResult]:
        """The invariants with this result, in run order."""
        return [i for i in self.invariants if i.result == mark]

    @property
    def verified(self) -> list[InvariantResult]:
        """The invariants that held on the subject: the passes that called one of its capabilities.

        The one count of passes the verdict and the page's PASS badge both give; a pass that never
        called the subject (a conformance test of the harness's own backends, a check of the
        harness itself) verified nothing about it.
        """
        return [i for i in self.results("PASS") if i.capabilities]

    @property
    def counts(self) -> Counts:
        outcome_of = {mark: outcome for outcome, mark in MARKS.items()}
        return count_outcomes(outcome_of[i.result] for i in self.invariants)
