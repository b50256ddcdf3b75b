"""Row coverage (DESIGN §3.1) and its two forms over pieces of a sample: ``coverage`` (each trace
has ``prompt_len + response_len − 1 − routes_start`` rows), ``splice_consistency`` (each attempt's
rows of the spliced trace are its own payload, §3.4) and ``shard_union`` (the CP/SP shards of a
sample claim its rows with no gap or overlap, judged on the merged covers).
"""

from __future__ import annotations

import numpy as np

from harness.audit.checks import kernels as audit_kernels
from harness.audit.checks.context import BatchContext, Offenders
from harness.audit.checks.shard_cover import ShardCover
from harness.audit.checks.state import AuditState
from harness.audit.layout.batch import Batch


def coverage(ctx: BatchContext) -> None:
    """``coverage`` (DESIGN §3.1): each route column has ``P + R − 1 − routes_start`` rows."""
    b = ctx.b
    found = Offenders(b, ctx.order)
    checked = 0
    for name, column in b.routes.items():
        rows = np.diff(column.row_offsets)
        bad = column.valid & (rows != ctx.expected_rows)
        checked += int(column.valid.sum()) if name == "engine" else 0
        for s in np.flatnonzero(bad).tolist():
            found.one(
                s,
                f"{int(ctx.expected_rows[s])} rows (prompt_len + response_len − 1 − routes_start)",
                f"{int(rows[s])} rows in {name}_routes",
                row=int(min(rows[s], ctx.expected_rows[s])),
            )
    if not ctx.engine.valid.any():
        ctx.state.note_missing("coverage", "engine_routes")
    ctx.finish("coverage", found, checked)


def splice_consistency(ctx: BatchContext) -> None:
    """``splice_consistency`` (DESIGN §3.4): each attempt's own rows of the spliced engine routes
    are that attempt's payload, as sets — prompt rows from the first attempt that added tokens,
    then each attempt's new positions ``[P + e_{j−1} − 1, P + e_j − 1)``."""
    b = ctx.b
    payloads = b.attempts
    found = Offenders(b, ctx.order)
    which = payloads.valid & ctx.engine.valid & b.attempt_ends.valid
    if not payloads.valid.any():
        ctx.state.note_missing("splice_consistency", "attempt payloads")
    moe = ctx.moe
    for s in np.flatnonzero(which).tolist():
        ends = b.attempt_ends.values[b.attempt_ends.offsets[s] : b.attempt_ends.offsets[s + 1]]
        rows = b.attempt_rows.values[b.attempt_rows.offsets[s] : b.attempt_rows.offsets[s + 1]]
        first_row = int(payloads.row_offsets[s])
        spliced = ctx.engine.routes[ctx.engine.row_offsets[s] : ctx.engine.row_offsets[s + 1]]
        captured = ctx.captured[ctx.engine.row_offsets[s] : ctx.engine.row_offsets[s + 1]]
        prompt, start = int(b.prompt_len[s]), int(b.routes_start[s])
        before, first = 0, True
        for j, (end, count) in enumerate(zip(ends.tolist(), rows.tolist(), strict=True)):
            payload = payloads.routes[first_row : first_row + count]
            first_row += count
            if end <= before:
                before = max(before, end)
                continue  # an attempt with no new token contributes nothing
            lo = max(0, (0 if first else prompt + before - 1) - start)
            hi = min(prompt + end - 1 - start, spliced.shape[0])
            first, before = False, end
            if count < hi:
                expected = f"attempt {j}'s payload covering rows [{lo}, {hi})"
                found.one(s, expected, f"{count} rows", row=count)
                break
            overlap = audit_kernels.overlap(
                np.ascontiguousarray(spliced[lo:hi][:, moe]),
                np.ascontiguousarray(payload[lo:hi][:, moe]),
                b.num_experts,
            )  # fmt: skip
            bad = np.argwhere((overlap < b.top_k) & captured[lo:hi, None])
            if bad.size:
                cells_row = bad[:, 0] + lo
                cells_slot = moe[bad[:, 1]]
                found.cells(
                    np.full(bad.shape[0], s, np.int64), cells_row.astype(np.int64),
                    np.asarray(b.moe_layers, np.int64)[bad[:, 1]],
                    lambda i, j=j, p=payload, q=spliced, r=cells_row, c=cells_slot: (
                        f"attempt {j}'s experts {sorted(p[r[i], c[i]].tolist())}",
                        f"spliced {sorted(q[r[i], c[i]].tolist())}",
                    ),
                )  # fmt: skip
    ctx.finish("splice_consistency", found, int(which.sum()))


def shard_union(batch: Batch, state: AuditState) -> None:
    """Claim each shard row's positions (layout v2: a CP/SP rank's part of a sample) in ``state``'s
    shard covers; ``shard_union`` is judged on the merged covers (``AuditState.shard_offenders``).

    A position outside the sample's route rows is kept in its cover too: a sample is one offender
    however many ways its shards are wrong."""
    expected = batch.prompt_len + batch.response_len - 1 - batch.routes_start
    for s in range(batch.size):
        key = (int(batch.step[s]), batch.sample_key[s])
        rows = batch.positions.values[batch.positions.offsets[s] : batch.positions.offsets[s + 1]]
        cover = state.shards.get(key)
        if cover is None:
            cover = ShardCover(int(expected[s]), int(batch.shards[s]), where=batch.where(s))
            state.shards[key] = cover
        else:  # another shard row of the sample: it may declare other route rows (its routes_start)
            cover.declare(int(expected[s]), batch.where(s))
        outside = (rows < 0) | (rows >= expected[s])
        if outside.any():
            cover.claim_outside(int(rows[outside].min()), int(expected[s]), batch.where(s))
            rows = rows[~outside]
        cover.shards = max(cover.shards, int(batch.shards[s]))
        cover.claim(int(batch.shard[s]), int(batch.rank[s]), rows.astype(np.int64))
