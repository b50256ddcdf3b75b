"""The mismatch lab (DESIGN §3.10, §6): R3 removes routing disagreement and shrinks the gap."""

from __future__ import annotations

import pytest

from harness.lab.measure import LabResult
from harness.lab.reference import run_mismatch_lab
from harness.subjects import Subject
from harness.testing.suite import require

pytestmark = pytest.mark.capability("install_replay")


def _lab(subject: Subject) -> LabResult:
    """The lab through the subject's driver (run once per driver: ``run_mismatch_lab`` keeps it)."""
    return run_mismatch_lab(install_replay=require(subject, "install_replay"))


def test_without_replay_bf16_decode_and_full_forward_disagree(subject: Subject) -> None:
    """Without replay, bf16 KV-cache decode and a full forward route some (position, layer) differently."""
    result = _lab(subject).without_replay
    assert result.routing.disagreement > 0, "the lab produced no routing flips: it cannot test R3"


def test_r3_makes_routing_disagreement_exactly_zero(subject: Subject) -> None:
    """With R3 the trainer dispatches exactly the rollout's experts at every (position, MoE layer)."""
    routing = _lab(subject).with_r3.routing
    assert routing.disagreement == 0.0, (
        f"R3 left {routing.disagreement:.4f} of (position, layer) routes different from the rollout's "
        f"(per layer: {routing.per_layer.round(4).tolist()})"
    )


def test_r3_shrinks_the_gap_on_flipped_tokens(subject: Subject) -> None:
    """On the tokens whose routing had flipped, R3 makes the mean |Δ log-prob| smaller."""
    lab = _lab(subject)
    before = lab.without_replay.gap_on_flipped.mean_abs_diff
    after = lab.with_r3.gap_on_flipped.mean_abs_diff
    assert lab.flipped_tokens > 0, "no response token had flipped routing: the lab cannot test the gap"
    assert after < before, (
        f"mean |Δ| on {lab.flipped_tokens} flipped tokens: {after:.3e} with R3, {before:.3e} without"
    )
