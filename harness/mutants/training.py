"""Trainer mutants: R2 next to rollout routes, a reference pass that replays, an update pass or its
recompute that routes natively, targets shifted by dense layers, wrong PPO quantities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from harness.mutants import Mutant, mutate, patched_module
from reference_impl import training
from reference_impl.layouts import Placed


def check_mode_trusting(mode: Any, placed: Placed) -> training.ReplayMode:
    """Any mode goes with any batch: R2 silently ignores the rollout routes it was given."""
    return training.ReplayMode(mode)


def reference_logprobs_in_current_mode(model_ref: Any, placed: Placed) -> Tensor:
    """π_ref computed in whatever routing mode the model was left in (replay included)."""
    return training.token_logprobs(model_ref, placed.tokens, placed.attention_mask).detach()


def replay_targets_response_only(placed: Placed, moe_layers: Any, layer_axis: Any) -> tuple[Tensor, Tensor]:
    """The R3 mask built from the response mask: prompt rows route natively."""
    targets, mask = training.replay_targets(placed, moe_layers, layer_axis)
    if placed.response_mask is None:
        return targets, mask
    return targets, mask & placed.response_mask.reshape(-1)


def policy_logprobs_native(model: Any, placed: Placed, mode: Any, **kwargs: Any) -> Tensor:
    """The update pass checks the mode, then routes natively: replay registered but never applied."""
    training.check_mode(mode, placed)
    kwargs.pop("old"), kwargs.pop("moe_layers"), kwargs.pop("layer_axis", None)
    return training.policy_logprobs(model, placed, "disabled", old=None, moe_layers=(), **kwargs)  # type: ignore[arg-type]


def policy_logprobs_recompute_native(model: Any, placed: Placed, mode: Any, **kwargs: Any) -> Tensor:
    """The forward replays, but the routers are reset before backward: the recompute routes natively."""
    logprobs = training.policy_logprobs(model, placed, mode, **kwargs)
    model.clear_replay()
    model.set_routing_mode(training.RoutingMode.NATIVE)
    return logprobs


def replay_targets_by_ordinal(
    placed: Placed, moe_layers: Sequence[int], layer_axis: Any
) -> tuple[Tensor, Tensor]:
    """A decoder-axis trace indexed by MoE ordinal: with dense-first layers every MoE layer gets the
    slot of the layer below it."""
    batch, width = placed.tokens.shape
    rows = placed.routes.reshape(batch * width, *placed.routes.shape[2:])
    return rows[:, : len(moe_layers)].long(), placed.replay_mask.reshape(-1)


def tokens_per_expert_over_every_row(
    placed: Placed,
    moe_layers: Sequence[int],
    num_experts: int,
    layer_axis: Any = "decoder",
    *,
    exact: bool = False,
) -> Any:
    """Router statistics from every row of the micro-batch: the replay mask is applied to the token
    axis *after* counting (a ``[tokens]`` mask against ``[tokens, experts]``, broadcast away), so the
    padding's and last tokens' filler ids are counted (SkyRL #1908 bug 4). With ``exact`` (right):
    numpy ``bincount`` per layer over the rows the mask keeps, as int32."""
    targets, mask = training.replay_targets(placed, moe_layers, layer_axis)
    ids = targets.numpy()
    if exact:
        ids = ids[mask.numpy()]
    return np.stack(
        [np.bincount(ids[:, j].reshape(-1), minlength=num_experts) for j in range(ids.shape[1])]
    ).astype(np.int32)


def ppo_loss_unclipped(
    new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip: float = 0.2
) -> Tensor:
    """The policy-gradient loss without the ratio clip."""
    return (-torch.exp(new_logprobs - old_logprobs) * advantages)[mask.bool()].mean()


def logprob_mask_with_first_tokens(attention_mask: Tensor) -> Tensor:
    """Every real token but column 0 counted: a left-padded sample's first token is scored after padding."""
    valid = attention_mask.bool().clone()
    valid[:, 0] = False
    return valid


MUTANTS = (
    Mutant(
        "tokens-per-expert-over-padding",
        "router statistics over wrong rows",
        "SkyRL #1908 bug 4: tokens_per_expert / aux-loss counters built with a [tokens] mask against "
        "[tokens, experts], so padding, last-token and uncaptured rows' filler ids are counted (hides on a "
        "batch without padding)",
        mutate(
            "tokens-per-expert-over-padding",
            training=patched_module(training, tokens_per_expert=tokens_per_expert_over_every_row),
        ),
        killed_by="test_training.py::test_router_statistics_count_only_rows_that_hold_a_route",
    ),
    Mutant(
        "prompt-rows-native",
        "prompt rows native",
        "verl #6325: the R3 replay mask was the response mask, so prompt rows routed natively",
        mutate(
            "prompt-rows-native",
            training=patched_module(training, replay_targets=replay_targets_response_only),
        ),
        killed_by="test_training.py::test_replay_targets_are_the_placed_routes_of_each_moe_layer[decoder-dense-first]",
    ),
    Mutant(
        "r2-with-rollout-routes",
        "R2/R3 config",
        "verl requires rollout.enable_rollout_routing_replay False for R2; accepting both replays a mix",
        mutate("r2-with-rollout-routes", training=patched_module(training, check_mode=check_mode_trusting)),
        killed_by="test_training.py::test_r2_with_rollout_routes_is_a_configuration_error",
    ),
    Mutant(
        "reference-logprobs-replayed",
        "R2/R3 config",
        "DESIGN §3.9: reference log-probs never replay; a KL reference computed under replay is biased",
        mutate(
            "reference-logprobs-replayed",
            training=patched_module(training, reference_logprobs=reference_logprobs_in_current_mode),
        ),
        killed_by="test_training.py::test_reference_logprobs_never_replay",
    ),
    Mutant(
        "update-pass-native",
        "silent no-op",
        "verl #7340 class: the update pass accepts R2/R3 but routes natively, so π_θ ≠ π_old on the first "
        "on-policy mini-batch (hides on a batch whose rollout routes equal native routing)",
        mutate(
            "update-pass-native", training=patched_module(training, policy_logprobs=policy_logprobs_native)
        ),
        killed_by="test_training.py::test_r3_update_replays_rollout_routes_and_first_minibatch_has_zero_kl[decoder-no-recompute]",
    ),
    Mutant(
        "recompute-routes-natively",
        "recompute drift",
        "Megatron RouterReplay: replay state reset before backward, so activation recompute routes natively "
        "(hides without use_checkpoint)",
        mutate(
            "recompute-routes-natively",
            training=patched_module(training, policy_logprobs=policy_logprobs_recompute_native),
        ),
        killed_by="test_training.py::test_r3_update_replays_rollout_routes_and_first_minibatch_has_zero_kl[decoder-recompute]",
    ),
    Mutant(
        "targets-dense-shift",
        "dense-layer shift",
        "verl #5037 in the trainer's target builder: decoder-axis slots taken by MoE ordinal "
        "(hides without dense-first layers)",
        mutate(
            "targets-dense-shift", training=patched_module(training, replay_targets=replay_targets_by_ordinal)
        ),
        killed_by="test_training.py::test_replay_targets_are_the_placed_routes_of_each_moe_layer[decoder-dense-first]",
    ),
    Mutant(
        "ppo-loss-unclipped",
        "PPO quantities",
        "the clipped-ratio policy loss computed without the clip",
        mutate("ppo-loss-unclipped", training=patched_module(training, ppo_loss=ppo_loss_unclipped)),
        killed_by="test_training.py::test_ppo_quantities_follow_their_formulas",
    ),
    Mutant(
        "first-token-scored",
        "PPO quantities",
        "logprob mask counting each left-padded sample's first token, predicted from padding",
        mutate(
            "first-token-scored",
            training=patched_module(training, logprob_mask=logprob_mask_with_first_tokens),
        ),
        killed_by="test_training.py::test_token_logprobs_are_the_models_log_probabilities",
    ),
)
