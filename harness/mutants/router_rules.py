"""Mutants inside one router's choice: how replay targets reach the dispatch, and the group limit.

Each is a reference controller whose routers' ``choose`` passes through one function
``(replay_state, family, logits, native) -> ids``; the correct twin of each makes another legitimate
choice in the same code (``harness.mutants.benign`` registers them).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate
from harness.subjects.reference import ReferenceReplay
from reference_impl import MoELM, RoutingMode
from reference_impl.routers import RouterFamily, RouterReplay, SigmoidGrouped

Choose = Callable[[RouterReplay, RouterFamily, Tensor, Callable[[Tensor], Tensor]], Tensor]


class ChoiceOverride(ReferenceReplay):
    """The reference controller, every router's choice routed through ``choose``."""

    def __init__(self, model: MoELM, choose: Choose) -> None:
        super().__init__(model)
        for router in model.routers():
            router.replay.choose = partial(choose, router.replay, router.family)  # type: ignore[method-assign]


def installer(choose: Choose) -> Callable[[MoELM], ReferenceReplay]:
    """An ``install_replay`` whose controller routes every router's choice through ``choose``."""

    def install_replay(model: MoELM) -> ReferenceReplay:
        return ChoiceOverride(model, choose)

    return install_replay


# --- targets moved to the logits ---------------------------------------------------------------------


def targets_moved_through(
    state: RouterReplay, family: RouterFamily, logits: Tensor, native: Any, *, exact: bool
) -> Tensor:
    """Replayed ids moved to the logits through a floating dtype: the logits' own (``ids.to(logits)``,
    device *and* dtype; bf16 holds every integer only up to 256) or, with ``exact``, fp32 (every
    integer up to 2**24: a legitimate round trip)."""
    ids = RouterReplay.choose(state, logits, native)
    if not state.replaying:
        return ids
    moved = ids.to(torch.float32 if exact else logits.dtype).to(logits.device)
    return moved.to(torch.int64)


# --- the group limit (DeepSeek-V3 / GLM4-MoE: n_group, topk_group) -------------------------------------


def _choice_scores(family: SigmoidGrouped, logits: Tensor) -> Tensor:
    return logits.float().sigmoid() + family.e_score_correction_bias.float()


def _group_limited_top_k(family: SigmoidGrouped, scores: Tensor, kept_groups: Tensor) -> Tensor:
    """The top-k of ``scores`` [T, E] among the experts of ``kept_groups`` [T, g] only."""
    tokens, experts = scores.shape
    per_group = experts // family.n_group
    allowed = torch.zeros(tokens, family.n_group, dtype=torch.bool)
    allowed.scatter_(1, kept_groups.to(torch.int64).cpu(), True)
    masked = scores.masked_fill(~allowed.to(scores.device).repeat_interleave(per_group, dim=1), float("-inf"))
    return masked.topk(family.top_k, dim=-1).indices


def replayed_at_the_group_stage(
    state: RouterReplay, family: RouterFamily, logits: Tensor, native: Any, *, stage: str
) -> Tensor:
    """A group-limited router whose replay hook takes the place of one of its two top-k calls.

    ``stage="group"`` (the bug): the targets replace the *group* top-k (the kept groups become the
    targets' groups) and the expert top-k then runs natively inside them. ``stage="expert"`` (right):
    the group stage runs natively and is overruled by the targets at the final expert top-k.
    """
    if not (state.replaying and isinstance(family, SigmoidGrouped)):
        return RouterReplay.choose(state, logits, native)
    targets = RouterReplay.choose(state, logits, native)
    if stage == "expert":
        return targets
    groups = torch.div(targets, logits.shape[-1] // family.n_group, rounding_mode="floor")
    return _group_limited_top_k(family, _choice_scores(family, logits.detach()), groups)


def recorded_by_own_top_k(
    state: RouterReplay, family: RouterFamily, logits: Tensor, native: Any, *, group_limit: bool
) -> Tensor:
    """A RECORD branch re-implemented next to the native one: the biased scores' top-k, with the
    group limit (``group_limit``, right: each kept group found by its two best scores) or without it
    (the bug). Native routing and replay are the reference's."""
    if state.mode is not RoutingMode.RECORD or not isinstance(family, SigmoidGrouped):
        return RouterReplay.choose(state, logits, native)
    scores = _choice_scores(family, logits)
    if group_limit:
        grouped = scores.view(scores.shape[0], family.n_group, -1)
        best_two = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)
        kept = best_two.argsort(dim=-1, descending=True)[:, : family.topk_group]
        ids = _group_limited_top_k(family, scores, kept)
    else:
        ids = scores.topk(family.top_k, dim=-1).indices
    state.recorded.append(ids.detach().to("cpu", torch.int64))
    return ids


MUTANTS = (
    Mutant(
        "targets-in-logits-dtype",
        "dtype wrap",
        "a replay driver moving its targets with ids.to(router_logits), taking the logits' dtype with their "
        "device: in a bf16 model with more than 256 experts (Kimi K2 384, Qwen3-Next 512) ids above 256 "
        "round onto other experts (hides below 257 experts and in fp32)",
        mutate(
            "targets-in-logits-dtype", install_replay=installer(partial(targets_moved_through, exact=False))
        ),
        killed_by="test_replay.py::test_experts_receive_the_targets_in_a_wide_bf16_model[reference]",
    ),
    Mutant(
        "replay-at-the-group-top-k",
        "group-limited routing",
        "miles #2235: the replay hook takes the place of the group-score top-k (n_group / topk_group) "
        "instead of the final expert top-k; the experts are then chosen natively inside the targets' "
        "groups (hides on routers without a group limit)",
        mutate(
            "replay-at-the-group-top-k",
            install_replay=installer(partial(replayed_at_the_group_stage, stage="group")),
        ),
        killed_by="test_replay.py::test_experts_receive_the_targets_whatever_the_live_logits"
        "[reference-sigmoid_grouped-fp32]",
    ),
    Mutant(
        "record-without-group-limit",
        "group-limited routing",
        "a re-implemented Megatron routing whose RECORD branch runs the plain top-k without "
        "moe_router_num_groups / moe_router_group_topk while native routing keeps the limit: R2 records, "
        "and faithfully replays, a routing the model never takes",
        mutate(
            "record-without-group-limit",
            install_replay=installer(partial(recorded_by_own_top_k, group_limit=False)),
        ),
        killed_by="test_replay.py::test_a_recording_is_the_models_native_routing[reference-sigmoid_grouped-fp32]",
    ),
)
