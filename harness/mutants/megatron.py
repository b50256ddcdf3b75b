"""Megatron mutants: the reference subject's Megatron capability with one known bug each.

Killed by ``suites/test_megatron.py`` on real process groups (the checks observe every router and
expert with the harness's probe, so none of these can hide behind its own report).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.mutants import Mutant, mutate
from harness.trainers.megatron.layout import MegatronLayout
from harness.trainers.megatron.replay import MegatronReplay
from harness.trainers.megatron.subject import CanonicalMegatronData, HarnessMegatronDriver


class LayerShift(CanonicalMegatronData):
    """Every router gets the previous MoE layer's targets (dense layers counted as MoE, verl #5037)."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        targets = super().targets(routes, layout, vpp_chunk)
        return targets[-1:] + targets[:-1]


class BatchMajor(CanonicalMegatronData):
    """Tokens flattened batch-major ``b·S + s`` instead of Megatron's sequence-major ``s·B + b``."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        s_local = layout.seq_len // layout.tp
        return [
            t.view(s_local, layout.micro_batch, layout.top_k).transpose(0, 1).reshape(-1, layout.top_k)
            for t in super().targets(routes, layout, vpp_chunk)
        ]


class ForwardThroughBackward(MegatronReplay):
    """REPLAY_FORWARD left on through backward: recompute replays the latest targets, not its own."""

    def prepare_backward(self) -> None:
        pass


class ForwardThroughBackwardDriver(HarnessMegatronDriver):
    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplay:
        control = super().install(model, config)
        return ForwardThroughBackward(control.routers, control.top_k, control.num_experts)


class StaleInstances:
    """An action switch over copies of the routers' ``RouterReplay`` objects taken at install: the live
    routers never leave native routing, while every action call succeeds (verl #7340 orphans)."""

    def __init__(self, model: Sequence[torch.nn.Module], config: Any) -> None:
        import copy

        from megatron.core.transformer.moe.router import TopKRouter

        self.stale = [
            copy.copy(m.router_replay) for c in model for m in c.modules() if isinstance(m, TopKRouter)
        ]

    def _act(self, action: str | None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for inst in self.stale:
            inst.router_replay_action = None if action is None else RouterReplayAction[action]

    def record(self) -> None:
        self._act("RECORD")

    def replay_forward(self) -> None:
        self._act("REPLAY_FORWARD")

    def prepare_backward(self) -> None:
        self._act("REPLAY_BACKWARD")

    def disarm(self) -> None:
        self._act(None)


class StaleInstancesDriver(HarnessMegatronDriver):
    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        super().install(model, config)  # the reference's configuration checks still pass
        return StaleInstances(model, config)


MUTANTS = (
    Mutant(
        "megatron-layer-shift",
        "dense-layer shift",
        "verl #5037 on Megatron-core: each RouterReplay gets the previous MoE layer's targets",
        mutate("megatron-layer-shift", megatron_data=LayerShift()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
    Mutant(
        "megatron-batch-major",
        "token order",
        "targets flattened b·S + s while Megatron's routers see s·B + b (hides when micro_batch = 1)",
        mutate("megatron-batch-major", megatron_data=BatchMajor()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
    Mutant(
        "megatron-actions-on-stale-instances",
        "silent no-op",
        "RouterReplay actions set on copies of the instances taken at install, which the model's routers "
        "never call: every call succeeds, the routers route natively (verl #7340 orphan routers)",
        mutate("megatron-actions-on-stale-instances", install_megatron_replay=StaleInstancesDriver()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
    Mutant(
        "megatron-forward-through-backward",
        "recompute drift",
        "Megatron-core RouterReplay: REPLAY_FORWARD left set through the MoE activation recompute",
        mutate("megatron-forward-through-backward", install_megatron_replay=ForwardThroughBackwardDriver()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
)
