"""Log-probs: ``logprobs_valid`` (finite and ≤ 0 on the loss mask, strict) and the ``logprob_gap``
metric (DESIGN §3.5), split by whether the token's routes agreed (``row_differs`` of ``replay``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks.context import BatchContext, Offenders, expand, offsets
from harness.audit.checks.state import Offender
from harness.audit.layout.batch import ListColumn
from harness.metrics.accumulator import GapTerms
from harness.metrics.inputs import LOGPROB_TOLERANCE


def logprobs_valid(ctx: BatchContext) -> None:
    """``logprobs_valid``; returns the flat mask and log-probs the gap metrics reuse."""
    b = ctx.b
    response = b.response_len
    ctx.resp_offsets = offsets(response)
    owners = np.repeat(np.arange(b.size), response)
    ctx.resp_owner = owners
    ctx.mask = expand(b.loss_mask, owners, owners.size, True, bool)
    found = Offenders(b, ctx.order)
    # Samples with log-probs of either side: counted per sample, so the sum over batches is
    # the same for any split of the run.
    checked = int((b.engine_logprobs.valid | b.trainer_logprobs.valid).sum())
    ctx.flat = {}
    for name in ("engine_logprobs", "trainer_logprobs"):
        column: ListColumn = getattr(b, name)
        values = expand(column, owners, owners.size, np.nan, np.float32)
        ctx.flat[name] = values
        present = column.valid[owners] & ctx.mask
        with np.errstate(invalid="ignore"):
            bad = present & ~(np.isfinite(values) & (values <= LOGPROB_TOLERANCE))
        idx = np.flatnonzero(bad)
        owner = owners[idx]
        local = idx - ctx.resp_offsets[owner]
        found.cells(owner, b.prompt_len[owner] + local, np.full(idx.size, -1, np.int64),
                    lambda i, v=values, idx=idx, n=name: ("a finite log-prob <= 0",
                                                      f"{n} {float(v[idx[i]])!r}"))  # fmt: skip
    if not checked:
        ctx.state.note_missing("logprobs_valid", "engine_logprobs")
    ctx.finish("logprobs_valid", found, checked)


def logprob_gap(ctx: BatchContext) -> None:
    """``logprob_gap`` per step, split by whether the token's routes agreed; each sample's mean |Δ|."""
    b = ctx.b
    engine, trainer = ctx.flat["engine_logprobs"], ctx.flat["trainer_logprobs"]
    both = b.engine_logprobs.valid & b.trainer_logprobs.valid
    if not both.any():
        for column in ("engine_logprobs", "trainer_logprobs"):
            if not getattr(b, column).valid.any():
                ctx.state.note_missing("logprob_gap", column)
        ctx.sample_gap = np.full(b.size, np.nan)
        return
    with np.errstate(invalid="ignore"):
        ok = ctx.mask & both[ctx.resp_owner] & np.isfinite(engine) & np.isfinite(trainer)
        ok &= (engine <= LOGPROB_TOLERANCE) & (trainer <= LOGPROB_TOLERANCE)
    agreed = flipped = None
    if ctx.row_differs is not None:
        local = np.arange(ctx.resp_owner.size) - ctx.resp_offsets[ctx.resp_owner]
        owner = ctx.resp_owner
        row = b.prompt_len[owner] + local - 1 - b.routes_start[owner]
        inside = (row >= 0) & (row < ctx.engine_rows[owner]) & b.routes["trainer"].valid[owner]
        global_row = np.where(inside, ctx.engine.row_offsets[owner] + row, 0)
        inside &= ctx.captured[global_row]
        differs = ctx.row_differs[global_row]
        agreed, flipped = inside & ~differs, inside & differs
    absd = np.where(ok, np.abs(trainer.astype(np.float64) - engine), 0.0)
    counts = np.bincount(ctx.resp_owner, weights=ok, minlength=b.size)
    sums = np.bincount(ctx.resp_owner, weights=absd, minlength=b.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        ctx.sample_gap = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    ctx.state.add_worst("logprob_gap", _gap_cells(ctx, engine, trainer, ok, absd))
    # The terms of every kept token once; each accumulator folds its tokens, a segment per sample.
    kept = np.flatnonzero(ok)
    tokens = GapTerms(trainer[kept].astype(np.float64), engine[kept].astype(np.float64))
    owners, steps = ctx.resp_owner[kept], b.step[ctx.resp_owner[kept]]
    for step in np.unique(b.step[both]).tolist():
        in_step = steps == step
        figures = ctx.state.step(step)
        targets = [(figures.gap, in_step)]
        if agreed is not None and flipped is not None:
            targets += [
                (figures.gap_agreed, in_step & agreed[kept]),
                (figures.gap_flipped, in_step & flipped[kept]),
            ]
        for acc, sel in targets:
            idx = np.flatnonzero(sel)
            if not idx.size:
                continue
            starts = np.flatnonzero(np.diff(owners[idx], prepend=-1)).astype(np.int64)
            acc.add_terms(tokens, idx, starts)


def _gap_cells(
    ctx: BatchContext,
    engine: npt.NDArray[Any],
    trainer: npt.NDArray[Any],
    ok: npt.NDArray[np.bool_],
    absd: Any,
) -> list[tuple[float, Offender]]:
    """Each worst sample by mean |Δ|, at its token of largest |Δ| (row: the token's position)."""
    b, items = ctx.b, []
    for s in ctx.worst_samples(ctx.sample_gap):
        lo, hi = int(ctx.resp_offsets[s]), int(ctx.resp_offsets[s + 1])
        j = int(np.argmax(np.where(ok[lo:hi], absd[lo:hi], -1.0)))
        position = int(b.prompt_len[s]) + j
        gap = float(ctx.sample_gap[s])
        items.append((gap, Offender(
            int(b.step[s]), b.sample_key[s], position, -1, f"engine log-prob {float(engine[lo + j]):.6g}",
            f"trainer log-prob {float(trainer[lo + j]):.6g} (|Δ| {float(absd[lo + j]):.3g}; the sample's "
            f"mean |Δ| {gap:.3g})", b.place(s, position - int(b.routes_start[s])),
        )))  # fmt: skip
    return items
