"""The Megatron capability of the reference subject: the harness's own backend behind the seam.

- ``HarnessMegatronDriver`` (``MegatronReplayDriver``): no global patch; ``moe_enable_routing_replay``
  on; ``install`` checks the configuration for silent bypasses and the ``RouterReplay`` class list
  for orphans, and returns a ``MegatronReplay`` (the action switch).
- ``CanonicalMegatronData`` (``MegatronDataMovement``): one DP rank's micro-batch of canonical routes →
  every local router's targets with :func:`layout.rank_targets` (seq-major, SP shard, PP stage
  routers, each VPP chunk's in turn, global ids), fed through ``RouterReplay.set_replay_data``
  with shape/id checks (MTP routers, told apart by module, get none: they route natively); and the
  rank's recordings back with :func:`layout.merge_recordings` (gathered over the model-parallel ranks
  of this DP rank).

megatron-core is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import MegatronReplayError
from harness.trainers.megatron import packed as thd
from harness.trainers.megatron.layout import (
    MegatronLayout,
    merge_recordings,
    rank_targets,
)
from harness.trainers.megatron.replay import MegatronReplay, decoder_routers, mtp_routers


def micro_batch_layout(
    config: Any, batch: int, seq_len: int, lengths: Sequence[int] | None = None, align: int | None = None
) -> MegatronLayout:
    """The layout of one DP rank's micro-batch ``[batch, seq_len]`` under ``config`` (dp = 1 view);
    packed (THD) when ``lengths`` are given, each sample padded to a multiple of ``align`` (``tp``
    when not given)."""
    from megatron.core import parallel_state as ps

    freq = config.moe_layer_freq
    moe = tuple(i for i in range(config.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0))
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    return MegatronLayout(
        num_layers=config.num_layers,
        moe_layers=moe,
        num_experts=config.num_moe_experts,
        top_k=config.moe_router_topk,
        seq_len=seq_len,
        micro_batch=batch,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=vpp,
        dp=1,
        ep=1,  # routing precedes dispatch: targets are global ids whatever EP is
        etp=1,
        lengths=None if lengths is None else tuple(lengths),
        align=align,
    )


def packed_lengths(attention_mask: torch.Tensor, packed_seq_params: Any) -> tuple[list[int], int]:
    """The samples' lengths of a packed micro-batch, checked against its ``PackedSeqParams``, and the
    alignment its ``cu_seqlens_q_padded`` pads each sample to (the rows follow the padded offsets)."""
    from megatron.core import parallel_state as ps

    if packed_seq_params.qkv_format != "thd":
        raise MegatronReplayError(
            f"packed_seq_params.qkv_format = {packed_seq_params.qkv_format!r}, expected 'thd'"
        )
    lengths = thd.lengths_of(attention_mask)
    cu_padded = packed_seq_params.cu_seqlens_q_padded
    align = thd.check_cu_seqlens(
        lengths,
        packed_seq_params.cu_seqlens_q,
        packed_seq_params.cu_seqlens_q if cu_padded is None else cu_padded,
        ps.get_tensor_model_parallel_world_size(),
    )
    return lengths, align


def _check_mask(attention_mask: torch.Tensor) -> None:
    if not bool(attention_mask.bool().all()):
        raise MegatronReplayError(
            "attention_mask: padding positions present; RouterReplay has no per-token mask, so every "
            "position of the micro-batch must carry a real route (DESIGN §3.6: no filler replayed)"
        )


def data_layout(attention_mask: torch.Tensor, config: Any, packed_seq_params: Any = None) -> MegatronLayout:
    """One micro-batch's layout: padded ``[B, S]`` (every position a token) or, with the forward's
    ``packed_seq_params``, packed (THD; lengths checked against ``cu_seqlens``)."""
    if packed_seq_params is None:
        _check_mask(attention_mask)
        return micro_batch_layout(config, *attention_mask.shape)
    lengths, align = packed_lengths(attention_mask, packed_seq_params)
    batch, seq_len = attention_mask.shape
    return micro_batch_layout(config, batch, seq_len, lengths=lengths, align=align)


def merge_rank_recordings(recorded: Sequence[torch.Tensor], layout: MegatronLayout) -> torch.Tensor:
    """This DP rank's recorded routes ``[B, S, L, k]`` from every rank's router recordings (build
    order), gathered over the world (collective); a packed micro-batch's filler rows are dropped."""
    from megatron.core import parallel_state as ps

    mine = (
        ps.get_data_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
    )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, [r.detach().cpu().long() for r in recorded]))
    own_dp = {(0, tp, pp): recs for (dp, tp, pp), recs in everyone if dp == mine[0]}
    if not layout.packed:
        return merge_recordings(own_dp, layout)
    # Packed: the same merge over the [T/tp] shards as one "sample" of T rows, then unpacked.
    assert layout.lengths is not None
    rows = replace(layout, seq_len=layout.packed_rows, micro_batch=1, lengths=None)
    merged = merge_recordings(own_dp, rows)[0]  # [T, n_moe, k]
    return thd.unpack_routes(merged, layout.lengths, layout.packing_align, layout.seq_len)


