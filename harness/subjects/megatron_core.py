"""A shipped subject built only from Megatron-core's own ``RouterReplay`` (core ≥ 0.16, FACTS §2).

``--rr-subject harness.subjects.megatron_core:MEGATRON_CORE``. The driver is Megatron-core's class API
as released and nothing else: ``moe_enable_routing_replay=True`` makes every ``TopKRouter`` own a
``RouterReplay``; the actions are ``RouterReplay.set_global_router_replay_action``; targets go in with
``RouterReplay.set_replay_data`` (one tensor per instance, build order) and recordings come out with
``RouterReplay.get_recorded_data``. No harness check sits between them (the reference subject's
driver adds bypass and orphan checks): whatever Megatron-core does is what the probes see.

Megatron-core ships no data movement from canonical traces to its per-rank targets, padded or packed
(its ``PackedSeqParams`` only describes the model input); that arithmetic (sequence-major tokens, or
a packed micro-batch's samples one after another each padded to a multiple of ``tp``; SP shard; PP
and VPP stage routers) is the canonical one of ``harness.trainers.megatron.layout`` / ``.packed``,
applied to this rank's coordinates from ``parallel_state``. What the packed layouts then judge is
Megatron-core's ``RouterReplay`` (default and static-buffer mode) on ``T/tp`` packed rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

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

    patches_nothing = True  # PatchesNothing

    def patch(self) -> None:
        """Megatron-core ≥ 0.16 replays natively."""

    def config_overrides(self) -> Mapping[str, Any]:
        return {"moe_enable_routing_replay": True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> CoreController:
        return CoreController()


class CoreData:
    """``MegatronDataMovement`` into and out of ``RouterReplay`` 's class list; a packed (THD)
    micro-batch (the forward's ``packed_seq_params``) is laid out the same canonical way
    (``harness.trainers.megatron.packed``: each sample at its ``cu_seqlens_q_padded`` offset,
    sharded contiguously over TP)."""

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
        from megatron.core import parallel_state as ps

        from harness.trainers.megatron.subject import CanonicalMegatronData, data_layout

        layout = data_layout(attention_mask, config, packed_seq_params)
        routes = torch.as_tensor(routes).long().cpu()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        targets = [
            target
            for chunk in (range(layout.vpp) if vp_rank is None else [vp_rank])
            for target in CanonicalMegatronData.stage_targets(routes, layout, pp_rank, chunk)
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
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        from harness.trainers.megatron.subject import data_layout, merge_rank_recordings

        layout = data_layout(attention_mask, config, packed_seq_params)
        return merge_rank_recordings(_core().RouterReplay.get_recorded_data(), layout)


MEGATRON_CORE = Subject(
    name="megatron-core RouterReplay",
    install_megatron_replay=CoreDriver(),
    megatron_data=CoreData(),
)
