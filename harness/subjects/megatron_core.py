"""A shipped subject built only from Megatron-core's own ``RouterReplay`` (core ≥ 0.16, FACTS §2).

``--rr-subject harness.subjects.megatron_core:MEGATRON_CORE``. The driver is Megatron-core's class API
as released and nothing else: ``moe_enable_routing_replay=True`` makes every ``TopKRouter`` own a
``RouterReplay``; the actions are ``RouterReplay.set_global_router_replay_action``; targets go in with
``RouterReplay.set_replay_data`` (one tensor per instance, build order) and recordings come out with
``RouterReplay.get_recorded_data``. No harness check sits between them (the reference subject's
driver adds bypass and orphan checks): whatever Megatron-core does is what the probes see.

Megatron-core ships no data movement from canonical traces to its per-rank targets; that arithmetic
(sequence-major tokens, SP shard, PP stage routers) is the canonical one of
``harness.trainers.megatron.layout``, applied to this rank's coordinates from ``parallel_state``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from harness.subjects import Subject


def _core() -> Any:
    from megatron.core.transformer.moe import router_replay

    return router_replay


class CoreController:
    """``MegatronReplayController`` through ``RouterReplay`` 's class methods only."""

    def record(self) -> None:
        rr = _core()
        rr.RouterReplay.clear_global_indices()
        rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.RECORD)

    def replay_forward(self) -> None:
        rr = _core()
        rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        rr = _core()
        rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.REPLAY_BACKWARD)

    def disarm(self) -> None:
        rr = _core()
        rr.RouterReplay.clear_global_indices()
        rr.RouterReplay.clear_global_router_replay_action()


class CoreDriver:
    """``MegatronReplayDriver``: nothing to patch, ``moe_enable_routing_replay=True``."""

    def patch(self) -> None:
        """Megatron-core ≥ 0.16 replays natively."""

    def config_overrides(self) -> Mapping[str, Any]:
        return {"moe_enable_routing_replay": True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> CoreController:
        return CoreController()


class CoreData:
    """``MegatronDataMovement`` into and out of ``RouterReplay`` 's class list."""

    def set_replay_data(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps

        from harness.trainers.megatron.layout import rank_targets
        from harness.trainers.megatron.subject import micro_batch_layout

        layout = micro_batch_layout(config, *attention_mask.shape)
        targets = [
            target
            for chunk in (range(layout.vpp) if vp_rank is None else [vp_rank])
            for target in rank_targets(
                torch.as_tensor(routes).long().cpu(),
                layout,
                dp_rank=0,
                tp_rank=ps.get_tensor_model_parallel_rank(),
                pp_rank=ps.get_pipeline_model_parallel_rank(),
                vpp_chunk=chunk,
            )
        ]
        device = next(model[0].parameters()).device
        _core().RouterReplay.set_replay_data([t.to(device) for t in targets])

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
    ) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        from harness.trainers.megatron.layout import merge_recordings
        from harness.trainers.megatron.subject import micro_batch_layout

        layout = micro_batch_layout(config, *attention_mask.shape)
        recorded = [r.detach().cpu().long() for r in _core().RouterReplay.get_recorded_data()]
        mine = (
            ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, recorded))
        return merge_recordings({(0, t, p): recs for (d, t, p), recs in everyone if d == mine[0]}, layout)


MEGATRON_CORE = Subject(
    name="megatron-core RouterReplay",
    install_megatron_replay=CoreDriver(),
    megatron_data=CoreData(),
)
