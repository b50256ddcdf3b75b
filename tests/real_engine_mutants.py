"""The zoo mutants the real-engine suites (``suites/real_engine.py``) must kill on a real engine, and
the correct twins that must pass the same checks: collected by ``tests/test_vllm_mutants.py`` and
``tests/test_sglang_mutants.py``, each with its engine (the suite module's fixtures).

- ``policy-version-mixing`` (verl #6046: the latest payload replaces the trace) and
  ``duplication-on-resume`` (verl #5430, fixed by #6029: every attempt's payload concatenated,
  although the engine returns the whole sequence's rows on each call) against the splice checks of
  episodes whose weights change between calls; twins: ``splice-into-buffer`` (a correct splice
  written otherwise) and the reference.
- ``hf-one-layer-unreplayed`` (one MoE layer's router never replayed) against the real-engine
  mismatch lab; twins: the reference and the harness's transformers hooks as a subject of their own
  (``harness.subjects.hf_hooks:HF_HOOKS``).

The suite's own test functions are called with each subject, so the kill is the suite's invariant
itself, not a copy of it.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.mutants import benign
from harness.mutants.registry import get
from harness.subjects import Subject
from harness.subjects.hf_hooks import HF_HOOKS
from harness.subjects.reference import REFERENCE
from suites import real_engine as shared

__all__ = [
    "test_a_driver_that_replays_nothing_on_one_layer_is_killed_on_the_real_engine",
    "test_a_splice_concatenating_every_payload_is_killed_on_the_real_engine",
    "test_a_splice_keeping_the_latest_payload_is_killed_on_the_real_engine",
]

SPLICE_CHECKS = [
    pytest.param(
        lambda s, e, c: shared.test_splice_of_real_episodes_keeps_the_first_computed_rows(
            s, e, shared.RESUME_UNDER_NEW_WEIGHTS
        ),
        id="abort-resume-weights-updated",
    ),
    pytest.param(
        lambda s, e, c: shared.test_splice_of_real_episodes_keeps_the_first_computed_rows(
            s, e, shared.TURNS_UNDER_NEW_WEIGHTS
        ),
        id="multi-turn-tool-tokens-weights-updated",
    ),
    pytest.param(
        shared.test_splice_of_n_samples_each_resumed_under_new_weights, id="n-samples-weights-updated"
    ),
]
LAB_CHECKS = (
    shared.test_without_replay_the_trainer_routes_some_engine_rows_differently,
    shared.test_r3_through_the_subjects_driver_dispatches_the_engines_experts,
    shared.test_r3_through_the_subjects_driver_shrinks_the_gap_on_flipped_tokens,
)


@pytest.mark.capability("splice")
@pytest.mark.parametrize("check", SPLICE_CHECKS)
def test_a_splice_keeping_the_latest_payload_is_killed_on_the_real_engine(
    check: Any,
    engine: Any,
    checkpoint: Any,
) -> None:
    """The splice check fails on ``policy-version-mixing`` and passes on its correct twins."""
    mutant = get("policy-version-mixing").subject
    with pytest.raises(AssertionError, match="differ as sets"):
        check(mutant, engine, checkpoint)
    twins: list[Subject] = [REFERENCE, benign.get("splice-into-buffer").subject]
    for twin in twins:
        check(twin, engine, checkpoint)


@pytest.mark.capability("install_hf_replay")
def test_a_driver_that_replays_nothing_on_one_layer_is_killed_on_the_real_engine(
    checkpoint: Any,
    lab_rollouts: Any,
) -> None:
    """The real-engine lab's R3 check fails on ``hf-one-layer-unreplayed``; the correct hooks pass every
    lab check."""
    mutant = get("hf-one-layer-unreplayed").subject
    with pytest.raises(AssertionError, match="differ from the engine's"):
        shared.test_r3_through_the_subjects_driver_dispatches_the_engines_experts(
            mutant, checkpoint, lab_rollouts
        )
    for twin in (REFERENCE, HF_HOOKS):
        for check in LAB_CHECKS:
            check(twin, checkpoint, lab_rollouts)


@pytest.mark.capability("splice")
@pytest.mark.parametrize("check", SPLICE_CHECKS)
def test_a_splice_concatenating_every_payload_is_killed_on_the_real_engine(
    check: Any,
    engine: Any,
    checkpoint: Any,
) -> None:
    """The splice check fails on ``duplication-on-resume`` (each earlier row held twice) and passes on
    the reference."""
    mutant = get("duplication-on-resume").subject
    with pytest.raises(AssertionError, match="rows, expected P"):
        check(mutant, engine, checkpoint)
    check(REFERENCE, engine, checkpoint)
