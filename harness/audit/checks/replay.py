"""Replay: ``replay_fidelity`` (under R3 every selected row dispatched the engine's experts, as sets;
under R2 the update pass dispatched what the old-log-prob pass recorded) and the ``agreement``
metric of the trainer's live routing with the engine's (per layer, per token, any layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks import kernels as audit_kernels
from harness.audit.checks.context import BatchContext, Offenders
from harness.audit.checks.state import Offender
from harness.audit.layout.batch import RouteColumn
from harness.trace import AgreementCounts


def replay(ctx: BatchContext) -> None:
    """``replay_fidelity`` and the ``agreement`` metric: the trainer's routes against the targets."""
    b = ctx.b
    trainer, recorded = b.routes["trainer"], b.routes["recorded"]
    found = Offenders(b, ctx.order)
    checked = 0
    if not trainer.valid.any():
        ctx.state.note_missing("replay_fidelity", "trainer_routes")
        ctx.state.note_missing("agreement", "trainer_routes")
    if not ctx.engine.valid.any():  # the agreement names what is missing, not all it reads
        ctx.state.note_missing("agreement", "engine_routes")
    modes = np.array([m or "" for m in b.replay])
    if trainer.valid.any() and not np.isin(modes, ("R2", "R3", "none")).any():
        ctx.state.note_missing("replay_fidelity", "replay")
    elif trainer.valid.any() and not np.isin(modes, ("R2", "R3")).any():
        ctx.state.note_missing("replay_fidelity", "replayed rows")
    aligned = trainer.valid & ctx.engine.valid & (np.diff(trainer.row_offsets) == ctx.engine_rows)
    if aligned.any():
        overlap = _overlap(ctx, ctx.engine, trainer, aligned)
        _agreement(ctx, overlap, aligned)
        ctx.state.add_worst("agreement", _agreement_cells(ctx, overlap, trainer, aligned))
        r3 = aligned & (modes == "R3")
        checked += int(r3.sum())
        # Cells are located only in rows that differ somewhere (``row_differs``, one pass).
        assert ctx.row_differs is not None
        rows_bad = ctx.row_differs & ctx.captured & r3[ctx.row_owner]
        if rows_bad.any():
            bad = (overlap < b.top_k) & rows_bad[:, None]
            _replay_offenders(ctx, found, bad, ctx.engine, trainer, "engine")
    r2 = (
        trainer.valid
        & recorded.valid
        & (modes == "R2")
        & (np.diff(trainer.row_offsets) == np.diff(recorded.row_offsets))
    )
    if r2.any():
        overlap = _overlap(ctx, recorded, trainer, r2)
        checked += int(r2.sum())
        owner = np.repeat(np.arange(b.size), np.diff(recorded.row_offsets))
        bad = (overlap < b.top_k) & r2[owner][:, None]
        _replay_offenders(ctx, found, bad, recorded, trainer, "recorded", owner=owner)
    ctx.finish("replay_fidelity", found, checked)