class HarnessMegatronDriver:
    """``MegatronReplayDriver`` of the reference subject (Megatron-core's ``RouterReplay``, checked)."""

    patches_nothing = True  # PatchesNothing: Megatron-core replays natively

    def patch(self) -> None:
        """Megatron-core ≥ 0.16 needs no patch."""

    def config_overrides(self) -> Mapping[str, Any]:
        return {"moe_enable_routing_replay": True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplay:
        return MegatronReplay.install(*model, config=config)


class CanonicalMegatronData:
    """``MegatronDataMovement`` of the reference subject (the harness's layout functions)."""

    def set_replay_data(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> None:
        layout = data_layout(attention_mask, config, packed_seq_params)
        feeder = MegatronReplay(
            decoder_routers(*model), layout.top_k, layout.num_experts, mtp=mtp_routers(*model)
        )
        feeder.feed(self.model_targets(routes, layout, model, vp_rank), layout.local_tokens)

    def model_targets(
        self,
        routes: torch.Tensor,
        layout: MegatronLayout,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None,
    ) -> list[torch.Tensor]:
        """Every local decoder router's targets (each VPP chunk's in turn, or ``vp_rank`` 's), in build
        order, on the model's device."""
        routes = torch.as_tensor(routes).long().cpu()
        chunks = range(layout.vpp) if vp_rank is None else [vp_rank]
        device = next(model[0].parameters()).device
        return [t.to(device) for chunk in chunks for t in self.targets(routes, layout, chunk)]

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        """This rank's per-router targets, in build order (:func:`layout.rank_targets`, packed:
        :func:`packed.thd_rank_targets`)."""
        from megatron.core import parallel_state as ps

        return self.stage_targets(routes, layout, ps.get_pipeline_model_parallel_rank(), vpp_chunk)

    @staticmethod
    def stage_targets(
        routes: torch.Tensor, layout: MegatronLayout, pp_rank: int, vpp_chunk: int
    ) -> list[torch.Tensor]:
        """The per-router targets of this TP rank at pipeline stage ``pp_rank``."""
        from megatron.core import parallel_state as ps

        place = thd.thd_rank_targets if layout.packed else rank_targets
        return place(
            routes,
            layout,
            dp_rank=0,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=pp_rank,
            vpp_chunk=vpp_chunk,
        )

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        layout = data_layout(attention_mask, config, packed_seq_params)
        recorded = [r.router_replay.get_recorded_indices() for r in decoder_routers(*model)]
        if any(r is None for r in recorded):
            raise MegatronReplayError(
                "merge_recordings: a router recorded nothing (RECORD and a forward first)"
            )
        return merge_rank_recordings(recorded, layout)


MEGATRON_DRIVER = HarnessMegatronDriver()
MEGATRON_DATA = CanonicalMegatronData()
