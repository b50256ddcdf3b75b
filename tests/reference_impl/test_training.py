"""The trainer side of R2/R3 by hand: the replay mask, log-prob columns, the correction-bias case,
configuration error texts, and the replay state each pass leaves.

The pass properties (R2/R3 dispatch, first mini-batch KL 0, π_ref never replays, both layer axes)
are checked through the subject in ``suites/test_training.py`` and ``suites/test_r2.py``.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl import MoEConfig, MoELM, ReplayError, RoutingMode
from reference_impl.layouts import Placed, place_left_padded
from reference_impl.training import (
    OldPass,
    ReplayMode,
    TrainerConfigError,
    backward,
    logprob_mask,
    old_logprobs,
    place_without_routes,
    policy_logprobs,
    ppo_kl,
    replay_targets,
    token_logprobs,
)

LENGTHS = (6, 9, 4)  # three samples of different lengths, left-padded to WIDTH
WIDTH = 9


def _model(**kw) -> MoELM:
    return MoELM(MoEConfig.tiny(**kw))


def _samples(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, MoEConfig.tiny().vocab_size, (n,), generator=gen) for n in LENGTHS]


def _random_routes(model: MoELM, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Valid decoder-axis routes [rows, num_layers, k]: distinct random ids, dense slots 0."""
    cfg = model.cfg
    routes = torch.zeros(rows, cfg.num_layers, cfg.top_k, dtype=torch.int64)
    scores = torch.rand(rows, len(cfg.moe_layers), cfg.num_experts, generator=gen)
    routes[:, list(cfg.moe_layers)] = scores.argsort(dim=-1)[..., : cfg.top_k]
    return routes


def _r3_batch(model: MoELM, seed: int = 0) -> Placed:
    gen = torch.Generator().manual_seed(seed + 1)
    samples = [(tokens, _random_routes(model, tokens.shape[0] - 1, gen)) for tokens in _samples(seed)]
    return place_left_padded(samples, WIDTH)


def _is_clean(model: MoELM) -> bool:
    return all(
        router.replay.mode is RoutingMode.NATIVE
        and router.replay.targets is None
        and not router.replay.backward_targets
        and not router.replay.recorded
        for router in model.routers()
    )


# --- replay targets and mask ------------------------------------------------------------------


def test_replay_mask_replays_prompt_rows_and_skips_last_token_and_padding():
    model = _model()
    placed = _r3_batch(model)
    targets, mask = replay_targets(placed, model.cfg.moe_layers, "decoder")
    assert targets.shape == (len(LENGTHS) * WIDTH, 2, 2) and mask.shape == (len(LENGTHS) * WIDTH,)
    mask = mask.view(len(LENGTHS), WIDTH)
    for row, length in enumerate(LENGTHS):
        start = WIDTH - length
        assert not mask[row, :start].any()  # padding
        assert mask[row, start : WIDTH - 1].all()  # every existing row, the prompt's included
        assert not mask[row, WIDTH - 1]  # the last token has no row


def test_token_logprobs_are_zero_where_nothing_predicts_the_token():
    model = _model()
    placed = place_without_routes(_samples(), WIDTH)
    with torch.no_grad():
        logprobs = token_logprobs(model, placed.tokens, placed.attention_mask)
    valid = logprob_mask(placed.attention_mask)
    assert logprobs.dtype == torch.float32
    assert (logprobs[~valid] == 0).all() and (logprobs[valid] < 0).all()
    assert valid.sum(dim=1).tolist() == [n - 1 for n in LENGTHS]


# --- R2 -----------------------------------------------------------------------------------------


def test_r2_kl_stays_exactly_zero_when_only_the_choice_bias_moves():
    """DeepSeek's correction bias changes which experts are chosen but not their weights: with R2
    π_θ is still π_old bit for bit, natively it is not. The routes are what replay fixes.

    No padding here: R2 routes padding natively, and a padding row that changes experts changes
    the shapes of the expert matmuls, which moves real tokens' outputs by an ulp (~5e-7).
    """
    model = _model(router_family="sigmoid_grouped")
    gen = torch.Generator().manual_seed(0)
    placed = place_without_routes([torch.randint(1, 64, (WIDTH,), generator=gen) for _ in range(3)], WIDTH)
    mask = logprob_mask(placed.attention_mask)
    old = old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    with torch.no_grad():
        for router in model.routers():
            router.family.e_score_correction_bias.add_(
                0.3 * torch.randn(8, generator=torch.Generator().manual_seed(router.layer))
            )
    native = policy_logprobs(model, placed, "disabled", old=old, moe_layers=model.cfg.moe_layers)
    replayed = policy_logprobs(model, placed, "R2", old=old, moe_layers=model.cfg.moe_layers)
    assert ppo_kl(native, old.logprobs, mask) != 0
    assert torch.equal(replayed, old.logprobs)