def _overlap(
    ctx: BatchContext, a: RouteColumn, t: RouteColumn, which: npt.NDArray[np.bool_]
) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` per (row of ``a``, MoE layer); rows of samples not in ``which`` hold ``top_k``."""
    b = ctx.b
    ra, rt = a.routes, t.routes
    if not which.all() or not np.array_equal(a.row_offsets, t.row_offsets):
        out = np.full((ra.shape[0], ctx.moe.size), b.top_k, dtype=np.uint8)
        for s in np.flatnonzero(which).tolist():
            lo, hi = a.row_offsets[s], a.row_offsets[s + 1]
            tl = t.row_offsets[s]
            out[lo:hi] = audit_kernels.overlap(
                np.ascontiguousarray(ra[lo:hi][:, ctx.moe]),
                np.ascontiguousarray(rt[tl : tl + hi - lo][:, ctx.moe]),
                b.num_experts,
            )
        return out
    if ctx.moe.size != ra.shape[1]:
        ra, rt = np.ascontiguousarray(ra[:, ctx.moe]), np.ascontiguousarray(rt[:, ctx.moe])
    return audit_kernels.overlap(ra, rt, b.num_experts)


def _replay_offenders(
    ctx: BatchContext,
    found: Offenders,
    bad: Any,
    target: RouteColumn,
    trainer: RouteColumn,
    what: str,
    owner: Any = None,
) -> None:
    if not bad.any():
        return
    cells = np.argwhere(bad)
    rows = cells[:, 0]
    owner = ctx.row_owner if owner is None else owner
    s = owner[rows]
    local = rows - target.row_offsets[s]
    slots = ctx.moe[cells[:, 1]]
    layer = np.asarray(ctx.b.moe_layers)[cells[:, 1]]
    t_rows = trainer.row_offsets[s] + local

    def describe(i: int) -> tuple[str, str]:
        want = sorted(target.routes[rows[i], slots[i]].tolist())
        got = sorted(trainer.routes[t_rows[i], slots[i]].tolist())
        return f"{what} experts {want}", f"dispatched {got}"

    found.cells(s, local, layer.astype(np.int64), describe)


def _agreement(ctx: BatchContext, overlap: npt.NDArray[np.uint8], aligned: npt.NDArray[np.bool_]) -> None:
    """The ``agreement`` metric per step, each sample's disagreement and ``row_differs``: one pass."""
    b = ctx.b
    keep = ctx.captured & aligned[ctx.row_owner]
    figures = audit_kernels.agreement(
        overlap, keep, ctx.row_group, ctx.steps.size, ctx.row_owner, b.size, b.top_k
    )
    ctx.row_differs = figures["row_differs"]
    per_sample = figures["sample_differs"].astype(np.float64)
    cells = figures["sample_rows"].astype(np.float64) * ctx.moe.size
    with np.errstate(invalid="ignore", divide="ignore"):
        ctx.sample_disagreement = np.where(cells > 0, per_sample / np.maximum(cells, 1), np.nan)
    for g in np.flatnonzero(figures["positions"]).tolist():
        counts = AgreementCounts(
            top_k=b.top_k,
            positions=int(figures["positions"][g]),
            differs_per_layer=figures["differs_per_layer"][g].copy(),
            tokens_differ=int(figures["tokens_differ"][g]),
            overlap_sum=int(figures["overlap_sum"][g]),
        )
        step = ctx.state.step(int(ctx.steps[g]))
        if step.agreement is None:
            step.agreement = AgreementCounts(b.top_k)
        step.agreement.merge(counts)


def _agreement_cells(
    ctx: BatchContext, overlap: npt.NDArray[np.uint8], trainer: RouteColumn, aligned: npt.NDArray[np.bool_]
) -> list[tuple[float, Offender]]:
    """Each worst sample by trainer–engine disagreement, at its first differing (row, MoE layer)."""
    b, items = ctx.b, []
    score = np.where(aligned, ctx.sample_disagreement, np.nan)
    for s in ctx.worst_samples(score):
        lo, hi = int(ctx.engine.row_offsets[s]), int(ctx.engine.row_offsets[s + 1])
        bad = np.argwhere((overlap[lo:hi] < b.top_k) & ctx.captured[lo:hi, None])
        if not bad.size:
            continue
        row, j = int(bad[0, 0]), int(bad[0, 1])
        slot = int(ctx.moe[j])
        engine = sorted(ctx.engine.routes[lo + row, slot].tolist())
        mine = sorted(trainer.routes[int(trainer.row_offsets[s]) + row, slot].tolist())
        items.append((float(score[s]), Offender(
            int(b.step[s]), b.sample_key[s], row, int(b.moe_layers[j]), f"engine experts {engine}",
            f"trainer {mine} ({float(score[s]):.1%} of the sample's (row, MoE layer) routes differ)",
            b.place(s, row),
        )))  # fmt: skip
    return items
