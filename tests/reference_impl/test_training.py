"""The trainer side of R2/R3: exact on-policy KL, replay effect and mask, config errors, clean state."""

from __future__ import annotations

import pytest
import torch

from reference_impl import MoEConfig, MoELM, ReplayError, ReplayTargets, RoutingMode
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
    ppo_loss,
    reference_logprobs,
    replay_targets,
    token_logprobs,
)

SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=3,
    num_heads=2,
    num_experts=8,
    top_k=2,
    expert_hidden=16,
    n_group=4,
    topk_group=2,
)
LENGTHS = (6, 9, 4)  # three samples of different lengths, left-padded to WIDTH
WIDTH = 9


def _model(**kw) -> MoELM:
    return MoELM(MoEConfig(**{**SMALL, **kw}))


def _samples(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, SMALL["vocab_size"], (n,), generator=gen) for n in LENGTHS]


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


def _real_rows(placed: Placed) -> torch.Tensor:
    return placed.attention_mask.reshape(-1)


# --- replay targets and mask ------------------------------------------------------------------


def test_replay_mask_replays_prompt_rows_and_skips_last_token_and_padding():
    model = _model(first_k_dense=1)
    placed = _r3_batch(model)
    targets, mask = replay_targets(placed, model.cfg.moe_layers, "decoder")
    assert targets.shape == (len(LENGTHS) * WIDTH, 2, 2) and mask.shape == (len(LENGTHS) * WIDTH,)
    mask = mask.view(len(LENGTHS), WIDTH)
    for row, length in enumerate(LENGTHS):
        start = WIDTH - length
        assert not mask[row, :start].any()  # padding
        assert mask[row, start : WIDTH - 1].all()  # every existing row, the prompt's included
        assert not mask[row, WIDTH - 1]  # the last token has no row


