"""The real-engine suites every engine runs (DESIGN §3.1–3.6, §3.10; FACTS §1, §6): a subject's
splice, placement and replay driver on what a real engine returns.

``suites/test_vllm.py`` and ``suites/test_sglang.py`` each start their engine (the ``engine`` and
``checkpoint`` fixtures) and collect these tests under their own markers; what only one engine has
(its payload's wire form) is tested in that engine's module. Against the engine:

- **splice**: abort/resume with the weights updated between attempts, multi-turn with tool tokens
  (weights updated before each turn), a resume whose every call hits the prefix cache, and ``n > 1``
  samples each resumed under new weights: the subject's ``splice`` of the real payloads has
  ``P + Σa − 1`` rows, each equal (as an expert set) to the row of the first payload that computed
  that position. A weight update loads the checkpoint with every router weight negated into the
  running engine (``harness.engines.weight_updates``, the engine's own weight loading) and the
  prefix cache is reset, so a re-prefilled row really differs: a splice that keeps the latest
  payload (verl #6046, #6054) or concatenates every attempt's payload (verl #5430) fails.
- **layouts**: a batch of real rollouts of different lengths placed by the subject: every token on
  its column in order, every row on its token's column, replay mask exactly on the rows, response
  mask on the response.
- **install_hf_replay**: the real-engine mismatch lab (``harness.lab.engine``): with R3 through
  the subject's driver the trainer's experts, probed by the harness, are exactly the engine's, and the
  mean |Δ log-prob| on flipped tokens shrinks; without replay some routes differ (the check can fail).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from harness.engines.checkpoint import EngineRollout, TinyCheckpoint
from harness.engines.weight_updates import weight_updates
from harness.lab.engine import sample_lab_rollouts, score_engine_rollouts
from harness.lab.measure import LabResult, format_lab
from harness.subjects import Subject
from harness.testing.asserts import assert_same_routes
from harness.testing.judge import as_ids
from harness.testing.suite import require
from reference_impl.episode import AttemptPlan, Episode, Schedule, run_episode

__all__ = [
    "RESUME_UNDER_NEW_WEIGHTS",
    "TURNS_UNDER_NEW_WEIGHTS",
    "check_decoded",
    "lab_rollouts",
    "prompts",
    "test_layouts_place_real_rollouts_with_every_row_on_its_token",
    "test_r3_through_the_subjects_driver_dispatches_the_engines_experts",
    "test_r3_through_the_subjects_driver_shrinks_the_gap_on_flipped_tokens",
    "test_splice_of_a_resume_served_from_the_prefix_cache",
    "test_splice_of_n_samples_each_resumed_under_new_weights",
    "test_splice_of_real_episodes_keeps_the_first_computed_rows",
    "test_without_replay_the_trainer_routes_some_engine_rows_differently",
]


def prompts(checkpoint: TinyCheckpoint, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, checkpoint.vocab_size, (n,), generator=gen).tolist() for n in lengths]


# --------------------------------------------------------------------------------------------------
# splice
# --------------------------------------------------------------------------------------------------


def first_computed(episode: Episode[EngineRollout]) -> torch.Tensor:
    """Row p of the first payload that covers position p, for every fed position (DESIGN §3.4): the
    routing live when token p + 1 was sampled (or, for a tool token, when it was prefilled)."""
    rows = episode.prompt_len + sum(a.new_tokens for a in episode.attempts) - 1
    out = []
    for p in range(rows):
        payload = next(a.routes for a in episode.attempts if a.routes is not None and a.routes.shape[0] > p)
        out.append(torch.as_tensor(payload)[p])
    return torch.stack(out)


def check_splice(subject: Subject, episode: Episode[EngineRollout], what: str) -> None:
    """The subject's splice of ``episode``'s real payloads: ``P + Σa − 1`` rows, each the first-computed."""
    splice = require(subject, "splice")
    expected = first_computed(episode)
    got = as_ids(splice(episode.prompt_len, episode.attempts), f"{what}: spliced trace")
    assert got.shape[0] == expected.shape[0], (
        f"{what}: the subject's splice has {got.shape[0]} rows, expected P + Σa − 1 = {expected.shape[0]} "
        f"(prompt {episode.prompt_len}, attempts adding {[a.new_tokens for a in episode.attempts]})"
    )
    assert_same_routes(
        got,
        expected,
        names=("the subject's splice", "the first-computed routing"),
        what=what,
        axes=("position", "layer slot"),
    )


RESUME_UNDER_NEW_WEIGHTS = Schedule(
    tuple(range(3, 16)),
    (
        AttemptPlan(3, finish_reason="abort"),
        AttemptPlan(4, update_weights=True, finish_reason="abort"),
        AttemptPlan(5, update_weights=True, finish_reason="length"),
    ),
)
"""A partial rollout aborted twice, each resume under new weights (fully-async RL)."""
TURNS_UNDER_NEW_WEIGHTS = Schedule(
    tuple(range(40, 48)),
    (
        AttemptPlan(4),
        AttemptPlan(6, tool_tokens=(101, 102, 103, 104, 105), update_weights=True),
        AttemptPlan(3, tool_tokens=(201, 202, 203, 204, 205, 206, 207), update_weights=True),
    ),
)
"""Three turns, tool tokens before each later one, the weights updated before each."""


@pytest.mark.capability("splice")
@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param(RESUME_UNDER_NEW_WEIGHTS, id="abort-resume-weights-updated"),
        pytest.param(TURNS_UNDER_NEW_WEIGHTS, id="multi-turn-tool-tokens-weights-updated"),
    ],
)
def test_splice_of_real_episodes_keeps_the_first_computed_rows(
    subject: Subject, engine: Any, schedule: Schedule
) -> None:
    """Real aborts, resumes and turns, the weights changed between calls: the subject's splice keeps
    each position's row from the call that first computed it."""
    with weight_updates(engine) as update:
        episode = run_episode(engine.generate_one, schedule, update_weights=update)
    check_splice(subject, episode, schedule.describe())


