"""The Megatron capability of the reference subject: the harness's own backend behind the seam.

- ``HarnessMegatronDriver`` (``MegatronReplayDriver``): no global patch; ``moe_enable_routing_replay``
  on; ``install`` checks the configuration for silent bypasses and the ``RouterReplay`` class list
  for orphans, and returns a ``MegatronReplay`` (the action switch).
- ``CanonicalMegatronData`` (``MegatronDataMovement``): one DP rank's micro-batch of canonical routes →
  every local router's targets with :func:`layout.rank_targets` (seq-major, SP shard, PP stage
  routers, global ids), fed through ``RouterReplay.set_replay_data`` with shape/id checks; and the
  rank's recordings back with :func:`layout.merge_recordings` (gathered over the model-parallel ranks
  of this DP rank).

megatron-core is imported lazily.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.trainers.megatron.layout import (
    MegatronLayout,
    MegatronReplayError,
    merge_recordings,
    rank_targets,
)
from harness.trainers.megatron.replay import MegatronReplay, model_routers


def micro_batch_layout(config: Any, batch: int, seq_len: int) -> MegatronLayout:
    """The layout of one DP rank's micro-batch ``[batch, seq_len]`` under ``config`` (dp = 1 view)."""
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
    )


def _check_mask(attention_mask: torch.Tensor) -> None:
    if not bool(attention_mask.bool().all()):
        raise MegatronReplayError(
            "attention_mask: padding positions present; RouterReplay has no per-token mask, so every "
            "position of the micro-batch must carry a real route (DESIGN §3.6: no filler replayed)"
        )


class HarnessMegatronDriver:
    """``MegatronReplayDriver`` of the reference subject (Megatron-core's ``RouterReplay``, checked)."""

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
    ) -> None:
        _check_mask(attention_mask)
        layout = micro_batch_layout(config, *attention_mask.shape)
        targets = self.targets(torch.as_tensor(routes).long().cpu(), layout, vp_rank or 0)
        device = next(model[0].parameters()).device
        feeder = MegatronReplay(model_routers(*model), layout.top_k, layout.num_experts)
        feeder.feed([t.to(device) for t in targets], layout.local_tokens)

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        """This rank's per-router targets, in build order (:func:`layout.rank_targets`)."""
        from megatron.core import parallel_state as ps

        return rank_targets(
            routes,
            layout,
            dp_rank=0,
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            vpp_chunk=vpp_chunk,
        )

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
    ) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        batch, seq_len = attention_mask.shape
        layout = micro_batch_layout(config, batch, seq_len)
        recorded = [r.router_replay.get_recorded_indices() for r in model_routers(*model)]
        if any(r is None for r in recorded):
            raise MegatronReplayError(
                "merge_recordings: a router recorded nothing (RECORD and a forward first)"
            )
        mine = (
            ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, [r.detach().cpu().long() for r in recorded]))
        own_dp = {(0, tp, pp): recs for (dp, tp, pp), recs in everyone if dp == mine[0]}
        return merge_recordings(own_dp, layout)


MEGATRON_DRIVER = HarnessMegatronDriver()
MEGATRON_DATA = CanonicalMegatronData()
