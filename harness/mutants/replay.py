"""Replay mutants: replay that does nothing, drifts under recompute, or uses the wrong gate rule."""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate
from harness.mutants.drivers import Bug, ConstructorPatchDriver
from harness.subjects import Subject
from harness.subjects.capabilities import ReplayController
from harness.subjects.reference import ReferenceReplay
from reference_impl import MoELM, RoutingMode
from reference_impl.routers import Router


class OrphanReplay(ReferenceReplay):
    """Targets are stored but the live routers are never switched to replay: they route natively."""

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        self.model.set_replay_targets(targets, mask)


class ReplayForwardThroughBackward(ReferenceReplay):
    """REPLAY_FORWARD is left on through backward: recompute replays the latest targets, not its own."""

    def prepare_backward(self) -> None:
        pass


class WeightRuleOverride(ReferenceReplay):
    """While replay is armed, every router's gate-weight rule is replaced by ``rule``."""

    rule: Callable[[object, Tensor, Tensor], Tensor]

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        for router in self.model.routers():
            router.family.weights = functools.partial(type(self).rule, router.family)  # type: ignore[method-assign]
        super().replay(targets, mask)

    def disarm(self) -> None:
        for router in self.model.routers():
            router.family.__dict__.pop("weights", None)
        super().disarm()


def softmax_rule(family: object, logits: Tensor, ids: Tensor) -> Tensor:
    """``softmax(logits, fp32).gather(ids)``, renormalised, in the logits dtype: right for Qwen/OlMoE only."""
    w = logits.float().softmax(dim=-1).gather(-1, ids)
    return (w / w.sum(dim=-1, keepdim=True)).to(logits.dtype)


class SoftmaxForEveryFamily(WeightRuleOverride):
    rule = staticmethod(softmax_rule)  # type: ignore[assignment]


class ScoresCastDown(WeightRuleOverride):
    """The family's own rule, but the weights cast to the logits dtype (Mixtral keeps them fp32)."""

    @staticmethod
    def rule(family: object, logits: Tensor, ids: Tensor) -> Tensor:  # type: ignore[override]
        return type(family).weights(family, logits, ids).to(logits.dtype)  # type: ignore[attr-defined]


class ClaimsReplayWithoutArming(ReferenceReplay):
    """Replay never reaches the routers, yet ``dispatched()`` reports the targets as dispatched.

    Only the harness's probes can kill it: every check that took the subject's word would pass.
    """

    claimed: Tensor | None = None

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        self.claimed = torch.as_tensor(targets)

    def dispatched(self) -> Tensor:
        if self.claimed is None:
            return super().dispatched()
        return self.claimed

    def disarm(self) -> None:
        self.claimed = None
        super().disarm()


