"""``install_megatron_replay`` / ``megatron_data``: Megatron R2/R3 through
``verl/utils/megatron/router_replay_patch.py`` (``apply_router_replay_patch``: on Megatron-core
0.16.1 verl's own ``RouterReplay`` and ``routing`` on every ``TopKRouter``; the engine's
RECORD / REPLAY_FORWARD / REPLAY_BACKWARD actions) and ``router_replay_utils.py``
(``set_router_replay_data``, ``merge_router_topk_indices`` then ``pp_gather``; from 0.9.0 on the
forwarded model's own routers), fed the jagged batch verl's engine holds, on the padded (``bshd``)
or the packed (``thd``, verl's default) model input. With virtual pipeline stages the helpers run
once per model chunk with its ``vp_rank``, as the engine's ``forward_step`` calls them, and the
chunks' recordings go through ``reorder_and_merge_vpp_layers`` before ``pp_gather``.
``align_r3_router_replay_data`` and ``build_r3_replay_mask`` are not called there: the suite's
traces have a row for every position (R2's replay, which verl also uses), and the R3 mask is
checked through ``layouts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.subjects.frameworks import require_release
from harness.subjects.frameworks.verl.payload import jagged


def _replay_utils(version: str, model: Sequence[torch.nn.Module]) -> Any:
    """The release's ``verl/utils/megatron/router_replay_utils.py``, moving data on ``model`` 's
    device: the module picks its device once at import (``get_device_name()``, ``"cuda"`` from
    0.9.0 even without a GPU), which verl's own CPU tests override the same way."""
    require_release("verl", version, f"verl-{version}")
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = next(model[0].parameters()).device.type
    return router_replay_utils


class _MegatronController:
    """The action switch verl's Megatron engine drives: ``RouterReplay`` 's class methods of the
    release's ``router_replay_patch`` (RECORD / REPLAY_FORWARD before the forward, REPLAY_BACKWARD
    before the recompute, indices and actions cleared after the step)."""

    def __init__(self, version: str) -> None:
        require_release("verl", version, f"verl-{version}")
        from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

        self.replay, self.action = RouterReplay, RouterReplayAction

    def record(self) -> None:
        self.replay.set_global_router_replay_action(self.action.RECORD)

    def replay_forward(self) -> None:
        self.replay.set_global_router_replay_action(self.action.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        self.replay.set_global_router_replay_action(self.action.REPLAY_BACKWARD)

    def disarm(self) -> None:
        self.replay.clear_global_indices()
        self.replay.clear_global_router_replay_action()


class MegatronDriver:
    """verl's Megatron replay: ``apply_router_replay_patch()`` (on Megatron-core 0.16.1 the full patch
    of ``TopKRouter``: verl's ``RouterReplay`` per router, verl's ``routing``) and the flag the
    release's engine sets: 0.8.0 its own ``enable_routing_replay`` (the only one its patched router
    reads), from 0.9.0 Megatron-core's ``moe_enable_routing_replay`` where the config has it."""

    def __init__(self, version: str) -> None:
        self.version = version

    def patch(self) -> None:
        require_release("verl", self.version, f"verl-{self.version}")
        from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

        apply_router_replay_patch()

    def config_overrides(self) -> dict[str, Any]:
        flag = "enable_routing_replay" if self.version == "0.8.0" else "moe_enable_routing_replay"
        return {flag: True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> _MegatronController:
        return _MegatronController(self.version)


def _chunks(
    model: Sequence[torch.nn.Module], vp_rank: int | None
) -> list[tuple[int | None, list[torch.nn.Module]]]:
    """``(vp_rank, [chunk])`` per model chunk, as verl's engine calls its replay helpers from each
    chunk's ``forward_step`` (``vp_rank = model.vp_stage``); one chunk (no VPP) goes as it came."""
    if len(model) == 1:
        return [(vp_rank, list(model))]
    return [(stage, [chunk]) for stage, chunk in enumerate(model)]


def _has_router(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether ``chunks`` hold a ``TopKRouter`` (a VPP chunk of dense layers holds none)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return any(isinstance(m, TopKRouter) for chunk in chunks for m in chunk.modules())


class MegatronData:
    """verl's per-micro-batch data movement: ``set_router_replay_data`` and
    ``merge_router_topk_indices`` on the jagged (no-padding) batch the engine holds.

    Targets go in as verl's R2 replay hands them over (every row, no replay mask): the harness's
    traces have a row for every position, so R3's ``align_r3_router_replay_data`` (a placeholder for
    a missing last row) and ``build_r3_replay_mask`` (which leaves that row native) have nothing to
    do. ``set_router_replay_data`` takes the forwarded ``model`` (and addresses its own routers) from
    0.9.0, ``merge_router_topk_indices`` from 0.9.1; before, both slice verl's registry by position.

    A packed (THD) micro-batch — verl's default (``use_remove_padding=True``, ``data_format='thd'``)
    — adds the ``packed_seq_params`` the model's forward receives; verl's functions do not take it
    (``preprocess_thd_engine`` / ``postprocess_thd_engine`` in ``verl/models/mcore/util.py`` derive the
    packing from the jagged lengths), so it is accepted and not passed on.
    """

    def __init__(self, version: str) -> None:
        self.version = version

    def packing_align(self, tp: int) -> int:
        """``PacksAtOwnAlignment``: verl's ``preprocess_packed_seqs`` / ``preprocess_thd_engine`` pad
        each sample to ``tp`` at CP = 1 without FP8 (``tp·cp·2`` under CP)."""
        return tp

    def _scoped(self, model: Sequence[torch.nn.Module], since: str) -> dict[str, Any]:
        """``model=`` for a function that takes it from release ``since`` on."""
        newer = [int(part) for part in self.version.split(".")] >= [int(part) for part in since.split(".")]
        return {"model": list(model)} if newer else {}

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
        utils = _replay_utils(self.version, model)
        routes = jagged(routes, attention_mask)
        for stage, chunk in _chunks(model, vp_rank):
            # The engine feeds a chunk only while its routers are in REPLAY_FORWARD
            # (``RouterReplayHelper.is_replay_forward_action``): never a chunk without a router.
            if _has_router(chunk):
                utils.set_router_replay_data(routes, None, config, stage, **self._scoped(chunk, "0.9.0"))

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``merge_router_topk_indices`` then ``pp_gather``, as verl's R2 RECORD does; the jagged
        routes go back to the attended positions of a ``[B, S, L, top_k]`` batch."""
        utils = _replay_utils(self.version, model)
        attended = torch.as_tensor(attention_mask).bool()
        recorded: list[torch.Tensor] = []
        tokens = jagged(torch.zeros(attended.shape, dtype=torch.long), attended)
        for stage, chunk in _chunks(model, vp_rank):
            # Before 0.9.1 the engine records a chunk only under ``is_r2_record_action``, false for a
            # chunk without a router; 0.9.1 records every scheduled chunk (an empty map for none).
            if _has_router(chunk) or self._scoped(chunk, "0.9.1"):
                utils.merge_router_topk_indices(
                    None, tokens, recorded, config, stage, **self._scoped(chunk, "0.9.1")
                )
        local = recorded[0]
        if len(model) > 1:  # the engine's VPP merge: per-chunk recordings in schedule order
            local = utils.reorder_and_merge_vpp_layers(
                recorded, 1, len(model), config.microbatch_group_size_per_vp_stage
            )
        gathered = utils.pp_gather(local, config)
        values = gathered.values()
        merged = torch.zeros((*attended.shape, *values.shape[1:]), dtype=values.dtype)
        merged[attended] = values
        return merged
