"""Trainer-configuration mutants: R2 next to rollout routes, and a reference pass that replays."""

from __future__ import annotations

from typing import Any

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


MUTANTS = (
    Mutant(
        "prompt-rows-native",
        "prompt rows native",
        "verl #6325: the R3 replay mask was the response mask, so prompt rows routed natively",
        mutate(
            "prompt-rows-native",
            training=patched_module(training, replay_targets=replay_targets_response_only),
        ),
    ),
    Mutant(
        "r2-with-rollout-routes",
        "R2/R3 config",
        "verl requires rollout.enable_rollout_routing_replay False for R2; accepting both replays a mix",
        mutate("r2-with-rollout-routes", training=patched_module(training, check_mode=check_mode_trusting)),
    ),
    Mutant(
        "reference-logprobs-replayed",
        "R2/R3 config",
        "DESIGN §3.9: reference log-probs never replay; a KL reference computed under replay is biased",
        mutate(
            "reference-logprobs-replayed",
            training=patched_module(training, reference_logprobs=reference_logprobs_in_current_mode),
        ),
    ),
)