class StaleRouterObjects(ReferenceReplay):
    """Targets are armed on router objects the model no longer calls (a snapshot taken at install, as
    when a wrapper re-creates the modules after replay was registered); the report reads the snapshot."""

    def __init__(self, model: MoELM) -> None:
        super().__init__(model)
        self.snapshot = copy.deepcopy(model)

    def record(self) -> None:
        self.snapshot.clear_replay()
        super().record()

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        self.snapshot.set_replay_targets(targets, mask)
        self.snapshot.set_routing_mode(RoutingMode.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        self.snapshot.set_routing_mode(RoutingMode.REPLAY_BACKWARD)

    def dispatched(self) -> Tensor:
        targets = [r.replay.targets for r in self.snapshot.routers()]
        if any(t is None for t in targets):
            return super().dispatched()
        return torch.stack([t.ids for t in targets if t is not None], dim=1)

    def disarm(self) -> None:
        self.snapshot.clear_replay()
        self.snapshot.set_routing_mode(RoutingMode.NATIVE)
        super().disarm()


def hooks_on_a_stale_copy(model: torch.nn.Module) -> ReplayController:
    """Transformers hooks installed on a copy of the model (routers the model never calls), reporting
    the targets they were given as dispatched."""
    from harness.trainers.hf import install_replay as install

    handle = install(copy.deepcopy(model), self_check=False)
    claimed: list[Tensor] = []
    replay = handle.replay

    def replay_and_claim(targets: Tensor, mask: Tensor | None = None) -> None:
        replay(targets, mask)
        claimed[:] = [torch.as_tensor(targets)]

    handle.replay = replay_and_claim  # type: ignore[method-assign]
    handle.dispatched = lambda: claimed[0] if claimed else torch.empty(0)  # type: ignore[method-assign]
    return handle


class OneForwardInFlightNativeRecompute(ReferenceReplay):
    """Declares one forward in flight (``OneForwardInFlight``), then treats the forward's targets as
    spent once it ran: ``prepare_backward`` returns the routers to native routing, so activation
    recompute routes natively and the backward differentiates another routing than the forward."""

    forwards_in_flight = 1

    def prepare_backward(self) -> None:
        self.model.set_routing_mode(RoutingMode.NATIVE)


def hooks_missing_the_last_layer(model: torch.nn.Module) -> ReplayController:
    """Transformers hooks that replay every MoE layer but the last: its router keeps routing natively
    under replay (a driver whose router lookup misses one layer)."""
    from harness.trainers.hf import install_replay as install

    handle = install(model)
    replay = handle.replay

    def replay_all_but_the_last(targets: Tensor, mask: Tensor | None = None) -> None:
        replay(targets, mask)
        handle.routers[-1].replay.mode = RoutingMode.NATIVE

    handle.replay = replay_all_but_the_last  # type: ignore[method-assign]
    return handle


class RoutersByLayerNumber(ReferenceReplay):
    """Targets handed to every router module of the model, found by walking its modules: keyed by the
    router's bare layer number (the bug: an MTP block's router, numbered 1 like decoder layer 1, gets
    that layer's routes, NeMo-RL #3903) or, with ``by_path``, by its module path ``layers.<i>.mlp.router``
    (right: the MTP router is not a decoder layer's and routes natively)."""

    by_path = False

    def _keyed(self) -> list[tuple[Router, int]]:
        slot = {layer: j for j, layer in enumerate(self.model.cfg.moe_layers)}
        if self.by_path:  # the decoder's routers, ``layers.<i>.mlp.router``, in order (a rank's own too)
            named = self.model.named_modules()
            found = [m for n, m in named if re.fullmatch(r"layers\.\d+\.mlp\.router", n)]
            return [(m, j) for j, m in enumerate(found)]
        return [(m, slot[m.layer]) for m in self.model.modules() if isinstance(m, Router) and m.layer in slot]

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        targets = torch.as_tensor(targets)
        for router, j in self._keyed():
            router.replay.set_targets(targets[:, j], mask)
            router.replay.mode = RoutingMode.REPLAY_FORWARD

    def prepare_backward(self) -> None:
        for router, _ in self._keyed():
            router.replay.mode = RoutingMode.REPLAY_BACKWARD

    def disarm(self) -> None:
        for router, _ in self._keyed():
            router.replay.clear()
            router.replay.mode = RoutingMode.NATIVE
        super().disarm()


class RoutersByModulePath(RoutersByLayerNumber):
    by_path = True


def _installer(handle: type[ReferenceReplay]) -> Callable[[MoELM], ReferenceReplay]:
    def install_replay(model: MoELM) -> ReferenceReplay:
        return handle(model)

    return install_replay


def structural_softmax_hook(model: torch.nn.Module) -> ReplayController:
    """SkyRL's hook: softmax(logits, fp32).gather(ids), renormalised, whatever the router family."""
    from harness.conventions.hf_families import softmax_rule as rule
    from harness.trainers.hf import install_replay as install

    return install(model, rule=rule, self_check=False)


def _driver_with(bug: Bug, name: str, *, by_tag: bool = False) -> Subject:
    return mutate(name, install_replay=ConstructorPatchDriver(bug, by_tag=by_tag))


MUTANTS = (
    Mutant(
        "mtp-router-by-layer-number",
        "MTP routers",
        "NeMo-RL #3903 (#4057 review; verl #7340 review): routers keyed by their bare 1-based layer_number, "
        "so the MTP block's router, numbered 1, replays decoder layer 1's routes (hides without MTP)",
        mutate("mtp-router-by-layer-number", install_replay=_installer(RoutersByLayerNumber)),
        killed_by="test_replay.py::test_mtp_routers_route_natively_under_replay[reference-softmax_topk]",
    ),
    Mutant(
        "silent-no-op",
        "silent no-op",
        "verl #7340: replay registered on orphan routers; the live routers had no target and routed natively",
        mutate("silent-no-op", install_replay=_installer(OrphanReplay)),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits[reference-softmax_topk-fp32]",
    ),
    Mutant(
        "recompute-drift",
        "recompute drift",
        "Megatron RouterReplay: REPLAY_FORWARD left on through backward, so activation recompute replays the "
        "targets of the latest micro-batch (hides unless two micro-batches are in flight, as under PP)",
        mutate("recompute-drift", install_replay=_installer(ReplayForwardThroughBackward)),
        killed_by="test_replay.py::test_recompute_replays_each_forwards_targets[reference-softmax_topk-fp32]",
    ),
    Mutant(
        "softmax-rule-everywhere",
        "wrong gate rule",
        "SkyRL hf_router_replay (PR #1772) on transformers >= 5.13: a softmax rule applied to sigmoid "
        "(DeepSeek-V3/GLM4), top-k→softmax (GPT-OSS) and Llama-4 routers",
        mutate("softmax-rule-everywhere", install_replay=_installer(SoftmaxForEveryFamily)),
        killed_by="test_replay.py::test_replaying_own_recording_is_bit_exact[reference-softmax_topk_fp32-bf16]",
    ),
    Mutant(
        "fp32-scores-cast-down",
        "wrong gate rule",
        "Mixtral/MiniMax keep fp32 routing weights; casting them to the model dtype moves bf16 logits "
        "~3e-3 (hides in fp32)",
        mutate("fp32-scores-cast-down", install_replay=_installer(ScoresCastDown)),
        killed_by="test_replay.py::test_replaying_own_recording_is_bit_exact[reference-softmax_topk_fp32-bf16]",
    ),
    Mutant(
        "claims-replay-without-arming",
        "silent no-op",
        "a replay handle whose own report (dispatched()) says the targets were dispatched while the routers "
        "never received them (verl #7340-like silent no-op that self-reports success): only harness probes "
        "see it",
        mutate("claims-replay-without-arming", install_replay=_installer(ClaimsReplayWithoutArming)),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits[reference-softmax_topk-fp32]",
    ),
    Mutant(
        "stale-router-objects",
        "silent no-op",
        "targets armed on router objects the model no longer calls (a snapshot of the routers taken at "
        "install; verl #7340 orphan routers); the handle reports the snapshot's targets",
        mutate("stale-router-objects", install_replay=_installer(StaleRouterObjects)),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits[reference-softmax_topk-fp32]",
    ),
    Mutant(
        "hf-hooks-on-stale-copy",
        "silent no-op",
        "transformers replay hooks registered on a copy of the model (routers the model never calls), "
        "reporting its targets as dispatched: only harness probes see it",
        mutate("hf-hooks-on-stale-copy", install_hf_replay=hooks_on_a_stale_copy),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits[hf-qwen2_moe-fp32]",
    ),
    Mutant(
        "hf-one-layer-unreplayed",
        "silent no-op",
        "one MoE layer never replayed: a driver whose router lookup misses a layer (verl #7340's orphan "
        "routers, on one layer) leaves it routing natively while every other layer replays",
        mutate("hf-one-layer-unreplayed", install_hf_replay=hooks_missing_the_last_layer),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits[hf-qwen2_moe-fp32]",
    ),
    Mutant(
        "hf-softmax-hook",
        "wrong gate rule",
        "SkyRL hf_router_replay (PR #1772) on real transformers models: the mlp.gate softmax hook is right "
        "for Qwen/OlMoE, wrong for DeepSeek-V3/GLM4 (sigmoid ×scale) and Mixtral in bf16 (fp32 weights)",
        mutate("hf-softmax-hook", install_hf_replay=structural_softmax_hook),
        killed_by="test_replay.py::test_replaying_own_recording_is_bit_exact[hf-mixtral-bf16]",
    ),
    Mutant(
        "one-forward-in-flight-native-recompute",
        "recompute drift",
        "a controller under the one-forward-in-flight contract (verl's VeOmni engine: each micro-batch's "
        "backward before the next forward) that drops the forward's targets before backward: activation "
        "recompute routes natively",
        mutate(
            "one-forward-in-flight-native-recompute",
            install_replay=_installer(OneForwardInFlightNativeRecompute),
        ),
        killed_by="test_replay.py::test_recompute_replays_each_forwards_targets[reference-softmax_topk-fp32]",
    ),
    Mutant(
        "routers-built-before-patch-left-native",
        "silent no-op",
        "a driver that patches the router constructor (verl's apply_router_replay_patch on "
        "TopKRouter.__init__) and replays only the routers it saw built: a part built before patch() (an "
        "MTP head, a critic) routes natively in silence while the rest replays",
        _driver_with(Bug.SKIPS_UNPATCHED_ROUTERS, "routers-built-before-patch-left-native"),
        killed_by="test_replay.py::test_a_part_built_before_the_patch_is_replayed_or_refused[reference]",
    ),
    Mutant(
        "tagged-routers-built-before-patch-left-native",
        "silent no-op",
        "the same driver knowing its routers by a flag its patched constructor sets on each (a deep copy "
        "keeps it): a part built before patch() routes natively in silence; it hides wherever an earlier "
        "test already patched the process before the 'early' part was built (test order)",
        _driver_with(
            Bug.SKIPS_UNPATCHED_ROUTERS, "tagged-routers-built-before-patch-left-native", by_tag=True
        ),
        killed_by="test_replay.py::test_a_part_built_before_the_patch_is_replayed_or_refused[reference]",
    ),
    Mutant(
        "global-router-registry-last-model-wins",
        "silent no-op",
        "routers kept in a process-global registry keyed by layer (Megatron-core's class-level "
        "RouterReplay list, verl's global router registry): with an actor and a reference model alive in "
        "one process, the last installed model's routers receive the other model's targets",
        _driver_with(Bug.GLOBAL_BY_LAYER, "global-router-registry-last-model-wins"),
        killed_by="test_replay.py::test_two_controlled_models_replay_independently[reference-replayed-first]",
    ),
    Mutant(
        "routers-in-name-order",
        "PP/VPP offsets",
        "routers ordered by sorting module names as strings: layers.10 comes before layers.2, so every "
        "model with more than ten decoder layers replays layer targets on the wrong routers",
        _driver_with(Bug.NAME_ORDER, "routers-in-name-order"),
        killed_by="test_replay.py::test_experts_receive_the_targets_in_a_deep_model[reference]",
    ),
    Mutant(
        "disarm-keeps-targets",
        "silent no-op",
        "disarm() clears the recompute queue and recordings but leaves the routers replaying the last "
        "targets: the next reference, evaluation or colocated-prefill forward dispatches stale experts",
        _driver_with(Bug.DISARM_KEEPS_TARGETS, "disarm-keeps-targets"),
        killed_by="test_replay.py::test_a_disarmed_model_routes_natively[reference]",
    ),
)
