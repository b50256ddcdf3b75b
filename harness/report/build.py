"""From what ``rrh check`` ran (suite outcomes, mismatch-lab results) to a :class:`CheckReport`.

The per-token |Δ log-prob| histograms need the lab's per-token arrays. They are read from the lab
arms' ``abs_delta`` (and the result's ``flipped_mask``) when the lab provides them, or passed in
explicitly (:class:`LabRun`); without them an arm's histogram is ``None`` and the report says so.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from harness.check.suites import CheckOutcome
from harness.report.environment import Environment, environment
from harness.report.model import (
    MARKS,
    ArmSummary,
    CheckReport,
    Gap,
    Histogram,
    InvariantResult,
    LabSummary,
    RunSummary,
    SubjectInfo,
)

if TYPE_CHECKING:  # the lab runs models (torch); the report only reads its result
    from harness.lab.measure import LabArm, LabResult
    from harness.metrics.accumulator import LogprobGap

#: |Δ log-prob| histogram bins: four per decade from 1e-7 to 10; the first bin also holds exact zeros.
HIST_EDGES: tuple[float, ...] = (0.0, *(10.0 ** (e / 4) for e in range(-28, 5)))


@dataclass
class SuiteRun:
    """One pytest run of ``rrh check``: which suites, against what, and their outcomes."""

    name: str
    engine: str
    selection: str
    outcomes: list[CheckOutcome]
    seconds: float
    note: str = ""


@dataclass
class LabRun:
    """One mismatch lab run, with the optional per-token arrays behind the histograms.

    ``abs_delta`` maps an arm's name ("no replay", "R3") to |Δ log-prob| of every response token;
    ``flipped`` is a bool array of the same length, True where that token's routing had flipped.
    Both default to the lab result's own ``arm.abs_delta`` / ``result.flipped_mask`` when present.
    """

    engine: str
    result: LabResult
    seconds: float
    abs_delta: Mapping[str, Any] | None = None
    flipped: Any | None = None
    note: str = ""


def histogram(values: Any) -> list[int]:
    """Counts of ``values`` in :data:`HIST_EDGES` bins (values ≥ the last edge go to the last bin)."""
    v = np.abs(np.asarray(values, dtype=np.float64).ravel())
    v = v[np.isfinite(v)]
    idx = np.clip(np.searchsorted(HIST_EDGES, v, side="right") - 1, 0, len(HIST_EDGES) - 2)
    return np.bincount(idx, minlength=len(HIST_EDGES) - 1).astype(int).tolist()


def _number(x: Any) -> float | None:
    """A JSON number: ``None`` for nan/inf (JSON has neither)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _gap(gap: LogprobGap) -> Gap:
    return {k: (v if isinstance(v, int) else _number(v)) for k, v in gap.as_dict().items()}


def _histogram(deltas: Any, flipped: Any | None) -> Histogram | None:
    if deltas is None:
        return None
    d = np.abs(np.asarray(deltas, dtype=np.float64).ravel())
    f = None if flipped is None else np.asarray(flipped, dtype=bool).ravel()
    on_flipped = tuple(histogram(d[f])) if f is not None and f.shape == d.shape else None
    return Histogram(int(d.size), tuple(histogram(d)), on_flipped)


def _arm(run: LabRun, arm: LabArm) -> ArmSummary:
    deltas = (run.abs_delta or {}).get(arm.name)
    flipped = run.flipped if run.flipped is not None else run.result.flipped_mask
    routing = arm.routing
    return ArmSummary(
        name=arm.name,
        disagreement=_number(routing.disagreement),
        token_disagreement=_number(routing.token_disagreement),
        per_layer_disagreement=tuple(_number(x) for x in np.asarray(routing.per_layer).tolist()),
        gap=_gap(arm.gap),
        gap_on_flipped=_gap(arm.gap_on_flipped),
        abs_delta_histogram=_histogram(deltas if deltas is not None else arm.abs_delta, flipped),
    )


def lab_summary(run: LabRun) -> LabSummary:
    """What the report keeps of one lab run: per arm the routing disagreement, the gap, the histograms."""
    result = run.result
    without, r3 = _arm(run, result.without_replay), _arm(run, result.with_r3)
    moe_layers = result.without_replay.routing.moe_layers or range(len(without.per_layer_disagreement))
    return LabSummary(
        engine=run.engine,
        family=result.config.family,
        config=asdict(result.config),
        moe_layers=tuple(int(x) for x in moe_layers),
        flipped_tokens=int(result.flipped_tokens),
        response_tokens=int(result.response_tokens),
        seconds=round(run.seconds, 3),
        histogram_edges=HIST_EDGES,
        arms=(without, r3),
        note=run.note,
    )


def _invariant(o: CheckOutcome, run: SuiteRun) -> InvariantResult:
    return InvariantResult(
        nodeid=o.nodeid,
        run=run.name,
        suite=o.suite,
        invariant=o.invariant,
        result=MARKS[o.outcome],
        message=o.detail,
        example=o.example,
        capabilities=tuple(o.capabilities),
        seconds=round(o.seconds, 3),
    )


def build_report(
    *,
    subject_spec: str,
    subject_name: str,
    capabilities: Sequence[str],
    engine: str,
    family: str | None,
    runs: Sequence[SuiteRun],
    labs: Sequence[LabRun],
    command: str,
    wall_seconds: float,
    notes: Sequence[str] = (),
    errors: Sequence[str] = (),
    env: Environment | None = None,
) -> CheckReport:
    """Everything ``rrh check`` found (``env``: this machine's :func:`environment` unless given)."""
    return CheckReport(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        subject=SubjectInfo(subject_spec, subject_name, tuple(capabilities)),
        engine=engine,
        family=family,
        runs=tuple(
            RunSummary(r.name, r.engine, r.selection, len(r.outcomes), round(r.seconds, 3), r.note)
            for r in runs
        ),
        invariants=tuple(_invariant(o, run) for run in runs for o in run.outcomes),
        labs=tuple(lab_summary(lab) for lab in labs),
        notes=tuple(notes),
        errors=tuple(errors),
        environment=env if env is not None else environment(),
        wall_seconds=round(wall_seconds, 3),
    )
