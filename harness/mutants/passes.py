"""Mutants of the replay state *between* a trainer's passes: what one pass leaves for the next.

A forward-only pass that leaves its recompute entries behind (SkyRL #1908 bug 1), and an R2 update
that reads a recording made in an earlier step (verl #7805). Each function's correct twin makes the
other legitimate choice in the same code (``harness.mutants.benign``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate, patched_module
from reference_impl import MoELM, RoutingMode, training
from reference_impl.layouts import Placed


def _end_pass_keeping_fifo(model: MoELM) -> None:
    """Targets dropped and routing native, the recompute FIFO left as the pass filled it."""
    for router in model.routers():
        router.replay.targets = None
        router.replay.recorded.clear()
    model.set_routing_mode(RoutingMode.NATIVE)


def old_logprobs_leaving_fifo(model: MoELM, placed: Placed, mode: Any, **kwargs: Any) -> training.OldPass:
    """R3's forward-only pass run the way its update pass runs (REPLAY_FORWARD queues each forward's
    targets for a recompute), ended by dropping the targets only: its queue entries stay, and the next
    recompute pops them (SkyRL #1908 bug 1)."""
    if training.check_mode(mode, placed) is not training.ReplayMode.R3:
        return training.old_logprobs(model, placed, mode, **kwargs)
    targets, mask = training.replay_targets(placed, kwargs["moe_layers"], kwargs.get("layer_axis", "decoder"))
    model.set_replay_targets(targets, mask)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    try:
        with torch.no_grad():
            logprobs = training.token_logprobs(model, placed.tokens, placed.attention_mask)
        return training.OldPass(logprobs, None)
    finally:
        _end_pass_keeping_fifo(model)


def policy_logprobs_clearing_first(model: MoELM, placed: Placed, mode: Any, **kwargs: Any) -> Tensor:
    """The update pass clears the replay state *before* it starts (the other side of a pipeline
    schedule): whatever an earlier pass left, its recompute pops only its own entries."""
    model.clear_replay()
    return training.policy_logprobs(model, placed, mode, **kwargs)


KEPT = "_rrh_r2_recording"
"""Where the mutants below keep an R2 recording on the model (Megatron-core's routers hold theirs)."""


def old_logprobs_recording_once(
    model: MoELM, placed: Placed, mode: Any, *, fresh: bool, **kwargs: Any
) -> training.OldPass:
    """R2's old pass with the recording kept on the model for the update pass to read.

    ``fresh=False`` (the bug): once the model holds a recording, later steps skip the RECORD forward
    (a "bypass" old pass computing π_old natively) and hand on the recording kept from an earlier step
    (verl #7805). ``fresh=True``: every old pass records and replaces the kept recording.
    """
    if training.check_mode(mode, placed) is not training.ReplayMode.R2:
        return training.old_logprobs(model, placed, mode, **kwargs)
    kept = getattr(model, KEPT, None)
    if not fresh and kept is not None and kept.shape[0] == placed.tokens.numel():
        native = training.old_logprobs(model, placed, training.ReplayMode.DISABLED, **kwargs)
        return training.OldPass(native.logprobs, kept)
    old = training.old_logprobs(model, placed, mode, **kwargs)
    setattr(model, KEPT, old.recording)
    return old


def training_with(**functions: Any) -> Any:
    """The reference ``training`` capability with ``functions`` replaced."""
    return patched_module(training, **functions)


def _recording_once(fresh: bool) -> Any:
    def old_logprobs(model: MoELM, placed: Placed, mode: Any, **kwargs: Any) -> training.OldPass:
        return old_logprobs_recording_once(model, placed, mode, fresh=fresh, **kwargs)

    return old_logprobs


R2_RECORDING_KEPT_ON_MODEL = training_with(old_logprobs=_recording_once(fresh=True))
"""The correct twin of ``r2-stale-recording``: the kept recording is replaced by every old pass."""

FIFO_CLEARED_BEFORE_EACH_UPDATE = training_with(
    old_logprobs=old_logprobs_leaving_fifo, policy_logprobs=policy_logprobs_clearing_first
)
"""The correct twin of ``forward-only-pass-leaks-fifo``: the update pass clears what the last left."""

MUTANTS = (
    Mutant(
        "forward-only-pass-leaks-fifo",
        "FIFO leak across passes",
        "SkyRL #1908 bug 1: a forward-only log-prob pass run in REPLAY_FORWARD queues recompute targets that "
        "nothing pops; the next training step's recompute pops an older batch's routes (hides unless a "
        "forward-only pass on another batch runs between schedules, with activation recompute)",
        mutate(
            "forward-only-pass-leaks-fifo", training=training_with(old_logprobs=old_logprobs_leaving_fifo)
        ),
        killed_by="test_training.py::test_a_forward_only_pass_leaves_nothing_for_the_next_recompute",
    ),
    Mutant(
        "r2-stale-recording",
        "R2 without a fresh recording",
        "verl #7805: R2 replay in a step whose old pass ran no RECORD forward (bypass mode) reads the "
        "recording of an earlier step (hides in the first step, and whenever routing did not change)",
        mutate("r2-stale-recording", training=training_with(old_logprobs=_recording_once(fresh=False))),
        killed_by="test_training.py::test_r2_replays_each_steps_own_recording",
    ),
)
