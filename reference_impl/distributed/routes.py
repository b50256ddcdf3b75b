"""The trainer's glue between global traces and ranks: slice targets for a rank, gather recordings back.

A *global* trace is one sequence's routes ``[S, layers, k]`` (decoder axis, dense slots 0, as
vLLM/SGLang return them; or MoE-ordinal, as R2 records), with a replay mask ``[S]``. A rank's
routers see only their tokens, so each rank replays the rows of its tokens and the columns of its
layers:

    rows    — CP zig-zag shard (``layouts.cp_zigzag_shard``), then the SP shard of TP rank
              (``layouts.sp_shard``): exactly the tokens the rank's routers route, padding
              included (padding rows are zeros with mask False: never replayed);
    columns — per virtual chunk, the stage's MoE layers (``layouts.stage_targets`` from a decoder
              trace, ``layouts.stage_targets_moe_ordinal`` from an MoE-ordinal one), chunks in
              this rank's order, which is its routers' order.

EP changes nothing here: routing precedes dispatch, targets and recordings hold global ids.
Recordings go back the other way: ``sp_gather`` over TP, ``cp_zigzag_merge`` over CP and
``merge_stage_recordings`` over PP/VPP, after an ``all_gather_object`` of every rank's pieces.

Every function takes the ``layouts`` to use (`reference_impl.layouts` or a subject's), so a
trainer's slicing can be checked against what the ranks actually compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import LayerAxis, MoEConfig
from .topology import ParallelSpec, RankPlace


def rank_tokens(tokens: Tensor, spec: ParallelSpec, place: RankPlace, layouts: Any) -> Tensor:
    """This rank's tokens of a sequence [S]: its CP zig-zag shard (every TP rank gets all of it:
    the sequence-parallel split happens inside the model, after the embedding, as in Megatron)."""
    if spec.cp == 1:
        return tokens
    return layouts.cp_zigzag_shard(tokens, spec.cp, place.cp)


def rank_rows(rows: Tensor, spec: ParallelSpec, place: RankPlace, layouts: Any) -> Tensor:
    """The rows [T_router, ...] of a sequence's per-position rows [S, ...] that this rank's routers see."""
    if spec.cp > 1:
        rows = layouts.cp_zigzag_shard(rows, spec.cp, place.cp)
    if spec.tp > 1:
        rows = layouts.sp_shard(rows, spec.tp, place.tp)
    return rows


def router_rows(length: int, spec: ParallelSpec, place: RankPlace, layouts: Any) -> int:
    """How many rows this rank's routers see for a sequence of ``length`` tokens."""
    return int(rank_rows(torch.zeros(length, dtype=torch.bool), spec, place, layouts).shape[0])


def stage_moe_counts(cfg: MoEConfig, spec: ParallelSpec, pp_rank: int, layouts: Any) -> list[int]:
    """Number of MoE layers in each virtual chunk of pipeline rank ``pp_rank``."""
    ranges = layouts.pp_layer_ranges(cfg.num_layers, spec.pp, spec.vpp)[pp_rank]
    return [sum(layer in layer_range for layer in cfg.moe_layers) for layer_range in ranges]


def rank_targets(
    routes: Tensor,
    mask: Tensor,
    cfg: MoEConfig,
    spec: ParallelSpec,
    place: RankPlace,
    layouts: Any,
    *,
    layer_axis: LayerAxis | str = LayerAxis.DECODER,
) -> tuple[Tensor, Tensor]:
    """This rank's targets ``[T_router, n_here, k]`` and mask ``[T_router]`` from a global trace.

    ``routes`` [S, layers, k] is on ``layer_axis`` ("decoder" or "moe_ordinal"); ``mask`` [S] bool.
    """
    rows = rank_rows(routes, spec, place, layouts)
    row_mask = rank_rows(mask.bool(), spec, place, layouts)
    moe_layers = list(cfg.moe_layers)
    axis = LayerAxis.parse(layer_axis)
    stage = layouts.stage_targets if axis is LayerAxis.DECODER else layouts.stage_targets_moe_ordinal
    per_chunk = [
        stage(rows, moe_layers, layer_range)
        for layer_range in layouts.pp_layer_ranges(cfg.num_layers, spec.pp, spec.vpp)[place.pp]
    ]
    return torch.cat(per_chunk, dim=1).long(), row_mask


