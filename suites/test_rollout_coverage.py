"""Splice coverage through the real reference engine (DESIGN §3.1, §3.4): partial rollouts and turns.

Besides the tiny model (8 experts, top-2) the engine runs low-entropy routers on purpose: two experts
top-1 (long runs of equal rows) and two experts top-2 (every row the same set), so equal rows meet at
resumes and turn boundaries, where a splice that takes an equal row for a duplicate loses it.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import assume, example, given, note, settings
from hypothesis import strategies as st

from harness.strategies import attempt_schedules
from harness.subjects import Subject
from harness.testing.asserts import assert_same_routes
from harness.testing.judge import as_ids
from harness.testing.suite import require
from reference_impl import MoEConfig, MoELM, RolloutEngine, Schedule, run_episode
from reference_impl.episode import AttemptPlan

pytestmark = pytest.mark.capability("splice")


ROUTERS = ((8, 2), (2, 1), (2, 2))
"""``(num_experts, top_k)`` of the engine's model: the tiny model's, and two whose rows repeat."""

RESUMED_TWICE = Schedule(
    (1, 2, 3),
    (
        AttemptPlan(3, (), False, "abort"),
        AttemptPlan(2, (), True, "abort"),
        AttemptPlan(2, (), False, "stop"),
    ),
)
"""Two resumes, one under new weights: with a low-entropy router equal rows meet at both seams."""
TWO_TURNS = Schedule((1, 2), (AttemptPlan(2, (), False, "stop"), AttemptPlan(2, (5, 6), True, "stop")))
"""A second turn after two tool tokens, under new weights."""


@functools.cache
def _model(experts: int = 8, top_k: int = 2) -> MoELM:
    return MoELM(MoEConfig.tiny(seed=11, num_experts=experts, top_k=top_k))


def _perturb(model: MoELM, version: int) -> None:
    """A deterministic weight update of the routers (the fully-async case)."""
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for router in model.routers():
            router.gate.weight.add_(0.3 * torch.randn(router.gate.weight.shape, generator=gen))


def _first_computed(attempts, rows: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Row p is taken from the first attempt whose payload covers p: the routing live when sampled."""
    out = []
    for p in range(rows):
        payload = next(a.routes for a in attempts if a.routes is not None and a.routes.shape[0] > p)
        out.append(payload[p])
    return torch.stack(out) if out else torch.zeros(0)


@settings(max_examples=30)
@given(
    schedule=attempt_schedules(max_attempts=4, max_prompt=8, max_tokens=4),
    router=st.sampled_from(ROUTERS),
)
@example(schedule=RESUMED_TWICE, router=(2, 2))
@example(schedule=TWO_TURNS, router=(2, 1))
def test_engine_episodes_splice_to_first_computed_rows(
    subject: Subject, schedule: Schedule, router: tuple[int, int]
) -> None:
    """After real aborts, resumes, turns and weight updates the splice keeps P + Σa − 1 routed rows, each
    at its own position, also where a low-entropy router makes rows repeat across the seams."""
    note(f"counterexample: {schedule.describe()}")
    note(f"counterexample: {router[0]} experts, top-{router[1]}")
    splice = require(subject, "splice")
    model = copy.deepcopy(_model(*router))
    engine = RolloutEngine(model)
    episode = run_episode(engine.generate_one, schedule, update_weights=lambda v: _perturb(model, v))
    # Tool tokens of a call with no generation budget never reach the engine (no forward ran).
    assume(any(a.routes is not None for a in episode.attempts))
    expected_rows = episode.prompt_len + sum(a.new_tokens for a in episode.attempts) - 1
    got = as_ids(splice(episode.prompt_len, episode.attempts), f"{schedule.describe()}: spliced trace")
    assert got.shape[0] == expected_rows, (
        f"{schedule.describe()}: spliced trace has {got.shape[0]} rows, expected {expected_rows}"
    )
    if expected_rows:
        assert_same_routes(
            got,
            _first_computed(episode.attempts, expected_rows),
            names=("spliced", "live when sampled"),
            what=schedule.describe(),
            axes=("row", "MoE ordinal"),
        )
