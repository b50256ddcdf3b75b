"""Megatron mutants: the reference subject's Megatron capability with one known bug each.

Killed by ``suites/test_megatron.py`` on real process groups (the checks observe every router and
expert with the harness's probe, so none of these can hide behind its own report).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from harness.mutants import Mutant, mutate
from harness.trainers.megatron import packed as thd
from harness.trainers.megatron.layout import MegatronLayout, stage_router_targets
from harness.trainers.megatron.replay import MegatronReplay, decoder_routers, model_routers
from harness.trainers.megatron.subject import CanonicalMegatronData, HarnessMegatronDriver, data_layout
from reference_impl import layouts


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


class OtherStage(CanonicalMegatronData):
    """Each pipeline stage gets the targets of the next stage's layers (a stage offset off by one)."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        from megatron.core import parallel_state as ps

        next_stage = (ps.get_pipeline_model_parallel_rank() + 1) % layout.pp
        return self.stage_targets(routes, layout, next_stage, vpp_chunk)


class ContiguousChunks(CanonicalMegatronData):
    """A rank's VPP chunks taken as consecutive slices of one contiguous block of layers (rank ``r``'s
    chunk ``c`` = layers ``(r·vpp + c)·L/(pp·vpp) …``) instead of Megatron's interleaved model chunk
    ``c·pp + r``: the layer-offset bug of a replay helper that ignores ``vp_stage``."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        from megatron.core import parallel_state as ps

        every = self.stage_targets(routes, replace(layout, pp=1, vpp=1), 0, 0)  # one per MoE layer
        size = layout.num_layers // (layout.pp * layout.vpp)
        start = (ps.get_pipeline_model_parallel_rank() * layout.vpp + vpp_chunk) * size
        return [t for layer, t in zip(layout.moe_layers, every, strict=True) if start <= layer < start + size]


class PackedSeqMajor(CanonicalMegatronData):
    """A packed micro-batch's rows taken in the padded batch's sequence-major order (``s·B + b``, padding
    skipped) instead of sample after sample: the bshd flattening applied to THD input."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        if layout.lengths is not None:
            lengths = torch.tensor(layout.lengths)
            attended = torch.arange(layout.seq_len).unsqueeze(0) < lengths.unsqueeze(1)
            seq_major = routes.transpose(0, 1)[attended.t()]  # [Σ n, L, k], s-major
            by_sample = torch.zeros_like(routes)
            by_sample[attended] = seq_major
            routes = by_sample
        return super().targets(routes, layout, vpp_chunk)


class UnpaddedBoundaries(CanonicalMegatronData):
    """Samples packed back to back at ``cu_seqlens`` (all filler at the end) while the model's rows
    follow ``cu_seqlens_padded``: every sample after a padded one is shifted at its boundary."""

    def targets(self, routes: torch.Tensor, layout: MegatronLayout, vpp_chunk: int) -> list[torch.Tensor]:
        if layout.lengths is None:
            return super().targets(routes, layout, vpp_chunk)
        from megatron.core import parallel_state as ps

        rows = thd.pack_routes(routes, layout.lengths, 1)
        rows = torch.cat([rows, thd.filler(layout.packed_rows - rows.shape[0], *rows.shape[1:])])
        shard = layouts.sp_shard(rows, layout.tp, ps.get_tensor_model_parallel_rank())
        return stage_router_targets(shard, layout, ps.get_pipeline_model_parallel_rank(), vpp_chunk)


class RoutersByLayerNumber(CanonicalMegatronData):
    """Targets keyed by the bare 1-based ``layer_number`` of the layer a router sits in, every router of
    the model looked up by it: an MTP router's ``MultiTokenPredictionLayer`` numbers restart at 1, so
    MTP router k gets decoder layer k's targets and replays them (NeMo-RL #3903)."""

    def key(self, router: Any, mtp_layer: Any | None) -> int:
        """The number a router is looked up by: its MTP layer's, else its own (decoder) one."""
        return int((mtp_layer if mtp_layer is not None else router).layer_number)

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
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

        layout = data_layout(attention_mask, config, packed_seq_params)
        targets = self.model_targets(routes, layout, model, vp_rank)
        by_number = {int(r.layer_number): t for r, t in zip(decoder_routers(*model), targets, strict=True)}
        owner = {
            id(m): layer
            for chunk in model
            for layer in chunk.modules()
            if isinstance(layer, MultiTokenPredictionLayer)
            for m in layer.modules()
        }
        for router in model_routers(*model):
            target = by_number.get(self.key(router, owner.get(id(router))))
            if target is not None:  # no entry: left without targets (native)
                router.router_replay.set_target_indices(target)


class RoutersByOwnLayerNumber(RoutersByLayerNumber):
    """Targets keyed by each router's own ``layer_number``: megatron-core 0.16.1 numbers an MTP router
    past the decoder (``num_layers + k``), a number no decoder layer holds, so the MTP router gets
    nothing and routes natively (the twin of ``megatron-mtp-router-by-layer-number``)."""

    def key(self, router: Any, mtp_layer: Any | None) -> int:
        return int(router.layer_number)