def _all_gather(obj: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def merge_sequence(
    shards: dict[tuple[int, int], Tensor], length: int, spec: ParallelSpec, layouts: Any, *, sp_sharded: bool
) -> Tensor:
    """One sequence's rows [S, ...] from the shards of its ``(cp_rank, tp_rank)`` ranks.

    ``sp_sharded``: the shards are router rows (SP shards of each CP shard); otherwise they are
    whole CP shards, replicated over TP (only tp rank 0's is used).
    """
    cp_local = (
        (length + layouts.cp_pad(torch.zeros(length), spec.cp)[1]) // spec.cp if spec.cp > 1 else length
    )
    per_cp = []
    for cp_rank in range(spec.cp):
        if sp_sharded and spec.tp > 1:
            _, sp_pad_len = layouts.sp_pad(torch.zeros(cp_local), spec.tp)
            per_cp.append(layouts.sp_gather([shards[(cp_rank, t)] for t in range(spec.tp)], sp_pad_len))
        else:
            per_cp.append(shards[(cp_rank, 0)])
    if spec.cp == 1:
        return per_cp[0]
    _, cp_pad_len = layouts.cp_pad(torch.zeros(length), spec.cp)
    return layouts.cp_zigzag_merge(per_cp, cp_pad_len)


def gather_recordings(
    recording: Tensor,
    lengths: Sequence[Sequence[int]],
    cfg: MoEConfig,
    spec: ParallelSpec,
    place: RankPlace,
    layouts: Any,
) -> list[list[Tensor]]:
    """Every rank's recording → each sequence's MoE-ordinal trace ``[S, n_moe, k]``, on every rank.

    ``recording`` [Σ_i T_router(i), n_here, k]: this rank's routers' RECORD of its micro-batches in
    order (what a replay handle's ``recording()`` returns). ``lengths[dp][i]``: the length of
    micro-batch ``i`` of DP rank ``dp``. Collective: every rank must call it.
    Returns ``traces[dp][i]``.
    """
    counts = stage_moe_counts(cfg, spec, place.pp, layouts)
    rows = [router_rows(length, spec, place, layouts) for length in lengths[place.dp]]
    if recording.shape[0] != sum(rows) or recording.shape[1] != sum(counts):
        raise ValueError(
            f"{place.describe()}: recording has shape {list(recording.shape)}, expected "
            f"[{sum(rows)}, {sum(counts)}, k] (router rows of micro-batches {rows}, MoE layers "
            f"per virtual chunk {counts})"
        )
    mine = [list(part.split(counts, dim=1)) for part in recording.cpu().split(rows)]
    everyone = _all_gather((place, mine))
    ranges = layouts.pp_layer_ranges(cfg.num_layers, spec.pp, spec.vpp)
    traces: list[list[Tensor]] = []
    for dp in range(spec.dp):
        per_sequence = []
        for index, length in enumerate(lengths[dp]):
            per_stage = {}
            for pp_rank in range(spec.pp):
                for chunk in range(spec.vpp):
                    shards = {
                        (p.cp, p.tp): pieces[index][chunk]
                        for p, pieces in everyone
                        if p.dp == dp and p.pp == pp_rank
                    }
                    per_stage[(pp_rank, chunk)] = merge_sequence(
                        shards, length, spec, layouts, sp_sharded=True
                    )
            per_sequence.append(
                layouts.merge_stage_recordings(per_stage, ranges, moe_layers=list(cfg.moe_layers))
            )
        traces.append(per_sequence)
    return traces


def gather_token_values(
    values: Sequence[Tensor] | None,
    lengths: Sequence[Sequence[int]],
    spec: ParallelSpec,
    place: RankPlace,
    layouts: Any,
    *,
    sp_sharded: bool = False,
) -> list[list[Tensor]]:
    """Per-token values of each micro-batch → whole sequences ``[S, ...]``, on every rank.

    ``values[i]``: this rank's values of micro-batch ``i`` — CP-local tokens (log-probs from the
    head, replicated over TP), or router rows with ``sp_sharded`` (e.g. dispatched ids). Pass
    None on ranks that hold none (not the last pipeline stage for log-probs). Collective.
    """
    mine = None if values is None else [v.detach().cpu() for v in values]
    everyone = _all_gather((place, mine))
    result: list[list[Tensor]] = []
    for dp in range(spec.dp):
        per_sequence = []
        for index, length in enumerate(lengths[dp]):
            shards = {
                (p.cp, p.tp): pieces[index] for p, pieces in everyone if p.dp == dp and pieces is not None
            }
            per_sequence.append(merge_sequence(shards, length, spec, layouts, sp_sharded=sp_sharded))
        result.append(per_sequence)
    return result


def next_token_labels(tokens: Tensor) -> tuple[Tensor, Tensor]:
    """``(labels, valid)`` [S]: the token each position predicts, and False at the last position."""
    labels = torch.cat([tokens[1:], tokens.new_zeros(1)])
    valid = torch.ones(tokens.shape[0], dtype=torch.bool)
    valid[-1] = False
    return labels, valid


def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) per row of ``logits`` [T, V], in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.to(logits.device)[:, None].long())[
        :, 0
    ]
