"""Packed (THD) micro-batches: canonical routes → the rows Megatron-core's routers see, and back.

Pure torch, no megatron import. verl's default Megatron path (``engine.use_remove_padding=True``,
``data_format='thd'``) and SkyRL's packed path hand Megatron-core one sequence per micro-batch
(``[1, T]``, ``PackedSeqParams(qkv_format='thd')``): every token of sample 0, then of sample 1, …,
each sample padded with filler rows to a multiple of the alignment (``tp`` at CP = 1, ``tp·cp·2``
under context parallelism, FACTS §2: ``preprocess_packed_seqs`` / ``preprocess_thd_engine``,
``cu_seqlens_padded``; ``MegatronLayout.align``). With sequence
parallelism TP rank ``t`` holds the contiguous rows ``[t·T/tp, (t+1)·T/tp)`` of the packed buffer,
so a shard boundary may fall inside a sample and a sample boundary inside a shard.

Filler rows belong to no position of any sample: they carry no route of a trace (a recording's filler
rows are dropped on merge) and are never judged. Targets for them are any valid route
(``FILLER``: experts ``0 … k-1``); their output is loss-masked and no real row attends to them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from harness.errors import MegatronReplayError
from harness.trainers.megatron.layout import MegatronLayout, stage_router_targets
from reference_impl import layouts


def padded_lengths(lengths: Sequence[int], align: int) -> list[int]:
    """Each sample's row count in the packed buffer: its length rounded up to a multiple of ``align``."""
    return [-(-int(n) // align) * align for n in lengths]


def cu_seqlens(lengths: Sequence[int]) -> torch.Tensor:
    """Cumulative offsets ``[B + 1]`` (int32, starting at 0), the form ``PackedSeqParams`` holds."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), dim=0)
    return out


def packed_slots(lengths: Sequence[int], align: int) -> torch.Tensor:
    """Which ``(sample, position)`` each packed row holds: int64 ``[T, 2]``, ``(-1, -1)`` on filler rows."""
    rows = []
    for b, (n, padded) in enumerate(zip(lengths, padded_lengths(lengths, align), strict=True)):
        slot = torch.full((padded, 2), -1, dtype=torch.long)
        slot[:n, 0] = b
        slot[:n, 1] = torch.arange(n)
        rows.append(slot)
    return torch.cat(rows)


def lengths_of(attention_mask: torch.Tensor) -> list[int]:
    """Per-sample token counts of a right-padded ``[B, S]`` mask; raise unless it is right-padded."""
    mask = torch.as_tensor(attention_mask).bool()
    lengths = mask.sum(dim=1)
    expected = torch.arange(mask.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(mask, expected):
        raise MegatronReplayError(
            "attention_mask: a packed micro-batch's mask must be right-padded (each sample's tokens "
            "at positions 0 … n-1)"
        )
    if bool((lengths == 0).any()):
        raise MegatronReplayError("attention_mask: a sample of the packed micro-batch has no token")
    return [int(n) for n in lengths]


def check_cu_seqlens(lengths: Sequence[int], cu: torch.Tensor, cu_padded: torch.Tensor, tp: int) -> int:
    """The per-sample alignment of a packed micro-batch, read off ``cu_padded``: raise unless ``cu``
    are the offsets of ``lengths`` and ``cu_padded`` their offsets with each sample rounded up to one
    multiple of ``tp`` (the largest that explains them; any that does gives the same rows)."""
    want = cu_seqlens(lengths)
    if not torch.equal(torch.as_tensor(cu).cpu().int(), want):
        raise MegatronReplayError(
            f"packed_seq_params.cu_seqlens_q = {torch.as_tensor(cu).tolist()}, the mask's lengths give "
            f"{want.tolist()}"
        )
    padded = torch.as_tensor(cu_padded).cpu().long().diff().tolist()
    align = math.gcd(*padded) if padded else tp
    if len(padded) != len(lengths) or align % tp or padded != padded_lengths(lengths, align):
        raise MegatronReplayError(
            f"packed_seq_params.cu_seqlens_q_padded = {torch.as_tensor(cu_padded).tolist()}: not the "
            f"samples {list(lengths)} each padded to one multiple of tp = {tp} (e.g. "
            f"{cu_seqlens(padded_lengths(lengths, tp)).tolist()})"
        )
    return align


def filler(rows: int, num_layers: int, top_k: int) -> torch.Tensor:
    """A valid route for ``rows`` filler rows on every layer: experts ``0 … k-1`` (int64)."""
    return torch.arange(top_k).expand(rows, num_layers, top_k).clone()


def pack_routes(routes: torch.Tensor, lengths: Sequence[int], align: int) -> torch.Tensor:
    """One micro-batch's routes ``[B, S, L, k]`` → the packed buffer's rows ``[T, L, k]`` (filler rows
    get :func:`filler`)."""
    slots = packed_slots(lengths, align)
    real = slots[:, 0] >= 0
    out = filler(slots.shape[0], routes.shape[2], routes.shape[3])
    out[real] = routes[slots[real, 0], slots[real, 1]].long()
    return out


def unpack_routes(rows: torch.Tensor, lengths: Sequence[int], align: int, seq_len: int) -> torch.Tensor:
    """Inverse of :func:`pack_routes`: packed rows ``[T, L, k]`` → ``[B, S, L, k]`` (0 off each sample)."""
    slots = packed_slots(lengths, align)
    if rows.shape[0] != slots.shape[0]:
        raise MegatronReplayError(f"packed rows: {rows.shape[0]}, the lengths give {slots.shape[0]}")
    real = slots[:, 0] >= 0
    out = torch.zeros(len(lengths), seq_len, *rows.shape[1:], dtype=rows.dtype)
    out[slots[real, 0], slots[real, 1]] = rows[real]
    return out


def thd_rank_targets(
    routes: torch.Tensor,
    layout: MegatronLayout,
    *,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    vpp_chunk: int = 0,
) -> list[torch.Tensor]:
    """The targets of every router of one rank for a packed micro-batch, in build order: each
    ``[T/tp, k]`` int64 (``routes``: the decoder-axis global batch ``[dp·B, S, L, k]``)."""
    if layout.lengths is None:
        raise MegatronReplayError("thd_rank_targets: the layout has no lengths (not a packed layout)")
    b = layout.micro_batch
    packed = pack_routes(routes[dp_rank * b : (dp_rank + 1) * b], layout.lengths, layout.packing_align)
    return stage_router_targets(layouts.sp_shard(packed, layout.tp, tp_rank), layout, pp_rank, vpp_chunk)


def rank_slots(layout: MegatronLayout, tp_rank: int) -> torch.Tensor:
    """``(sample, position)`` of each row TP rank ``tp_rank`` holds, ``[T/tp, 2]`` (``-1`` on filler)."""
    if layout.lengths is None:
        raise MegatronReplayError("rank_slots: the layout has no lengths (not a packed layout)")
    return layouts.sp_shard(packed_slots(layout.lengths, layout.packing_align), layout.tp, tp_rank)
