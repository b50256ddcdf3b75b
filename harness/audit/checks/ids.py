"""The ids of each route: ``ids_valid`` (``top_k`` distinct ids in ``[0, num_experts)``),
``moe_layer_nonzero`` (no MoE layer of a sample all zero: a capture that never ran) and
``dense_empty`` (a dense layer's slot of a decoder-axis trace holds no route).

The fast check runs on the whole batch (``harness.audit.checks.kernels``); offenders are located only in a
batch that failed it, in spans of about ``LOCATE_ROWS`` rows.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks import kernels as audit_kernels
from harness.audit.checks.context import BatchContext, Offenders
from harness.trace import LayerAxis
from harness.trace import kernels as trace_kernels

LOCATE_ROWS = 4096
"""Rows of a batch whose offenders are located at once (only in a batch that failed a fast check)."""


def ids(ctx: BatchContext) -> None:
    """``ids_valid``, ``moe_layer_nonzero`` and ``dense_empty`` on the engine's captured rows."""
    b, routes = ctx.b, ctx.engine.routes
    checked = int(ctx.engine.valid.sum())
    for name in ("ids_valid", "moe_layer_nonzero", "dense_empty"):
        if not checked:
            ctx.state.note_missing(name, "engine_routes")
    valid_found, zero_found, dense_found = (Offenders(b, ctx.order) for _ in range(3))
    if routes.shape[0]:
        # Ids in range: read off the counts (uint8 ids); no repeated id: one compiled pass (routes
        # that fit a word). Either may also flag uncaptured rows: _locate_ids keeps captured ones.
        out_of_range = ctx.counts().out_of_range()
        repeats = audit_kernels.repeats(routes, ctx.moe) if b.top_k > 1 else False
        if out_of_range is not None and repeats is not None:
            failed = out_of_range or repeats
        else:
            selected = routes if ctx.captured.all() else routes[ctx.captured]
            moe_mask = np.zeros(routes.shape[1], dtype=bool)
            moe_mask[ctx.moe] = True
            failed = audit_kernels.ids_invalid(selected, b.num_experts, moe_mask)
        if failed or b.top_k == 1:
            _locate_ids(ctx, routes, valid_found, zero_found)
        dense = np.setdiff1d(np.arange(routes.shape[1]), ctx.moe)
        # Rows with no captured route hold filler (the dump's, zeroed or not): never judged.
        if b.layer_axis is LayerAxis.DECODER and dense.size and routes[:, dense].any():
            cells = np.argwhere(routes[:, dense].any(axis=2) & ctx.captured[:, None])
            _cells(ctx, dense_found, cells[:, 0], dense[cells[:, 1]], "0 (dense layer: no route)",
                        lambda r, s: f"ids {routes[r, s].tolist()}", slot_is_decoder=True)  # fmt: skip
    ctx.finish("ids_valid", valid_found, checked)
    ctx.finish("moe_layer_nonzero", zero_found, checked)
    ctx.finish("dense_empty", dense_found, checked)


def _cells(
    ctx: BatchContext,
    found: Offenders,
    rows: Any,
    slots: Any,
    expected: str,
    actual: Any,
    slot_is_decoder: bool = False,
) -> None:
    """Offenders at global engine rows ``rows`` and layer slots ``slots``."""
    owner = ctx.row_owner[rows]
    local = rows - ctx.engine.row_offsets[owner]
    layer = (
        slots
        if slot_is_decoder
        else np.asarray(ctx.b.moe_layers)[slots]
        if ctx.b.layer_axis is LayerAxis.MOE_ORDINAL
        else slots
    )
    found.cells(owner, local, np.asarray(layer, dtype=np.int64),
                lambda i: (expected, actual(int(rows[i]), int(slots[i]))))  # fmt: skip


def _locate_ids(
    ctx: BatchContext, routes: npt.NDArray[Any], valid_found: Offenders, zero_found: Offenders
) -> None:
    """The offenders of ``ids_valid`` and ``moe_layer_nonzero``, over spans of whole samples of
    about ``LOCATE_ROWS`` rows (the temporaries stay the size of a span, not of the batch)."""
    offsets = ctx.engine.row_offsets
    marks = np.searchsorted(offsets, np.arange(0, offsets[-1], LOCATE_ROWS), side="right") - 1
    spans = [*np.unique(np.concatenate([[0], marks])).tolist(), ctx.b.size]
    for s0, s1 in itertools.pairwise(spans):
        if s1 > s0:
            _locate_span(ctx, routes, int(s0), int(s1), valid_found, zero_found)


def _passes(routes: npt.NDArray[Any], moe: npt.NDArray[np.intp], num_experts: int) -> bool:
    """Whether the fast checks pass on a span: ids below ``num_experts`` and no repeated id in a MoE
    slot (one compiled pass each; routes that fit no machine word are never said to pass)."""
    if not routes.shape[0]:
        return True
    repeats = audit_kernels.repeats(routes, moe)
    return repeats is False and int(routes[:, moe].max()) < num_experts


def _locate_span(
    ctx: BatchContext,
    routes: npt.NDArray[Any],
    s0: int,
    s1: int,
    valid_found: Offenders,
    zero_found: Offenders,
) -> None:
    b = ctx.b
    r0, r1 = int(ctx.engine.row_offsets[s0]), int(ctx.engine.row_offsets[s1])
    if b.top_k > 1 and _passes(routes[r0:r1], ctx.moe, b.num_experts):
        return  # no id out of range and no repeated id (so no all-zero route): nothing to locate
    moe_routes = routes[r0:r1, ctx.moe]
    captured = ctx.captured[r0:r1]
    bad = (moe_routes >= b.num_experts).any(axis=2)
    if b.top_k > 1:
        bad |= trace_kernels.repeated_pairs(np.ascontiguousarray(moe_routes))
    bad &= captured[:, None]
    cells = np.argwhere(bad)
    slots = ctx.moe[cells[:, 1]]
    _cells(ctx, valid_found, cells[:, 0] + r0, slots, f"{b.top_k} distinct ids in [0, {b.num_experts})",
                lambda r, s: f"ids {routes[r, s].tolist()}")  # fmt: skip
    # A (sample, MoE layer) whose captured rows are all zero: a capture that never ran.
    zero = ~moe_routes.any(axis=2) | ~captured[:, None]
    rows = ctx.engine_rows[s0:s1]
    has = (rows > 0) & ctx.engine.valid[s0:s1]
    if not has.any():
        return
    starts = ctx.engine.row_offsets[s0:s1][has] - r0
    all_zero = np.logical_and.reduceat(zero, starts, axis=0)
    some_captured = np.add.reduceat(captured.astype(np.int64), starts) > 0
    all_zero &= some_captured[:, None] & (rows[has] > 1)[:, None]
    pairs = np.argwhere(all_zero)
    samples = s0 + np.flatnonzero(has)[pairs[:, 0]]
    layer = np.asarray(b.moe_layers)[pairs[:, 1]]
    zero_found.cells(
        samples,
        np.zeros(samples.size, np.int64),
        layer.astype(np.int64),
        lambda i: ("a captured route", f"every row of MoE layer {int(layer[i])} is 0"),
    )
