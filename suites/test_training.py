"""Trainer configuration (DESIGN §3.9): R2 and rollout routes exclude each other; π_ref never replays."""

from __future__ import annotations

import pytest
import torch

from harness.subjects import Subject
from reference_impl import MoEConfig, MoELM, RoutingMode
from reference_impl.layouts import place_left_padded
from suites.conftest import require

CFG = MoEConfig(vocab_size=64, hidden_size=32, num_layers=3, first_k_dense=1, num_experts=8, seed=5)


def _batch(model: MoELM):  # type: ignore[no-untyped-def]
    """Two left-padded samples with rollout routes recorded from the model itself."""
    samples = []
    for n in (7, 5):
        tokens = torch.arange(1, n + 1)
        model.set_routing_mode(RoutingMode.RECORD)
        with torch.no_grad():
            model(tokens[None, :-1])
        routes = torch.zeros(n - 1, CFG.num_layers, CFG.top_k, dtype=torch.long)
        routes[:, list(CFG.moe_layers)] = model.pop_recording()
        samples.append((tokens, routes))
    model.set_routing_mode(RoutingMode.NATIVE)
    return place_left_padded(samples, 8)


def test_r2_with_rollout_routes_is_a_configuration_error(subject: Subject) -> None:
    """R2 replays the trainer's own recording: rollout routes next to it are a configuration error."""
    training = require(subject, "training")
    placed = _batch(MoELM(CFG))
    with pytest.raises(ValueError, match="R2"):
        training.check_mode("R2", placed)


def test_r3_without_rollout_routes_is_a_configuration_error(subject: Subject) -> None:
    """R3 with no rollout routes would route natively in silence: it is a configuration error."""
    training = require(subject, "training")
    placed = training.place_without_routes([torch.arange(1, 6)], 6)
    with pytest.raises(ValueError, match="R3"):
        training.check_mode("R3", placed)


def test_reference_logprobs_never_replay(subject: Subject) -> None:
    """The KL reference pass routes natively even while the model is armed with replay targets."""
    training = require(subject, "training")
    model = MoELM(CFG)
    placed = _batch(model)
    with torch.no_grad():
        native = training.token_logprobs(model, placed.tokens, placed.attention_mask)
    tokens = placed.tokens.numel()
    everyone_to_first = torch.arange(CFG.top_k).expand(tokens, len(CFG.moe_layers), CFG.top_k)
    model.set_replay_targets(everyone_to_first)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    reference = training.reference_logprobs(model, placed)
    model.clear_replay()
    model.set_routing_mode(RoutingMode.NATIVE)
    assert torch.equal(reference, native), (
        f"reference log-probs moved by {(reference - native).abs().max().item():.3e}: the pass replayed"
    )


def test_r3_replays_prompt_rows_too(subject: Subject) -> None:
    """The R3 replay mask covers every row that exists, prompt rows included (not only the response)."""
    training = require(subject, "training")
    model = MoELM(CFG)
    unlabelled = _batch(model)
    samples = list(zip(unlabelled.tokens.unbind(), unlabelled.routes.unbind(), strict=True))
    lengths = unlabelled.attention_mask.sum(1).tolist()
    trimmed = [(t[-n:], r[-n:-1]) for (t, r), n in zip(samples, lengths, strict=True)]
    placed = place_left_padded(trimmed, unlabelled.tokens.shape[1], prompt_lens=[3, 2])
    _, mask = training.replay_targets(placed, CFG.moe_layers, "decoder")
    missing = placed.replay_mask.reshape(-1) & ~mask
    assert not missing.any(), (
        f"{int(missing.sum())} rows that exist are not replayed, e.g. flat row {int(missing.nonzero()[0])} "
        "(prompt rows shape the response log-probs through attention: verl #6325)"
    )
