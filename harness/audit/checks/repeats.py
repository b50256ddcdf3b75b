"""``repeated_rows``: a detector of the duplicated resume, named only where chance cannot explain it."""

from __future__ import annotations

import numpy as np

from harness.audit.checks import repeat_kernels
from harness.audit.checks.context import BatchContext, Offenders

REPEAT_ALPHA = 1e-6
"""``repeated_rows`` names a segment only when a repeat of its length is less likely than this by chance,
given how often the sample's own rows repeat (``repeated_rows``)."""


def repeated_rows(ctx: BatchContext) -> None:
    """``repeated_rows``: a segment of m ≥ 2 captured rows equal, byte for byte in every layer, to the
    m rows just before it, within the sample's coverage — the shape a duplicated resume leaves when
    the framework cuts the rows back to ``P + R − 1``. Named only when the tokens of the two
    segments differ (a repeated text may legitimately route the same) and a repeat of that length
    is implausible by chance given how often the sample's own rows repeat: with ``n`` captured
    rows and ``c`` other equal pairs among them, ``n · q^m ≤ REPEAT_ALPHA`` for
    ``q = (c + 1) / (n(n − 1)/2 + 1)`` (low-entropy routing, where rows often repeat, needs a
    long segment before anything is named)."""
    b = ctx.b
    found = Offenders(b, ctx.order)
    checked = int(ctx.engine.valid.sum())
    if not checked:
        ctx.state.note_missing("repeated_rows", "engine_routes")
    lo = ctx.engine.row_offsets[:-1]
    cover = np.where(ctx.engine.valid, np.clip(ctx.expected_rows, 0, ctx.engine_rows), 0)
    start, length, pairs = repeat_kernels.repeated_runs(ctx.engine.routes, ctx.captured, lo, lo + cover)
    for s in np.flatnonzero(length >= 2).tolist():
        a, m = int(start[s]), int(length[s])
        rows = ctx.engine.routes[lo[s] : lo[s] + cover[s]]
        if not np.array_equal(rows[a : a + m], rows[a + m : a + 2 * m]):
            continue  # two hashes collided
        tokens = b.tokens.values[b.tokens.offsets[s] : b.tokens.offsets[s + 1]]
        p = int(b.routes_start[s]) + a
        if np.array_equal(tokens[p : p + m], tokens[p + m : p + 2 * m]):
            continue  # the text itself repeats
        n = int(ctx.captured[lo[s] : lo[s] + cover[s]].sum())
        q = (max(0, int(pairs[s]) - m) + 1) / (n * (n - 1) / 2 + 1)
        if n * q**m > REPEAT_ALPHA:
            continue
        found.one(
            s,
            f"new routes at rows [{a + m}, {a + 2 * m}) (their tokens differ from rows [{a}, {a + m}))",
            f"rows [{a + m}, {a + 2 * m}) repeat rows [{a}, {a + m}) in every layer (a duplicated resume?)",
            row=a + m,
        )
    ctx.finish("repeated_rows", found, checked)