# --- R3 -----------------------------------------------------------------------------------------


# --- configuration errors and the reference pass ---------------------------------------------


def test_r2_with_rollout_routes_is_a_configuration_error():
    model = _model()
    placed = _r3_batch(model)
    with pytest.raises(TrainerConfigError, match="R2"):
        old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    fake_old = OldPass(torch.zeros(placed.tokens.shape), torch.zeros(27, 3, 2, dtype=torch.int64))
    with pytest.raises(TrainerConfigError, match="R2"):
        policy_logprobs(model, placed, ReplayMode.R2, old=fake_old, moe_layers=model.cfg.moe_layers)
    assert _is_clean(model)


def test_r3_without_rollout_routes_is_a_configuration_error():
    model = _model()
    placed = place_without_routes(_samples(), WIDTH)
    with pytest.raises(TrainerConfigError, match="R3"):
        old_logprobs(model, placed, ReplayMode.R3, moe_layers=model.cfg.moe_layers)
    old = old_logprobs(model, placed, ReplayMode.DISABLED, moe_layers=model.cfg.moe_layers)
    with pytest.raises(TrainerConfigError, match="R3"):
        policy_logprobs(model, placed, ReplayMode.R3, old=old, moe_layers=model.cfg.moe_layers)
    with pytest.raises(TrainerConfigError, match="recording"):  # an R2 update needs an R2 old pass
        policy_logprobs(model, placed, ReplayMode.R2, old=old, moe_layers=model.cfg.moe_layers)
    with pytest.raises(TrainerConfigError, match="R4"):
        old_logprobs(model, placed, "R4", moe_layers=model.cfg.moe_layers)


# --- replay state after each pass --------------------------------------------------------------


def test_checkpointed_update_holds_one_fifo_entry_until_backward():
    model = _model()
    placed = place_without_routes(_samples(), WIDTH)
    old = old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    assert _is_clean(model)
    new = policy_logprobs(
        model, placed, ReplayMode.R2, old=old, moe_layers=model.cfg.moe_layers, use_checkpoint=True
    )
    for router in model.routers():
        assert router.replay.mode is RoutingMode.REPLAY_BACKWARD and router.replay.targets is None
        assert len(router.replay.backward_targets) == 1
    backward(new.sum(), model)
    assert _is_clean(model)


def test_an_undrained_fifo_is_an_error_and_is_cleared():
    model = _model()
    placed = place_without_routes(_samples(), WIDTH)
    old = old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    first = policy_logprobs(
        model, placed, ReplayMode.R2, old=old, moe_layers=model.cfg.moe_layers, use_checkpoint=True
    )
    policy_logprobs(
        model, placed, ReplayMode.R2, old=old, moe_layers=model.cfg.moe_layers, use_checkpoint=True
    )  # a second forward before the first backward
    with pytest.raises(ReplayError, match="FIFO"):
        backward(first.sum(), model)
    assert _is_clean(model)


def test_a_pass_that_fails_leaves_no_replay_state():
    model = _model()
    placed = _r3_batch(model)
    broken = Placed(
        placed.tokens, placed.attention_mask, torch.zeros_like(placed.routes), placed.replay_mask
    )  # an all-zero capture: repeated expert 0
    with pytest.raises(ReplayError, match="repeats an expert"):
        old_logprobs(model, broken, ReplayMode.R3, moe_layers=model.cfg.moe_layers)
    assert _is_clean(model)
    old = old_logprobs(model, placed, ReplayMode.R3, moe_layers=model.cfg.moe_layers)
    with pytest.raises(ReplayError, match="repeats an expert"):
        policy_logprobs(model, broken, ReplayMode.R3, old=old, moe_layers=model.cfg.moe_layers)
    assert _is_clean(model)