def test_decoder_and_moe_ordinal_axes_give_the_same_targets():
    model = _model(first_k_dense=1)
    placed = _r3_batch(model)
    ordinal = Placed(
        placed.tokens,
        placed.attention_mask,
        placed.routes[:, :, list(model.cfg.moe_layers)],
        placed.replay_mask,
    )
    decoder_targets, decoder_mask = replay_targets(placed, model.cfg.moe_layers, "decoder")
    ordinal_targets, ordinal_mask = replay_targets(ordinal, model.cfg.moe_layers, "moe_ordinal")
    assert torch.equal(decoder_targets, ordinal_targets)
    assert torch.equal(decoder_mask, ordinal_mask)
    # row b*W + t of the targets is column t of sample b, MoE layer j is decoder slot moe_layers[j]
    assert torch.equal(decoder_targets.view(len(LENGTHS), WIDTH, 2, 2)[1, 4, 0], placed.routes[1, 4, 1])


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


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_r2_first_on_policy_minibatch_has_exactly_zero_kl(use_checkpoint):
    model = _model(first_k_dense=1)
    placed = place_without_routes(_samples(), WIDTH)
    mask = logprob_mask(placed.attention_mask)
    old = old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    assert old.recording is not None and old.recording.shape == (len(LENGTHS) * WIDTH, 2, 2)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    advantages = torch.randn(placed.tokens.shape, generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # a step of size 0 leaves the next mini-batch on-policy too
        new = policy_logprobs(
            model,
            placed,
            ReplayMode.R2,
            old=old,
            moe_layers=model.cfg.moe_layers,
            use_checkpoint=use_checkpoint,
        )
        assert torch.equal(new, old.logprobs)
        assert ppo_kl(new, old.logprobs, mask).item() == 0.0
        optimizer.zero_grad()
        backward(ppo_loss(new, old.logprobs, advantages, mask), model)
        assert all(router.gate.weight.grad.abs().sum() > 0 for router in model.routers())
        optimizer.step()
        assert _is_clean(model)


def _perturb_gates(model: MoELM, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in model.routers():
            router.gate.weight.add_(scale * torch.randn(router.gate.weight.shape, generator=gen))


def test_r2_replay_keeps_the_recorded_routes_when_router_weights_move():
    model = _model()
    placed = place_without_routes(_samples(), WIDTH)
    old = old_logprobs(model, placed, ReplayMode.R2, moe_layers=model.cfg.moe_layers)
    assert old.recording is not None
    _perturb_gates(model, 0.05, seed=7)  # a small update between the old and the update pass
    real = _real_rows(placed)

    native = policy_logprobs(model, placed, ReplayMode.DISABLED, old=old, moe_layers=model.cfg.moe_layers)
    flipped = [not torch.equal(d[real], old.recording[real, j]) for j, d in enumerate(model.last_dispatch)]
    assert any(flipped)  # natively some real token now routes differently...

    replayed = policy_logprobs(model, placed, ReplayMode.R2, old=old, moe_layers=model.cfg.moe_layers)
    for j, dispatched in enumerate(model.last_dispatch):  # ...under R2 every one keeps its route
        assert torch.equal(dispatched[real], old.recording[real, j])
    mask = logprob_mask(placed.attention_mask)
    assert ppo_kl(native, old.logprobs, mask) != 0 and ppo_kl(replayed, old.logprobs, mask) != 0


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


def _capture_routing(model: MoELM) -> tuple[list, list]:
    """Forward hooks collecting (ids, logits) of every router call; returns (calls, handles)."""
    calls: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in model.routers()]
    handles = [
        router.register_forward_hook(
            lambda _module, _args, out, j=j: calls[j].append((out[0].detach(), out[2].detach()))
        )
        for j, router in enumerate(model.routers())
    ]
    return calls, handles


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_r3_dispatches_rollout_routes_and_routes_masked_rows_natively(use_checkpoint):
    model = _model(first_k_dense=1)
    placed = _r3_batch(model)
    targets, mask = replay_targets(placed, model.cfg.moe_layers, "decoder")
    with torch.no_grad():
        natural = token_logprobs(model, placed.tokens, placed.attention_mask)
    assert any(not torch.equal(d[mask], targets[mask, j]) for j, d in enumerate(model.last_dispatch))

    calls, handles = _capture_routing(model)
    old = old_logprobs(model, placed, ReplayMode.R3, moe_layers=model.cfg.moe_layers)
    for handle in handles:
        handle.remove()
    for j, router in enumerate(model.routers()):
        ((ids, logits),) = calls[j]
        assert torch.equal(ids[mask], targets[mask, j])  # rollout routes, exactly
        assert torch.equal(ids[~mask], router.family.select(logits[~mask]))  # natively, no filler
        assert torch.equal(model.last_dispatch[j], ids)
    assert not torch.equal(old.logprobs, natural)
    assert old.recording is None and _is_clean(model)

    new = policy_logprobs(
        model, placed, ReplayMode.R3, old=old, moe_layers=model.cfg.moe_layers, use_checkpoint=use_checkpoint
    )
    valid = logprob_mask(placed.attention_mask)
    assert torch.equal(new, old.logprobs)  # same replay in both passes: on-policy KL is 0 exactly
    assert ppo_kl(new, old.logprobs, valid).item() == 0.0
    for j, dispatched in enumerate(model.last_dispatch):
        assert torch.equal(dispatched[mask], targets[mask, j])
    backward(-(new * valid).sum(), model)
    for router in model.routers():
        assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    assert _is_clean(model)


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


def test_reference_pass_never_replays():
    model = _model()
    placed = _r3_batch(model)
    with torch.no_grad():
        natural = token_logprobs(model, placed.tokens, placed.attention_mask)
    absurd = ReplayTargets(torch.full((1, 2), 999), None)  # wrong row count, ids out of range
    for router in model.routers():
        router.replay.targets = absurd
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    with pytest.raises(ReplayError), torch.no_grad():  # replaying these would fail loudly
        token_logprobs(model, placed.tokens, placed.attention_mask)

    assert torch.equal(reference_logprobs(model, placed), natural)
    for router in model.routers():  # state neither read nor changed
        assert router.replay.mode is RoutingMode.REPLAY_FORWARD and router.replay.targets is absurd
        assert not router.replay.backward_targets


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