@pytest.mark.capability("splice")
def test_splice_of_a_resume_served_from_the_prefix_cache(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint
) -> None:
    """A 70-token prompt served once, then aborted and resumed: every call hits the prefix cache and
    its payload still yields the first-computed rows through the subject's splice."""
    (prompt,) = prompts(checkpoint, (70,), seed=21)
    engine.generate([prompt], 1)  # warm the cache
    schedule = Schedule(tuple(prompt), (AttemptPlan(3, finish_reason="abort"), AttemptPlan(4)))
    episode = run_episode(engine.generate_one, schedule)
    cached = [call.cached_tokens for call in episode.calls]
    assert all(c for c in cached), f"cached tokens per call {cached}: expected a prefix-cache hit on each"
    check_splice(subject, episode, f"{schedule.describe()}, cached tokens {cached}")


def _first_call_is(first: EngineRollout, engine: Any) -> Callable[[tuple[int, ...], int], EngineRollout]:
    """An engine call that answers its first call with ``first`` (a sample of an ``n > 1`` request
    already made) and every later one with ``engine``."""
    calls = iter([first])

    def generate(context: tuple[int, ...], budget: int) -> EngineRollout:
        return next(calls, None) or engine.generate_one(context, budget)

    return generate


@pytest.mark.capability("splice")
def test_splice_of_n_samples_each_resumed_under_new_weights(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint
) -> None:
    """``n = 3`` samples of one prompt (one request), each aborted and resumed under new weights: each
    sample's splice keeps its own first-computed rows, the prompt rows those of the shared request."""
    (prompt,) = prompts(checkpoint, (11,), seed=22)
    (samples,) = engine.sample([prompt], 4, n=3, temperature=1.0)
    schedule = Schedule(
        tuple(prompt), (AttemptPlan(4, finish_reason="abort"), AttemptPlan(3, update_weights=True))
    )
    for j, first in enumerate(samples):
        with weight_updates(engine) as update:
            episode = run_episode(_first_call_is(first, engine), schedule, update_weights=update)
        check_splice(subject, episode, f"sample {j + 1} of n = 3: {schedule.describe()}")


# --------------------------------------------------------------------------------------------------
# decode_payload: what each engine module's payload tests share
# --------------------------------------------------------------------------------------------------


def check_decoded(
    trace: Any, rows: np.ndarray, engine: Any, prompt_len: int, response_len: int, start: int, what: str
) -> None:
    """The subject's decoded trace covers ``[start, P + R − 1)`` and holds the payload's own rows."""
    spec = engine.checkpoint.spec
    trace.check_coverage(prompt_len, response_len)
    assert trace.start == start, f"{what}: decoded trace starts at {trace.start}, expected {start}"
    decoded = trace.to_decoder_axis().experts[:, list(spec.moe_layer_tuple)]
    assert_same_routes(
        decoded, rows, names=("decoded", "the payload's rows"), what=what, axes=("row", "MoE ordinal")
    )


# --------------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------------