class ForwardThroughBackward(MegatronReplay):
    """REPLAY_FORWARD left on through backward: recompute replays the latest targets, not its own."""

    def prepare_backward(self) -> None:
        pass


class ForwardThroughBackwardDriver(HarnessMegatronDriver):
    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplay:
        control = super().install(model, config)
        return ForwardThroughBackward(control.routers, control.top_k, control.num_experts)


class UnnormalisedWeightsDriver(HarnessMegatronDriver):
    """Replayed experts weighted with the softmax over *all* experts, not renormalised over the chosen
    ones (a ``norm_topk_prob`` mix-up in an R3 patch): the ids are right, the gate weights are not."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplay:
        from megatron.core.transformer.moe.router import TopKRouter

        def reweigh(module: Any, args: Any, output: Any) -> Any:
            probs, routing_map = output
            hidden = args[0].reshape(-1, args[0].shape[-1])
            scores = torch.softmax(torch.nn.functional.linear(hidden, module.weight).float(), dim=-1)
            return (scores * routing_map).type_as(probs), routing_map

        for chunk in model:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    m.register_forward_hook(reweigh)
        return super().install(model, config)


def replaying(router: Any) -> bool:
    """Whether a ``TopKRouter``'s ``RouterReplay`` is in a replay action now."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replay = getattr(router, "router_replay", None)
    action = getattr(replay, "router_replay_action", None)
    return action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD)


class DropsScalingUnderReplayDriver(HarnessMegatronDriver):
    """A patched routing for replay that re-implements the gate weights and forgets
    ``moe_router_topk_scaling_factor`` (the weights of a replayed token are its live router's, unscaled):
    right for every router without a scaling factor, wrong by that factor under replay only."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplay:
        from megatron.core.transformer.moe.router import TopKRouter

        scale = getattr(config, "moe_router_topk_scaling_factor", None)

        def unscale(module: Any, args: Any, output: Any) -> Any:
            probs, routing_map = output
            if scale and replaying(module):
                return probs / scale, routing_map
            return output

        for chunk in model:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    m.register_forward_hook(unscale)
        return super().install(model, config)


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
        "megatron-unnormalised-gate-weights",
        "gate weights",
        "replayed experts weighted with the softmax over all experts, not renormalised over the chosen",
        mutate("megatron-unnormalised-gate-weights", install_megatron_replay=UnnormalisedWeightsDriver()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
    Mutant(
        "megatron-pp-other-stage",
        "pipeline stage",
        "each PP stage's routers get the next stage's layers' targets",
        mutate("megatron-pp-other-stage", megatron_data=OtherStage()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[pp2thd]",
    ),
    Mutant(
        "megatron-vpp-contiguous-chunks",
        "PP/VPP offsets",
        "a rank's VPP chunks fed consecutive layers (r·vpp + c), not Megatron's interleaved chunk c·pp + r",
        mutate("megatron-vpp-contiguous-chunks", megatron_data=ContiguousChunks()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[pp2vpp2thd]",
    ),
    Mutant(
        "megatron-thd-seq-major",
        "token order",
        "a packed (THD) micro-batch's targets in the padded batch's s·B + b order, not sample after sample",
        mutate("megatron-thd-seq-major", megatron_data=PackedSeqMajor()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[pp2thd]",
    ),
    Mutant(
        "megatron-thd-unpadded-boundaries",
        "token order",
        "packed targets laid out at cu_seqlens while the model's rows follow cu_seqlens_padded (verl "
        "#7106's class; hides where no sample is padded: TP = 1 at alignment 1)",
        mutate("megatron-thd-unpadded-boundaries", megatron_data=UnpaddedBoundaries()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[thd-align4]",
    ),
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
        "megatron-replay-drops-scaling-factor",
        "wrong gate rule",
        "a re-implemented replay routing (verl's patched TopKRouter.routing shape) that forgets "
        "moe_router_topk_scaling_factor: replayed experts weighted unscaled (hides unless the router has a "
        "scaling factor: DeepSeek-V3's 2.5)",
        mutate(
            "megatron-replay-drops-scaling-factor", install_megatron_replay=DropsScalingUnderReplayDriver()
        ),
        killed_by="test_megatron.py::test_gate_weights_follow_every_router_rule",
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
        "megatron-mtp-router-by-layer-number",
        "MTP routers",
        "NeMo-RL #3903 on Megatron-core: targets handed to routers by bare 1-based layer_number, which the "
        "MTP block's layers restart at 1, so the MTP router replays decoder layer 1's routes (hides in a "
        "model without an MTP block)",
        mutate("megatron-mtp-router-by-layer-number", megatron_data=RoutersByLayerNumber()),
        killed_by="test_megatron.py::test_mtp_router_routes_natively_under_replay",
    ),
    Mutant(
        "megatron-forward-through-backward",
        "recompute drift",
        "Megatron-core RouterReplay: REPLAY_FORWARD left set through the MoE activation recompute",
        mutate("megatron-forward-through-backward", install_megatron_replay=ForwardThroughBackwardDriver()),
        killed_by="test_megatron.py::test_router_replay_follows_canonical_targets[tp1ep1]",
    ),
)
