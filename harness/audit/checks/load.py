"""The engine routes' counts per step: the ``fallback`` metric (rows with no captured route) and
``expert_load`` (ids per layer and expert), read off one pass that also digests the prompt rows
(``prefix``).
"""

from __future__ import annotations

import numpy as np

from harness.audit.checks.context import BatchContext
from harness.audit.checks.state import Offender


def fallback_and_load(ctx: BatchContext) -> None:
    """``fallback`` and ``expert_load`` per step, and the prompt rows' digests (``prefix``)."""
    n_steps = ctx.steps.size
    counts = ctx.counts()
    load, ctx.digests = counts.load(), counts.digests
    rows = np.bincount(ctx.row_group, minlength=n_steps)
    uncaptured = np.bincount(ctx.row_group[~ctx.captured], minlength=n_steps)
    in_steps = np.zeros(n_steps, dtype=bool)
    in_steps[ctx.sample_group[ctx.engine.valid]] = True
    for g in np.flatnonzero(in_steps).tolist():
        figures = ctx.state.step(int(ctx.steps[g]))
        figures.rows += int(rows[g])
        figures.uncaptured_rows += int(uncaptured[g])
        figures.load = load[g] if figures.load is None else figures.load + load[g]
    ctx.state.add_worst(
        "fallback",
        _fallback_cells(
            ctx,
        ),
    )


def _fallback_cells(ctx: BatchContext) -> list[tuple[float, Offender]]:
    """Each worst sample by rows without a captured route, at its first such row."""
    b, items = ctx.b, []
    for s in ctx.worst_samples(ctx.uncaptured.astype(np.float64)):
        lo, hi = int(ctx.engine.row_offsets[s]), int(ctx.engine.row_offsets[s + 1])
        row = int(np.flatnonzero(~ctx.captured[lo:hi])[0])
        count = int(ctx.uncaptured[s])
        items.append((float(count), Offender(
            int(b.step[s]), b.sample_key[s], row, -1, "a captured route",
            f"no route captured at {count} of {hi - lo} rows, the first this one", b.place(s, row),
        )))  # fmt: skip
    return items