@pytest.mark.capability("layouts")
def test_layouts_place_real_rollouts_with_every_row_on_its_token(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint
) -> None:
    """Real rollouts of prompts 5, 17, 9 and responses 7, 3, 12 tokens, placed by the subject in a
    batch two columns wider than the longest prompt plus the longest response: each sample's tokens
    in order on its attended columns, each engine row on its token's column, the replay mask exactly
    on the rows, the response mask on the response."""
    layouts = require(subject, "layouts")
    shapes = ((5, 7), (17, 3), (9, 12))
    rollouts = [
        engine.generate(prompts(checkpoint, (p,), seed=25 + i), r)[0] for i, (p, r) in enumerate(shapes)
    ]
    samples = [(torch.tensor(r.sequence), r.routes) for r in rollouts]
    # room for prompts and responses padded apart (a trainer may pad them so), and two columns more
    width = max(p for p, _ in shapes) + max(r for _, r in shapes) + 2
    prompt_lens = tuple(p for p, _ in shapes)
    placed = layouts.place_left_padded([(t.clone(), x.clone()) for t, x in samples], width, prompt_lens)
    where = f"real rollouts of (prompt, response) {list(shapes)} in width {width}"
    for i, (tokens, routes) in enumerate(samples):
        columns = torch.as_tensor(placed.attention_mask[i]).bool().nonzero().squeeze(1).tolist()
        assert len(columns) == tokens.shape[0], (
            f"{where}: sample {i} has {tokens.shape[0]} tokens but {len(columns)} attended columns"
        )
        assert torch.equal(as_ids(placed.tokens[i, columns]), tokens), (
            f"{where}: sample {i}'s tokens are not, in order, at its attended columns {columns}"
        )
        assert_same_routes(
            as_ids(placed.routes[i, columns[:-1]]),
            routes,
            names=("placed", "the engine's"),
            what=f"{where}, sample {i}",
            axes=("token position", "layer slot"),
        )
        what = f"{where}: sample {i}'s"
        check_mask(placed.replay_mask[i], columns[:-1], f"{what} replay mask", "its rows' columns")
        check_mask(
            placed.response_mask[i], columns[prompt_lens[i] :], f"{what} response mask", "its response"
        )


def check_mask(mask: Any, columns: list[int], what: str, meaning: str) -> None:
    """``mask`` (one row of a placed batch) is True at exactly ``columns``."""
    got = torch.as_tensor(mask).bool().nonzero().squeeze(1).tolist()
    assert got == columns, f"{what} is True at {got}, expected exactly {meaning} {columns}"


# --------------------------------------------------------------------------------------------------
# install_hf_replay: the real-engine mismatch lab through the subject's driver
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def lab_rollouts(engine: Any, checkpoint: TinyCheckpoint) -> list[EngineRollout]:
    return sample_lab_rollouts(engine, checkpoint)


_LABS: dict[tuple[int, int], LabResult] = {}
"""By (driver, rollouts) identity: capability objects need not be hashable, and a session (an
in-process run of its own) has rollouts of its own."""


def _lab(subject: Subject, checkpoint: TinyCheckpoint, rollouts: list[EngineRollout]) -> LabResult:
    driver = require(subject, "install_hf_replay")
    key = (id(driver), id(rollouts))
    if key not in _LABS:
        _LABS[key] = score_engine_rollouts(checkpoint, rollouts, driver)
        print(format_lab(_LABS[key]))
    return _LABS[key]


@pytest.mark.capability("install_hf_replay")
def test_without_replay_the_trainer_routes_some_engine_rows_differently(
    subject: Subject, checkpoint: TinyCheckpoint, lab_rollouts: list[EngineRollout]
) -> None:
    """Without replay the trainer's full forward routes some (position, MoE layer) unlike the engine:
    the lab can tell a driver that replays from one that does not."""
    routing = _lab(subject, checkpoint, lab_rollouts).without_replay.routing
    assert routing.disagreement > 0, "engine and trainer agree on every route: the lab cannot test R3"


@pytest.mark.capability("install_hf_replay")
def test_r3_through_the_subjects_driver_dispatches_the_engines_experts(
    subject: Subject, checkpoint: TinyCheckpoint, lab_rollouts: list[EngineRollout]
) -> None:
    """With the engine's routes handed to the subject's controller, the experts the harness's probe
    sees are the engine's at every (position, MoE layer)."""
    routing = _lab(subject, checkpoint, lab_rollouts).with_r3.routing
    assert routing.disagreement == 0.0, (
        f"under R3 through the subject's driver {routing.disagreement:.2%} of (position, MoE layer) routes "
        f"differ from the engine's (per MoE layer: {np.round(routing.per_layer, 4).tolist()})"
    )


@pytest.mark.capability("install_hf_replay")
def test_r3_through_the_subjects_driver_shrinks_the_gap_on_flipped_tokens(
    subject: Subject, checkpoint: TinyCheckpoint, lab_rollouts: list[EngineRollout]
) -> None:
    """On the response tokens whose routing had flipped, R3 makes the mean |Δ log-prob| smaller."""
    lab = _lab(subject, checkpoint, lab_rollouts)
    before, after = lab.without_replay.gap_on_flipped.mean_abs_diff, lab.with_r3.gap_on_flipped.mean_abs_diff
    assert lab.flipped_tokens > 0, "no response token had flipped routing: the lab cannot test the gap"
    assert after < before, (
        f"mean |Δ log-prob| on {lab.flipped_tokens} flipped tokens: {after:.3e} with R3 through the "
        f"subject's driver, {before:.3e} without"
    )
