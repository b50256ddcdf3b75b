"""The trainer side of routing replay: the old-log-prob pass, the update pass, the reference pass.

One PPO-style step of an RL trainer computes log-probs of the sampled tokens three times:

* the **old** pass (no grad) gives π_old, the denominator of the importance ratio;
* the **update** pass (with grad) gives π_θ, once per mini-batch;
* the **reference** pass (no grad, a frozen model) gives π_ref for the KL penalty.

Routing replay decides what the routers do in the first two (DESIGN §3.9):

* ``DISABLED`` — every pass routes natively.
* ``R2`` — the old pass RECORDs the trainer's own routing and the update pass replays that
  recording, so the first on-policy mini-batch has π_θ = π_old bit for bit (``ppo_kl == 0``) and a
  later mini-batch keeps the routes π_old was computed with. R2 uses no rollout routes; a batch
  that carries some is a configuration error (verl: ``rollout.enable_rollout_routing_replay``
  must be False for R2).
* ``R3`` — both the old and the update pass replay the *rollout* routes, the experts the
  inference engine chose (verl: ``enable_rollout_routing_replay`` must be True). Rows that exist
  are replayed, prompt rows included; positions without a row (each sample's last token, the
  padding) route natively, explicitly, through the replay mask (DESIGN §3.6).

The reference pass never replays, in any mode: π_ref is the frozen model's own distribution, and
replaying into it is the "R2/R3 config" bug class (FACTS §4).

Replay state lives in the routers (targets, the recompute FIFO, recordings; see
`reference_impl.routers`). Every pass clears it when it ends, even on error, so nothing leaks into
the next pass (verl has shipped FIFO leaks). The one exception is deliberate: an update pass with
activation recompute (``use_checkpoint=True``) leaves the routers in REPLAY_BACKWARD holding the
FIFO that the recompute pops, and `backward` clears it once the gradients are in.

Batches are left-padded `Placed` batches (`reference_impl.layouts.place_left_padded`); token
column ``t`` of row ``b`` is router row ``b*W + t`` of the model (`reference_impl.model`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor

from .config import LayerAxis
from .layouts import Placed, place_left_padded, stage_targets, stage_targets_moe_ordinal
from .model import MoELM
from .routers import ReplayError, RoutingMode


class ReplayMode(str, Enum):
    """Which routing replay the trainer runs (verl's ``router_replay.mode``)."""

    DISABLED = "disabled"
    R2 = "R2"
    R3 = "R3"


class TrainerConfigError(ValueError):
    """The replay mode and the batch contradict each other (DESIGN §3.9)."""


class OldPass(NamedTuple):
    """Result of `old_logprobs`.

    ``logprobs`` [B, W] fp32 (see `token_logprobs`). ``recording`` (R2 only, else None): the
    routes this pass chose, [B*W, n_moe, k] int64 in the model's row order, for the update pass
    to replay.
    """

    logprobs: Tensor
    recording: Tensor | None


# ---------------------------------------------------------------------------------------------
# Log-probs of the sampled tokens
# ---------------------------------------------------------------------------------------------


def logprob_mask(attention_mask: Tensor) -> Tensor:
    """[B, W] bool: True at the columns that have a log-prob (a real token after a real token).

    Column 0, padding and each sample's first token are False: nothing predicts them.
    """
    real = attention_mask.bool()
    valid = torch.zeros_like(real)
    valid[:, 1:] = real[:, 1:] & real[:, :-1]
    return valid


def token_logprobs(
    model: MoELM, tokens: Tensor, attention_mask: Tensor, *, use_checkpoint: bool = False
) -> Tensor:
    """log p(token_t | tokens_<t) at column t, [B, W] fp32; 0 where `logprob_mask` is False.

    One full forward of `tokens` [B, W] in the model's dtype; the log-softmax is taken in fp32 (as
    verl and SkyRL do), so bf16 logits are not rounded twice. Routing follows whatever mode the
    routers are in; the passes below set it.
    """
    logits = model(tokens, attention_mask=attention_mask, use_checkpoint=use_checkpoint)
    predicted = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = predicted.gather(-1, tokens[:, 1:, None].long()).squeeze(-1)
    logprobs = torch.cat([picked.new_zeros(tokens.shape[0], 1), picked], dim=1)
    return torch.where(logprob_mask(attention_mask), logprobs, torch.zeros_like(logprobs))


# ---------------------------------------------------------------------------------------------
# Replay targets and the mode check
# ---------------------------------------------------------------------------------------------


def place_without_routes(samples: Sequence[Tensor], width: int) -> Placed:
    """Left-pad token-only samples (an R2 or DISABLED batch): the routes have zero layers.

    That is how a `Placed` says "no rollout routes" (see `has_rollout_routes`).
    """
    return place_left_padded(
        [(tokens, torch.zeros(tokens.shape[0] - 1, 0, 0, dtype=torch.int64)) for tokens in samples], width
    )


def has_rollout_routes(placed: Placed) -> bool:
    """Whether the batch carries routes from the inference engine (any layer slot at all)."""
    return placed.routes.shape[2] > 0


def check_mode(mode: ReplayMode | str, placed: Placed) -> ReplayMode:
    """The mode as a `ReplayMode`, once it is checked against the batch (DESIGN §3.9).

    R2 replays the trainer's own recording, so rollout routes next to it mean the run was
    configured for R3 as well: an error rather than a guess. R3 needs rollout routes. DISABLED
    ignores any routes (a no-replay baseline on the same batch).
    """
    try:
        mode = ReplayMode(mode)
    except ValueError:
        raise TrainerConfigError(
            f"replay mode {mode!r}: expected one of {[m.value for m in ReplayMode]}"
        ) from None
    if mode is ReplayMode.R2 and has_rollout_routes(placed):
        raise TrainerConfigError(
            "R2 replays the trainer's own recording, but the batch carries "
            "rollout routes (verl: rollout.enable_rollout_routing_replay "
            "must be False for R2; use R3 to replay rollout routes)"
        )
    if mode is ReplayMode.R3 and not has_rollout_routes(placed):
        raise TrainerConfigError(
            "R3 replays rollout routes, but the batch carries none (verl: "
            "rollout.enable_rollout_routing_replay must be True for R3)"
        )
    return mode


def replay_targets(
    placed: Placed, moe_layers: Sequence[int], layer_axis: LayerAxis | str
) -> tuple[Tensor, Tensor]:
    """Per-router targets [B*W, n_moe, k] int64 and replay mask [B*W] bool, in row b*W + t.

    `placed.routes` [B, W, layers, k] is on the `layer_axis` convention: ``"decoder"`` has one slot
    per decoder layer (dense slots are skipped), ``"moe_ordinal"`` one per MoE layer; `moe_layers`
    are the decoder indices of the model's MoE layers. The mask is `placed.replay_mask`: True where
    a row exists (prompt rows included), False at each sample's last token and at padding, whose
    zero filler is never replayed — those rows route natively.
    """
    if not moe_layers:
        raise TrainerConfigError("moe_layers is empty: a model without MoE layers has nothing to replay")
    batch, width = placed.tokens.shape
    rows = placed.routes.reshape(batch * width, *placed.routes.shape[2:])
    whole_model = range(max(moe_layers) + 1)  # one pipeline stage holding every layer
    try:
        axis = LayerAxis.parse(layer_axis)
    except ValueError as err:
        raise TrainerConfigError(str(err)) from None
    stage = stage_targets if axis is LayerAxis.DECODER else stage_targets_moe_ordinal
    return stage(rows, moe_layers, whole_model).long(), placed.replay_mask.reshape(-1)


def tokens_per_expert(
    placed: Placed,
    moe_layers: Sequence[int],
    num_experts: int,
    layer_axis: LayerAxis | str = LayerAxis.DECODER,
) -> Tensor:
    """How many tokens each expert of each MoE layer receives in a micro-batch: [n_moe, E] int64.

    The load-balancing statistics (``tokens_per_expert``, the aux loss, the expert-bias update) count
    the rows that hold a route, exactly the replayed ones (`replay_targets`' mask): never the padding,
    a sample's last token or any filler there, whose ids route nothing (SkyRL #1908 bug 4).
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise TrainerConfigError(f"num_experts = {num_experts!r}: expected an int >= 1")
    targets, mask = replay_targets(placed, moe_layers, layer_axis)
    ids = targets[mask]  # [rows, n_moe, k]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise TrainerConfigError(f"routes hold ids outside [0, num_experts={num_experts})")
    one_hot = torch.nn.functional.one_hot(ids, num_experts)  # [rows, n_moe, k, E]
    return one_hot.sum(dim=(0, 2)).to(torch.int64)


# ---------------------------------------------------------------------------------------------
# The three passes
# ---------------------------------------------------------------------------------------------


def _reset(model: MoELM) -> None:
    """End of a pass: no targets, an empty FIFO, no recordings, native routing."""
    model.clear_replay()
    model.set_routing_mode(RoutingMode.NATIVE)


@contextmanager
def _pass(model: MoELM, mode: RoutingMode) -> Iterator[None]:
    """Run a pass with every router in `mode`; reset the replay state however it ends."""
    model.set_routing_mode(mode)
    try:
        yield
    finally:
        _reset(model)


def old_logprobs(
    model: MoELM,
    placed: Placed,
    mode: ReplayMode | str,
    *,
    moe_layers: Sequence[int],
    layer_axis: LayerAxis | str = LayerAxis.DECODER,
) -> OldPass:
    """π_old of the batch, without grad. R2 records the routing; R3 replays the rollout routes."""
    mode = check_mode(mode, placed)
    with torch.no_grad():
        if mode is ReplayMode.R2:
            with _pass(model, RoutingMode.RECORD):
                logprobs = token_logprobs(model, placed.tokens, placed.attention_mask)
                recording = model.pop_recording()
            return OldPass(logprobs, recording)
        if mode is ReplayMode.R3:
            targets, mask = replay_targets(placed, moe_layers, layer_axis)
            with _pass(model, RoutingMode.REPLAY_FORWARD):
                model.set_replay_targets(targets, mask)
                return OldPass(token_logprobs(model, placed.tokens, placed.attention_mask), None)
        with _pass(model, RoutingMode.NATIVE):
            return OldPass(token_logprobs(model, placed.tokens, placed.attention_mask), None)


def policy_logprobs(
    model: MoELM,
    placed: Placed,
    mode: ReplayMode | str,
    *,
    old: OldPass,
    moe_layers: Sequence[int],
    layer_axis: LayerAxis | str = LayerAxis.DECODER,
    use_checkpoint: bool = False,
) -> Tensor:
    """π_θ of the batch, with grad: the update pass of one mini-batch.

    R2 replays `old.recording` at every real token (padding routes natively); R3 replays the
    rollout routes with the same mask as the old pass. Without recompute the replay state is
    cleared before returning. With ``use_checkpoint=True`` the backward pass recomputes every
    decoder layer and must replay what this forward used: the routers are left in REPLAY_BACKWARD
    with one FIFO entry each (Megatron-core semantics), so call `backward` for this loss before the
    next pass.
    """
    mode = check_mode(mode, placed)
    if mode is ReplayMode.DISABLED:
        with _pass(model, RoutingMode.NATIVE):
            return token_logprobs(model, placed.tokens, placed.attention_mask, use_checkpoint=use_checkpoint)
    if mode is ReplayMode.R2:
        if old.recording is None:
            raise TrainerConfigError(
                "R2 update pass needs the recording of an R2 old pass (old.recording is None)"
            )
        targets, mask = old.recording, placed.attention_mask.reshape(-1).bool()
    else:
        targets, mask = replay_targets(placed, moe_layers, layer_axis)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    try:
        model.set_replay_targets(targets, mask)
        logprobs = token_logprobs(model, placed.tokens, placed.attention_mask, use_checkpoint=use_checkpoint)
    except BaseException:
        _reset(model)
        raise
    if not use_checkpoint:
        _reset(model)
        return logprobs
    for router in model.routers():
        router.replay.targets = None  # only the FIFO is needed now, and the recompute pops it
    model.set_routing_mode(RoutingMode.REPLAY_BACKWARD)
    return logprobs


def backward(loss: Tensor, model: MoELM) -> None:
    """``loss.backward()`` for the loss of one `policy_logprobs` pass, then reset the routers.

    Under recompute every router must have popped exactly its one FIFO entry; an entry left over
    means a forward's targets were never replayed, and would be popped by the next recompute
    (a FIFO leak): that is a `ReplayError`. Call once per update pass, in forward order.
    """
    try:
        loss.backward()
        leftover = [len(router.replay.backward_targets) for router in model.routers()]
        if any(leftover):
            raise ReplayError(
                f"recompute FIFO not drained by backward: entries left per MoE layer {leftover}"
            )
    finally:
        _reset(model)


def reference_logprobs(model_ref: MoELM, placed: Placed) -> Tensor:
    """π_ref of the batch, without grad, routed natively whatever the routers were set to.

    Never replays (DESIGN §3.9): the routers run NATIVE for this pass and get their previous modes
    back afterwards; their targets, FIFO and recordings are neither read nor changed, so the pass
    is safe even on a model in the middle of an update pass.
    """
    routers = model_ref.routers()
    modes = [router.replay.mode for router in routers]
    model_ref.set_routing_mode(RoutingMode.NATIVE)
    try:
        with torch.no_grad():
            return token_logprobs(model_ref, placed.tokens, placed.attention_mask)
    finally:
        for router, previous in zip(routers, modes, strict=True):
            router.replay.mode = previous


# ---------------------------------------------------------------------------------------------
# PPO quantities
# ---------------------------------------------------------------------------------------------


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    mask = mask.bool()
    if not bool(mask.any()):
        raise ValueError("mask selects no token")
    return values[mask].mean()


def ppo_kl(new_logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``old − new`` over the `mask`ed (response) tokens: verl's ``ppo_kl``.

    The k1 estimator of KL(π_old ‖ π_θ) on tokens sampled from π_old. It is exactly 0 when the
    update pass reproduces the old pass bit for bit, which is what R2 guarantees for the first
    on-policy mini-batch.
    """
    return _masked_mean(old_logprobs - new_logprobs, mask)


def ppo_loss(
    new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip: float = 0.2
) -> Tensor:
    """Clipped-ratio policy loss: mean of −min(r·A, clip(r, 1 ± clip)·A), r = exp(new − old)."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip)
    return _masked_mean(-torch.minimum(ratio * advantages, clipped * advantages), mask)
