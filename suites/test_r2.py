"""R2 (DESIGN §3.9): the trainer records in the old-log-prob pass and replays in the update."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from harness.probes.reference import attach
from harness.subjects import Subject
from harness.subjects.replay import install, prepare
from harness.testing.asserts import assert_close_logprobs, assert_same_routes, differing_routes
from harness.testing.suite import require
from reference_impl import MoEConfig, MoELM, training

pytestmark = pytest.mark.capability("install_replay")


CFG = MoEConfig.tiny(seed=3)


def _model(subject: Subject) -> MoELM:
    """A model built after the subject's driver patched (its routers may need the patched constructor)."""
    prepare(require(subject, "install_replay"))
    return MoELM(CFG)


def _batch(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and attention mask for samples of ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, width - n :] = torch.randint(1, 64, (n,), generator=gen)
        mask[i, width - n :] = 1
    return tokens, mask


@settings(max_examples=20)
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(2, 12), min_size=1, max_size=4))
def test_first_on_policy_update_has_zero_kl(subject: Subject, seed: int, lengths: list[int]) -> None:
    """The first on-policy update mini-batch reproduces the old log-probs exactly: ppo_kl == 0 (fp32)."""
    note(f"counterexample: seed={seed}, lengths={lengths}")
    model = _model(subject)
    handle = install(require(subject, "install_replay"), model)
    tokens, mask = _batch(seed, lengths)
    with torch.no_grad():
        handle.record()
        old = training.token_logprobs(model, tokens, mask)
        recording = handle.recording()
    handle.replay(recording, mask.flatten().bool())
    new = training.token_logprobs(model, tokens, mask)
    handle.disarm()
    valid = training.logprob_mask(mask)
    kl = training.ppo_kl(new, old, valid)
    assert_close_logprobs(new, old, names=("π_θ (R2 replay)", "π_old (recorded)"), mask=valid)
    assert kl.item() == 0.0, f"ppo_kl = {kl.item():.3e}, expected 0"


def test_r2_replay_holds_routes_after_a_weight_update(subject: Subject) -> None:
    """After the router weights move, R2 still dispatches the recorded experts (native routing would not)."""
    model = _model(subject)
    handle = install(require(subject, "install_replay"), model)
    probe = attach(model)  # the harness observes the dispatch; the subject's word is not taken
    tokens, mask = _batch(0, [12, 12, 12, 12])
    with torch.no_grad():
        handle.record()
        model(tokens, attention_mask=mask)
        recording = handle.recording()
        gen = torch.Generator().manual_seed(1)
        for router in model.routers():
            router.gate.weight.add_(0.5 * torch.randn(router.gate.weight.shape, generator=gen))
        model(tokens, attention_mask=mask)
        native = probe.last().ids
        handle.replay(recording)
        model(tokens, attention_mask=mask)
        replayed = probe.last().ids
    handle.disarm()
    assert bool(differing_routes(native, recording).any()), (
        f"the weight update flipped none of the {recording.shape[0] * recording.shape[1]} routes: no test"
    )
    assert_same_routes(
        replayed,
        recording,
        names=("dispatched under R2 replay", "the recording"),
        what="after a weight update",
        axes=("token", "MoE ordinal"),
    )
