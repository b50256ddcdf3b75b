"""Replay mutants: replay that does nothing, drifts under recompute, or uses the wrong gate rule."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate
from harness.subjects.capabilities import ReplayController
from harness.subjects.reference import ReferenceReplay
from reference_impl import MoELM


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


def _installer(handle: type[ReferenceReplay]) -> Callable[[MoELM], ReferenceReplay]:
    def install_replay(model: MoELM) -> ReferenceReplay:
        return handle(model)

    return install_replay


def structural_softmax_hook(model: torch.nn.Module) -> ReplayController:
    """SkyRL's hook: softmax(logits, fp32).gather(ids), renormalised, whatever the router family."""
    from harness.trainers.hf import install_replay as install
    from harness.trainers.hf import softmax_rule as rule

    return install(model, rule=rule, self_check=False)


MUTANTS = (
    Mutant(
        "silent-no-op",
        "silent no-op",
        "verl #7340: replay registered on orphan routers; the live routers had no target and routed natively",
        mutate("silent-no-op", install_replay=_installer(OrphanReplay)),
    ),
    Mutant(
        "recompute-drift",
        "recompute drift",
        "Megatron RouterReplay: REPLAY_FORWARD left on through backward, so activation recompute replays the "
        "targets of the latest micro-batch (hides unless two micro-batches are in flight, as under PP)",
        mutate("recompute-drift", install_replay=_installer(ReplayForwardThroughBackward)),
    ),
    Mutant(
        "softmax-rule-everywhere",
        "wrong gate rule",
        "SkyRL hf_router_replay (PR #1772) on transformers >= 5.13: a softmax rule applied to sigmoid "
        "(DeepSeek-V3/GLM4), top-k→softmax (GPT-OSS) and Llama-4 routers",
        mutate("softmax-rule-everywhere", install_replay=_installer(SoftmaxForEveryFamily)),
    ),
    Mutant(
        "fp32-scores-cast-down",
        "wrong gate rule",
        "Mixtral/MiniMax keep fp32 routing weights; casting them to the model dtype moves bf16 logits "
        "~3e-3 (hides in fp32)",
        mutate("fp32-scores-cast-down", install_replay=_installer(ScoresCastDown)),
    ),
    Mutant(
        "hf-softmax-hook",
        "wrong gate rule",
        "SkyRL hf_router_replay (PR #1772) on real transformers models: the mlp.gate softmax hook is right "
        "for Qwen/OlMoE, wrong for DeepSeek-V3/GLM4 (sigmoid ×scale) and Mixtral in bf16 (fp32 weights)",
        mutate("hf-softmax-hook", install_hf_replay=structural_softmax_hook),
    ),
)
