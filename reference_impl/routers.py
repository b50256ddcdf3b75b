"""Router families and the record/replay state of one router.

A router turns the hidden state of each token into `top_k` expert ids and one gate weight per
chosen expert. Families differ in two rules, kept apart here because routing replay needs both:

* `select(logits) -> ids [T, k]` — the family's *native* choice;
* `weights(logits, ids) -> [T, k]` — the family's gate-weight rule evaluated at *given* ids, from
  the live logits, differentiably.

Natively `ids = select(logits)`. Under replay (R2/R3) the ids come from outside (a recording or
the inference engine) and only `weights` is evaluated at them, so the router still receives
gradients, including for experts the live top-k would not pick (DESIGN §3.7).

`RouterReplay`, the state machine each `Router` owns, mirrors Megatron-core's `RouterReplay`
(megatron/core/transformer/moe/router_replay.py): a RECORD action, a REPLAY_FORWARD action that
also pushes its targets onto a FIFO, and a REPLAY_BACKWARD action that pops the FIFO during
activation recompute. Nothing falls back to native routing silently (DESIGN §3.8): a missing or
malformed target raises `ReplayError`. It is the one copy of that machine: the harness's
transformers backend drives the routers it hooks with it too.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .config import ROUTER_FAMILIES, MoEConfig


class ReplayError(RuntimeError):
    """Replay was asked for but cannot be done exactly as asked (missing or malformed targets)."""


class RoutingMode(enum.Enum):
    """What a router does on its next forward call (Megatron-core `RouterReplayAction` + NATIVE)."""

    NATIVE = "native"  # choose with the family's own rule
    RECORD = "record"  # choose natively and keep the ids in `RouterReplay.recorded`
    REPLAY_FORWARD = "replay_forward"  # use the current targets, and queue them for recompute
    REPLAY_BACKWARD = "replay_backward"  # use the oldest queued targets (activation recompute)


# ---------------------------------------------------------------------------------------------
# Router families (FACTS §3). Each is an nn.Module only so that a family with state (the
# DeepSeek correction bias) moves and casts with the model.
# ---------------------------------------------------------------------------------------------


class RouterFamily(nn.Module):
    """A gate-weight rule: the native choice and the weights at any given ids."""

    name: str = ""
    gate_bias: bool = False  # whether the gate linear has a bias (GPT-OSS)

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k

    def select(self, logits: Tensor) -> Tensor:
        """Native expert ids [T, k] (int64) for router logits [T, E]."""
        raise NotImplementedError

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        """Gate weights [T, k] at `ids`, computed from the live `logits` (differentiable)."""
        raise NotImplementedError


class SoftmaxTopK(RouterFamily):
    """softmax(fp32) → top-k → renormalise if `norm_topk_prob` → cast to the logits dtype.

    Qwen2-MoE, Qwen3-MoE, OlMoE (transformers `*TopKRouter`).
    """

    name = "softmax_topk"

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.renormalize = cfg.norm_topk_prob

    def select(self, logits: Tensor) -> Tensor:
        return torch.topk(logits.float().softmax(dim=-1), self.top_k, dim=-1).indices

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        w = logits.float().softmax(dim=-1).gather(-1, ids)
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype)


class SoftmaxTopKFp32(SoftmaxTopK):
    """As `softmax_topk`, but always renormalised and the weights stay fp32 (Mixtral, MiniMax).

    Casting them down to bf16 is a known bug class (FACTS §4 "wrong gate rule"), ~3e-3 on logits.
    """

    name = "softmax_topk_fp32"

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        w = logits.float().softmax(dim=-1).gather(-1, ids)
        return w / w.sum(dim=-1, keepdim=True)


class TopKSoftmax(RouterFamily):
    """top-k on the raw logits → softmax over the k chosen logits (GPT-OSS; gate has a bias)."""

    name = "topk_softmax"
    gate_bias = True

    def select(self, logits: Tensor) -> Tensor:
        return torch.topk(logits, self.top_k, dim=-1).indices

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        return logits.gather(-1, ids).softmax(dim=-1)


class SigmoidGrouped(RouterFamily):
    """sigmoid scores, biased group-limited choice, unbiased renormalised weights × scale.

    DeepSeek-V3, GLM4-MoE. The choice uses `sigmoid(logits) + e_score_correction_bias` and keeps
    only the `topk_group` best of `n_group` expert groups (a group's score is the sum of its two
    best choice scores); the weights use the sigmoid scores *without* the bias, renormalised when
    `norm_topk_prob` (as transformers' DeepseekV3 does), times `routed_scaling_factor`. Applying a
    softmax rule to this family is a known bug (FACTS §3). Replay ignores the group limit: targets
    are taken as given (Megatron-core does the same).
    """

    name = "sigmoid_grouped"
    e_score_correction_bias: Tensor

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.renormalize = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        # Load-balancing bias, updated outside of gradients in DeepSeek-V3; a buffer here.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts))

    def select(self, logits: Tensor) -> Tensor:
        choice = logits.float().sigmoid() + self.e_score_correction_bias.float()
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.n_group, experts // self.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept_groups = group_scores.topk(self.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, kept_groups, True)
        expert_mask = group_mask.repeat_interleave(experts // self.n_group, dim=1)
        # -inf (rather than DeepSeek's 0.0) so a negative biased score never beats a masked group.
        masked = choice.masked_fill(~expert_mask, float("-inf"))
        return masked.topk(self.top_k, dim=-1).indices

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        w = logits.float().sigmoid().gather(-1, ids)
        if self.renormalize:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scale


class Llama4(RouterFamily):
    """top-k on the logits; weights = sigmoid of a -inf matrix scattered with the chosen logits.

    Llama 4 (transformers `Llama4Router`) produces dense scores [T, E] that are 0 off the chosen
    experts; gathered at the ids that is sigmoid(logits at ids), not renormalised. (Llama 4 scales
    the expert *input* by the score; the reference scales every family's expert output, which does
    not change what replay has to get right: the ids and the weight rule.)
    """

    name = "llama4"

    def select(self, logits: Tensor) -> Tensor:
        return torch.topk(logits, self.top_k, dim=-1).indices

    def weights(self, logits: Tensor, ids: Tensor) -> Tensor:
        dense = torch.full_like(logits, float("-inf")).scatter(1, ids, logits.gather(-1, ids))
        return dense.float().sigmoid().to(logits.dtype).gather(-1, ids)


FAMILIES: dict[str, type[RouterFamily]] = {
    cls.name: cls for cls in (SoftmaxTopK, SoftmaxTopKFp32, TopKSoftmax, SigmoidGrouped, Llama4)
}
assert tuple(FAMILIES) == ROUTER_FAMILIES, "config.ROUTER_FAMILIES and routers.FAMILIES disagree"


def make_family(name: str, cfg: MoEConfig) -> RouterFamily:
    """The router family called `name`, with its parameters taken from `cfg`."""
    if name not in FAMILIES:
        raise ValueError(f"unknown router family {name!r}; known: {list(FAMILIES)}")
    return FAMILIES[name](cfg)


# ---------------------------------------------------------------------------------------------
# Record/replay state of one router, and of a model's routers (MoE-ordinal layer axis).
# ---------------------------------------------------------------------------------------------


class ReplayTargets(NamedTuple):
    """What a router is forced to choose for one forward call.

    `ids` [T, k] int64; `mask` [T] bool or None. Where `mask` is False the token has no target
    row (DESIGN §3.6) and routes natively, explicitly; None means every token is replayed.
    """

    ids: Tensor
    mask: Tensor | None


class RouterReplay:
    """The record/replay state machine of one router (Megatron-core's `RouterReplay` + NATIVE).

    `where` names the router in every error (``"decoder layer 3"``). Attributes a test may
    inspect: `mode`, `targets` (the current `ReplayTargets` or None), `backward_targets` (FIFO of
    targets used by REPLAY_FORWARD calls, popped by REPLAY_BACKWARD), `recorded` (ids chosen by
    each RECORD call, detached cpu int64).

    The FIFO is only popped by activation recompute; without recompute nothing pops it and
    `clear()` is the caller's job (as with Megatron's `clear_global_indices`). RECORD under
    recompute records twice: record in a no-grad pass (R2's old-log-prob pass). The reference
    `Router` owns one; the transformers backend (`harness.trainers.hf`) gives one to each router
    it hooks.
    """

    def __init__(self, where: str, num_experts: int, top_k: int) -> None:
        self.where = where
        self.num_experts = num_experts
        self.top_k = top_k
        self.mode = RoutingMode.NATIVE
        self.targets: ReplayTargets | None = None
        self.backward_targets: deque[ReplayTargets] = deque()
        self.recorded: list[Tensor] = []

    @property
    def replaying(self) -> bool:
        """Whether the next call uses targets (REPLAY_FORWARD or REPLAY_BACKWARD)."""
        return self.mode in (RoutingMode.REPLAY_FORWARD, RoutingMode.REPLAY_BACKWARD)

    def choose(self, logits: Tensor, native: Callable[[Tensor], Tensor]) -> Tensor:
        """The ids [T, k] this forward call routes the tokens of `logits` [T, E] to.

        `native(logits)` is the router's own choice, asked for only where it is used: NATIVE,
        RECORD (which keeps it), and the rows a replay mask leaves native.
        """
        if self.mode is RoutingMode.NATIVE:
            return native(logits)
        if self.mode is RoutingMode.RECORD:
            ids = native(logits)
            self.recorded.append(ids.detach().to("cpu", torch.int64))
            return ids
        if self.mode is RoutingMode.REPLAY_FORWARD:
            if self.targets is None:
                raise ReplayError(
                    f"router of {self.where} is in REPLAY_FORWARD but has no replay targets "
                    "(set its targets first)"
                )
            target = self.targets
            self._check_rows(target, logits.shape[0])
            self.backward_targets.append(target)
        else:  # REPLAY_BACKWARD
            if not self.backward_targets:
                raise ReplayError(
                    f"router of {self.where} is in REPLAY_BACKWARD "
                    "but its FIFO is empty (no REPLAY_FORWARD call to recompute)"
                )
            target = self.backward_targets.popleft()
            self._check_rows(target, logits.shape[0])
        ids = target.ids.to(logits.device)
        if target.mask is None:
            return ids
        return torch.where(target.mask.to(logits.device)[:, None], ids, native(logits))

    def _check_rows(self, target: ReplayTargets, tokens: int) -> None:
        if target.ids.shape[0] != tokens:
            raise ReplayError(
                f"replay targets of {self.where} have shape "
                f"{list(target.ids.shape)}, expected [{tokens}, {self.top_k}] "
                "(one row per token this router sees)"
            )

    def set_targets(self, ids: Tensor, mask: Tensor | None = None) -> None:
        """Set the ids [T, k] this router is forced to choose; rows where `mask` is False route
        natively. Replayed rows must hold `top_k` distinct ids in [0, num_experts)."""
        self.targets = self.checked(ids, mask)

    def checked(self, ids: Tensor, mask: Tensor | None = None) -> ReplayTargets:
        """`ids` [T, k] and `mask` [T] bool as this router's `ReplayTargets` (copies), once they are
        checked: an integer dtype, `top_k` distinct ids in [0, num_experts) on every replayed row.
        Anything else is a `ReplayError` naming the router, the row and its ids."""
        ids = torch.as_tensor(ids)
        if ids.ndim != 2 or ids.shape[1] != self.top_k:
            raise ReplayError(
                f"replay targets of {self.where} have shape {list(ids.shape)}, expected [T, {self.top_k}]"
            )
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise ReplayError(
                f"replay targets of {self.where} have dtype {ids.dtype}, expected an integer dtype"
            )
        ids = ids.to(torch.int64).clone()
        if mask is not None:
            mask = torch.as_tensor(mask)
            if mask.dtype != torch.bool or mask.shape != (ids.shape[0],):
                raise ReplayError(
                    f"replay mask of {self.where} has shape {list(mask.shape)} and dtype "
                    f"{mask.dtype}, expected [{ids.shape[0]}] bool"
                )
            mask = mask.clone()
        self._check_ids(ids, mask)
        return ReplayTargets(ids, mask)

    def _check_ids(self, ids: Tensor, mask: Tensor | None) -> None:
        replayed = torch.ones(ids.shape[0], dtype=torch.bool) if mask is None else mask.cpu()
        ids = ids.cpu()
        bad = ((ids < 0) | (ids >= self.num_experts)).any(dim=1) & replayed
        if bad.any():
            row = int(bad.nonzero()[0])
            raise ReplayError(
                f"replay targets of {self.where}: replayed row {row} "
                f"= {ids[row].tolist()} has ids outside [0, {self.num_experts})"
            )
        ordered = ids.sort(dim=1).values
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1) & replayed
        if repeated.any():
            row = int(repeated.nonzero()[0])
            raise ReplayError(
                f"replay targets of {self.where}: replayed row {row} "
                f"= {ids[row].tolist()} repeats an expert (needs {self.top_k} "
                "distinct ids)"
            )

    def clear(self) -> None:
        """Forget targets, the recompute FIFO and recordings."""
        self.targets = None
        self.backward_targets.clear()
        self.recorded.clear()


def set_replay_targets(
    states: Sequence[RouterReplay], targets: Tensor, mask: Tensor | None, moe_layers: Sequence[int]
) -> None:
    """Give each router its slice of `targets` [tokens, len(states), k] (MoE-ordinal layer axis).

    `mask` [tokens] bool: rows where it is False route natively. `moe_layers` names the slots in
    the error. Every router receives a target, so a wrong number of layers is an error rather than
    a partial replay; every slice is checked before any router's targets change.
    """
    targets = torch.as_tensor(targets)
    top_k = states[0].top_k if states else "k"
    if targets.ndim != 3 or targets.shape[1] != len(states):
        raise ReplayError(
            f"replay targets have shape {list(targets.shape)}, expected "
            f"[tokens, {len(states)}, {top_k}] (one slot per MoE layer {list(moe_layers)})"
        )
    checked = [state.checked(targets[:, slot, :], mask) for slot, state in enumerate(states)]
    for state, target in zip(states, checked, strict=True):
        state.targets = target


def pop_recording(states: Sequence[RouterReplay]) -> Tensor:
    """Recorded routing [N, len(states), k] (int64), then clear the recordings.

    Each router's RECORD calls are concatenated along tokens (in call order), then stacked over
    the routers (MoE-ordinal layer axis).
    """
    counts = [len(state.recorded) for state in states]
    if not states or counts[0] == 0 or len(set(counts)) != 1:
        raise ReplayError(
            f"cannot pop a recording: entries per router {counts} (need the "
            "same non-zero number for every MoE layer; record and run a forward first)"
        )
    trace = torch.stack([torch.cat(state.recorded) for state in states], dim=1)
    for state in states:
        state.recorded.clear()
    return trace


# ---------------------------------------------------------------------------------------------
# One router: gate linear, family rule, record/replay state.
# ---------------------------------------------------------------------------------------------


class Router(nn.Module):
    """The router of one MoE layer: gate linear [E, H], family rule, and record/replay state.

    `replay` (a `RouterReplay`) holds the mode, targets, recompute FIFO and recordings.
    """

    def __init__(
        self, cfg: MoEConfig, layer: int, *, where: str | None = None, family: str | None = None
    ) -> None:
        super().__init__()
        self.layer = layer  # decoder index (an MTP block's: its 1-based number), named in every error
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.family = make_family(family or cfg.family_of(layer), cfg)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=self.family.gate_bias)
        self.replay = RouterReplay(where or f"decoder layer {layer}", cfg.num_experts, cfg.top_k)

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens `hidden` [T, H] → (ids [T, k] int64, weights [T, k], logits [T, E])."""
        logits = self.gate(hidden)
        ids = self.replay.choose(logits.detach(), self.family.select)
        return ids, self.family.weights(logits, ids), logits
