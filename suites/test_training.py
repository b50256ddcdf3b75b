"""Trainer passes (DESIGN §3.6, §3.7, §3.9), every one driven through the subject's ``training``.

What the routers did is observed on the model (``last_dispatch``: the ids the experts received),
never taken from the subject. The rollout routes of every batch here come from a *perturbed* copy
of the model, so they differ from the model's native routing: on the model's own recording,
replaying and not replaying would be indistinguishable. Bug classes (FACTS §4): R2/R3 config
(R2 next to rollout routes, π_ref replayed), prompt rows native (verl #6325), dense-layer shift
(verl #5037), silent no-op (an update pass that does not replay), recompute drift (Megatron).
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from harness.subjects import Subject
from harness.testing.asserts import assert_close_logprobs, assert_same_routes, differing_routes
from harness.testing.judge import Refusal, as_ids, refuses
from harness.testing.suite import require
from reference_impl import MoEConfig, MoELM, ReplayError, RoutingMode
from reference_impl.layouts import Placed, place_left_padded

pytestmark = pytest.mark.capability("training")

CFG = MoEConfig.tiny(seed=5)
ALL_MOE = MoEConfig.tiny(num_layers=2, first_k_dense=0, seed=6)
LENGTHS, WIDTH, PROMPTS = (7, 5, 3), 8, (3, 2, 1)
AXES = ("decoder", "moe_ordinal")


@functools.cache
def _rollout_routes(cfg: MoEConfig) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per sample ``(tokens, decoder-axis routes)`` recorded by a copy of the model whose routers moved."""
    engine = MoELM(cfg)
    gen = torch.Generator().manual_seed(99)
    samples = []
    with torch.no_grad():
        for router in engine.routers():
            router.gate.weight.add_(torch.randn(router.gate.weight.shape, generator=gen))
        for n in LENGTHS:
            tokens = torch.randint(1, cfg.vocab_size, (n,), generator=gen)
            engine.set_routing_mode(RoutingMode.RECORD)
            engine(tokens[None, :-1])
            routes = torch.zeros(n - 1, cfg.num_layers, cfg.top_k, dtype=torch.long)
            routes[:, list(cfg.moe_layers)] = engine.pop_recording()
            samples.append((tokens, routes))
    return tuple(samples)


def _batch(cfg: MoEConfig, axis: str = "decoder") -> Placed:
    """Three left-padded samples with rollout routes on ``axis`` and prompt lengths (a response mask)."""
    moe = list(cfg.moe_layers)
    samples = [(t, r if axis == "decoder" else r[:, moe]) for t, r in _rollout_routes(cfg)]
    return place_left_padded(samples, WIDTH, prompt_lens=list(PROMPTS))


def _expected_targets(placed: Placed, cfg: MoEConfig, axis: str) -> torch.Tensor:
    """Row b·W + t, MoE layer j: the placed route of that layer, read by hand on the trace's axis."""
    rows = placed.routes.reshape(-1, *placed.routes.shape[2:]).long()
    return rows[:, list(cfg.moe_layers)] if axis == "decoder" else rows


ROWS = ("flat row", "MoE ordinal")


def _assert_dispatched(
    model: MoELM, expected: torch.Tensor, rows: torch.Tensor, names: tuple[str, str], what: str
) -> None:
    """The routes the model's experts received in its last forward (or recompute), observed at the
    dispatch step, equal ``expected`` as sets at the flat rows under ``rows``."""
    assert_same_routes(model.dispatched_routes(), expected, names=names, what=what, axes=ROWS, mask=rows)


def _assert_replay_is_observable(native: torch.Tensor, rollout: torch.Tensor, rows: torch.Tensor) -> None:
    """The rollout routes differ from native routing somewhere under ``rows``: else replaying them and
    routing natively are indistinguishable and the test has no teeth."""
    differs = differing_routes(native, rollout, names=("native", "rollout")).any(-1) & rows.bool()
    assert bool(differs.any()), f"rollout routes equal native routing at all {int(rows.sum())} rows: no test"


def _native_logprobs(model: MoELM, placed: Placed) -> torch.Tensor:
    """log p(token_t | tokens_<t) by hand from the model's logits, routed natively."""
    model.clear_replay()
    model.set_routing_mode(RoutingMode.NATIVE)
    with torch.no_grad():
        logits = model(placed.tokens, attention_mask=placed.attention_mask)
    picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, placed.tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


def _assert_routes_natively(model: MoELM, placed: Placed, after: str) -> None:
    """A plain forward of ``placed`` on ``model`` dispatches what a fresh copy of it routes natively."""
    fresh = MoELM(model.cfg)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        fresh(placed.tokens, attention_mask=placed.attention_mask)
        try:
            model(placed.tokens, attention_mask=placed.attention_mask)
        except ReplayError as err:
            raise AssertionError(f"after {after}, a plain forward of the model raised: {err}") from err
    _assert_dispatched(
        model,
        fresh.dispatched_routes(),
        torch.ones(placed.tokens.numel(), dtype=torch.bool),
        ("the model", "a fresh copy routing natively"),
        f"after {after}, a plain forward (replay state leaked out of the pass?)",
    )


def _valid(placed: Placed) -> torch.Tensor:
    """Columns that have a log-prob: a real token right after a real token."""
    real = placed.attention_mask.bool()
    return torch.cat([torch.zeros_like(real[:, :1]), real[:, 1:] & real[:, :-1]], dim=1)


# --------------------------------------------------------------------------------------------------
# Configuration rules (DESIGN §3.9)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [None, 1], ids=["every-layer", "one-layer-slot"])
def test_r2_with_rollout_routes_is_a_configuration_error(subject: Subject, slots: int | None) -> None:
    """R2 replays the trainer's own recording: rollout routes next to it are a configuration error.
    Routes of a single layer slot (a one-MoE-layer model's MoE-ordinal trace) are rollout routes too."""
    training = require(subject, "training")
    placed = _batch(CFG)
    if slots is not None:
        placed = replace(placed, routes=placed.routes[:, :, :slots])
    where = f"a batch with rollout routes of {placed.routes.shape[2]} layer slots"
    assert training.has_rollout_routes(placed), f"{where}: has_rollout_routes says False, expected True"
    refuses(lambda: training.check_mode("R2", placed), "R2")
    mode = str(getattr(training.check_mode("R3", placed), "value", "R3"))
    assert mode == "R3", f"{where}: check_mode('R3') gave {mode!r}, expected 'R3'"


def test_r3_without_rollout_routes_is_a_configuration_error(subject: Subject) -> None:
    """R3 with no rollout routes would route natively in silence: it is a configuration error."""
    training = require(subject, "training")
    placed = training.place_without_routes([torch.arange(1, 6), torch.arange(1, 3)], 6)
    assert not training.has_rollout_routes(placed), (
        "a token-only batch: has_rollout_routes says True, expected False"
    )
    right_end = as_ids(placed.tokens[:, -2:])
    assert torch.equal(right_end, torch.tensor([[4, 5], [1, 2]])), (
        f"place_without_routes: each row ends in {right_end.tolist()}, expected [[4, 5], [1, 2]] (each "
        "sample's tokens at the right end of its row)"
    )
    refuses(lambda: training.check_mode("R3", placed), "R3")
    mode = str(getattr(training.check_mode("R2", placed), "value", "R2"))
    assert mode == "R2", f"a token-only batch: check_mode('R2') gave {mode!r}, expected 'R2'"


def test_bad_trainer_input_is_refused(subject: Subject, refused: Refusal = refuses) -> None:
    """A mode, layer list, layer axis, R2 recording or loss mask that cannot be right raises, in the
    subject's own words, never a pass that routes natively in silence (DESIGN §3.8); the routers are
    left native. The reference's own tests run these cases with ``raises_naming``."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    moe = list(CFG.moe_layers)
    refused(lambda: training.check_mode("R4", placed), "mode", "R4")
    refused(lambda: training.replay_targets(placed, [], "decoder"), "moe_layers")
    refused(lambda: training.replay_targets(placed, moe, "expert"), "layer_axis", "expert")
    tokens_only = training.place_without_routes([t for t, _ in _rollout_routes(CFG)], WIDTH)
    not_recorded = training.old_logprobs(model, tokens_only, "disabled", moe_layers=moe)
    refused(
        lambda: training.policy_logprobs(model, tokens_only, "R2", old=not_recorded, moe_layers=moe),
        "recording",
    )
    _assert_routes_natively(model, placed, "an R2 update pass refused for want of a recording")
    nothing = torch.zeros(placed.tokens.shape, dtype=torch.bool)
    logprobs = not_recorded.logprobs
    refused(lambda: training.ppo_kl(logprobs, logprobs, nothing), "mask")
    refused(lambda: training.ppo_loss(logprobs, logprobs, logprobs, nothing), "mask")


# --------------------------------------------------------------------------------------------------
# Replay targets: values and mask (DESIGN §3.5, §3.6)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, ALL_MOE], ids=["dense-first", "all-moe"])
@pytest.mark.parametrize("axis", AXES)
def test_replay_targets_are_the_placed_routes_of_each_moe_layer(
    subject: Subject, cfg: MoEConfig, axis: str
) -> None:
    """Row b·W + t of MoE layer j targets exactly the placed route of that layer (dense layers skipped),
    on both layer axes; the mask is True exactly on rows that exist, prompt rows included."""
    training = require(subject, "training")
    placed = _batch(cfg, axis)
    targets, mask = training.replay_targets(placed, cfg.moe_layers, axis)
    targets, mask = as_ids(targets, "replay targets"), torch.as_tensor(mask).bool()
    expected = _expected_targets(placed, cfg, axis)
    where = f"{axis} trace, MoE layers {list(cfg.moe_layers)} of {cfg.num_layers}"
    assert tuple(targets.shape) == tuple(expected.shape), (
        f"{where}: targets are {tuple(targets.shape)}, expected [B·W, n_moe, k] = {tuple(expected.shape)}"
    )
    assert torch.equal(mask, placed.replay_mask.reshape(-1)), (
        f"{where}: the replay mask differs from the rows that exist at flat rows "
        f"{(mask != placed.replay_mask.reshape(-1)).nonzero().squeeze(1).tolist()[:8]} "
        "(prompt rows are replayed too: verl #6325; filler never)"
    )
    assert_same_routes(
        targets,
        expected,
        names=("replay targets", "placed routes"),
        what=f"{where} (a decoder trace indexed by MoE ordinal shifts every layer: verl #5037)",
        axes=ROWS,
        mask=mask,
    )


# --------------------------------------------------------------------------------------------------
# The passes: log-probs, R3 and R2 updates with and without recompute, the reference pass
# --------------------------------------------------------------------------------------------------


def test_token_logprobs_are_the_models_log_probabilities(subject: Subject) -> None:
    """``token_logprobs`` is log p(token_t | tokens_<t) at every column that has one, 0 elsewhere."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    valid = torch.as_tensor(training.logprob_mask(placed.attention_mask)).bool()
    assert torch.equal(valid, _valid(placed)), (
        f"logprob_mask is True at {valid.nonzero().tolist()[:6]}, expected a real token after a real token"
    )
    native = _native_logprobs(model, placed)
    with torch.no_grad():
        got = training.token_logprobs(model, placed.tokens, placed.attention_mask)
    assert_close_logprobs(
        got, native, names=("token_logprobs", "log p by hand"), axes=("sample", "column"), mask=valid
    )
    assert_close_logprobs(
        got,
        torch.zeros_like(got),
        names=("token_logprobs", "0"),
        what="columns without a log-prob",
        mask=~valid,
    )


def test_ppo_quantities_follow_their_formulas(subject: Subject) -> None:
    """``ppo_kl`` is mean(old − new) over the mask; ``ppo_loss`` the clipped-ratio loss (verl's)."""
    training = require(subject, "training")
    gen = torch.Generator().manual_seed(0)
    new, old, adv = (torch.randn(3, 6, generator=gen) for _ in range(3))
    mask = torch.rand(3, 6, generator=gen) > 0.3
    kl = training.ppo_kl(new, old, mask)
    assert torch.allclose(kl, (old - new)[mask].mean()), (
        f"ppo_kl = {float(kl):.6f}, expected mean(old − new) = {float((old - new)[mask].mean()):.6f}"
    )
    ratio = torch.exp(new - old)
    by_hand = (-torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv))[mask].mean()
    loss = training.ppo_loss(new, old, adv, mask, clip=0.2)
    assert torch.allclose(loss, by_hand), f"ppo_loss = {float(loss):.6f}, expected {float(by_hand):.6f}"


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["no-recompute", "recompute"])
@pytest.mark.parametrize("axis", AXES)
def test_r3_update_replays_rollout_routes_and_first_minibatch_has_zero_kl(
    subject: Subject, axis: str, use_checkpoint: bool
) -> None:
    """R3: the old pass, the update pass and its recompute dispatch the rollout routes at every row that
    exists, and the first on-policy mini-batch reproduces π_old bit for bit (``ppo_kl == 0``)."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG, axis)
    moe, rows = list(CFG.moe_layers), placed.replay_mask.reshape(-1)
    expected = _expected_targets(placed, CFG, axis)
    where = f"R3, {axis} trace, {'with' if use_checkpoint else 'without'} activation recompute"
    with torch.no_grad():
        model(placed.tokens, attention_mask=placed.attention_mask)
    _assert_replay_is_observable(model.dispatched_routes(), expected, rows)
    old = training.old_logprobs(model, placed, "R3", moe_layers=moe, layer_axis=axis)
    _assert_dispatched(model, expected, rows, ("dispatched", "rollout routes"), f"{where}: the old pass")
    new = training.policy_logprobs(
        model, placed, "R3", old=old, moe_layers=moe, layer_axis=axis, use_checkpoint=use_checkpoint
    )
    _assert_dispatched(model, expected, rows, ("dispatched", "rollout routes"), f"{where}: the update pass")
    valid = _valid(placed) & placed.response_mask
    kl = training.ppo_kl(new, old.logprobs, valid)
    assert_close_logprobs(
        new, old.logprobs, names=("π_θ", "π_old"), what=f"{where}: first on-policy mini-batch", mask=valid
    )
    assert float(kl.detach()) == 0.0, (
        f"{where}: first on-policy mini-batch has ppo_kl = {float(kl.detach()):.3e}, expected 0"
    )
    advantages = torch.linspace(-1, 1, new.numel()).reshape(new.shape)
    loss = training.ppo_loss(new, old.logprobs, advantages, valid)
    assert torch.allclose(loss, -advantages[valid].mean()), (
        f"{where}: at ratio 1 the loss is −mean(advantages) = {float(-advantages[valid].mean()):.6f}, "
        f"ppo_loss gave {float(loss):.6f}"
    )
    training.backward(loss, model)
    if use_checkpoint:
        _assert_dispatched(
            model, expected, rows, ("dispatched", "rollout routes"), f"{where}: the recompute in backward"
        )
    gate = model.routers()[0].gate.weight.grad
    assert gate is not None and bool(gate.abs().sum() > 0), (
        f"{where}: the first router's gate weight has gradient {None if gate is None else 0}, expected a "
        "non-zero one"
    )


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["no-recompute", "recompute"])
def test_r2_update_replays_the_old_pass_recording(subject: Subject, use_checkpoint: bool) -> None:
    """R2: the old pass records, the update pass (and its recompute) dispatch that recording after the
    router weights moved, and the first on-policy mini-batch has ``ppo_kl == 0`` exactly."""
    training = require(subject, "training")
    model = MoELM(CFG)
    placed = training.place_without_routes([t for t, _ in _rollout_routes(CFG)], WIDTH)
    rows = placed.attention_mask.reshape(-1).bool()
    old = training.old_logprobs(model, placed, "R2", moe_layers=list(CFG.moe_layers))
    recorded = model.dispatched_routes()
    assert old.recording is not None, "R2: the old pass returned no recording"
    assert_same_routes(
        old.recording,
        recorded,
        names=("the old pass's recording", "dispatched"),
        what="R2",
        axes=ROWS,
        mask=rows,
    )
    new = training.policy_logprobs(
        model, placed, "R2", old=old, moe_layers=list(CFG.moe_layers), use_checkpoint=use_checkpoint
    )
    valid = _valid(placed)
    kl = training.ppo_kl(new, old.logprobs, valid)
    where = f"R2 {'with' if use_checkpoint else 'without'} recompute"
    assert_close_logprobs(
        new, old.logprobs, names=("π_θ", "π_old"), what=f"{where}: first on-policy mini-batch", mask=valid
    )
    assert float(kl.detach()) == 0.0, (
        f"{where}: first mini-batch ppo_kl = {float(kl.detach()):.3e}, expected 0"
    )
    training.backward(new[valid].sum(), model)
    _assert_dispatched(
        model,
        recorded,
        rows,
        ("dispatched", "the old pass's recording"),
        f"{where}: the update pass (or its recompute)",
    )


def test_r2_replays_each_steps_own_recording(subject: Subject) -> None:
    """Two R2 steps on different batches of one shape, the router weights moved in between: each update
    pass dispatches its own step's recording, made under the current weights. A step whose old pass ran
    no RECORD forward (a "bypass" old pass) and replays an earlier step's recording (verl #7805) trains
    on a routing that neither the rollout nor the current policy took."""
    training = require(subject, "training")
    model, moe = MoELM(CFG), list(CFG.moe_layers)
    first = training.place_without_routes([t for t, _ in _rollout_routes(CFG)], WIDTH)
    second = training.place_without_routes([t.flip(0) for t, _ in _rollout_routes(CFG)], WIDTH)
    steps = []
    for step, placed in enumerate((first, second)):
        old = training.old_logprobs(model, placed, "R2", moe_layers=moe)
        recorded = model.dispatched_routes()
        new = training.policy_logprobs(model, placed, "R2", old=old, moe_layers=moe)
        rows = placed.attention_mask.reshape(-1).bool()
        steps.append(recorded)
        _assert_dispatched(
            model, recorded, rows, ("dispatched", "this step's old pass"), f"R2 step {step}: the update pass"
        )
        training.backward(new[_valid(placed)].sum(), model)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(step)
            for router in model.routers():
                router.gate.weight.add_(0.5 * torch.randn(router.gate.weight.shape, generator=gen))
    assert bool(differing_routes(steps[0], steps[1]).any()), "both steps routed alike: no test"


def test_a_forward_only_pass_leaves_nothing_for_the_next_recompute(subject: Subject) -> None:
    """A forward-only R3 pass on another batch (the next mini-batch's log-probs, a validation pass) runs
    between training steps; the next update pass's activation recompute then dispatches that update's
    own rollout routes. Entries the forward-only pass left in the recompute FIFO would be popped first
    (SkyRL #1908 bug 1): clear before each pipeline schedule and after it, never between its
    micro-batches."""
    training = require(subject, "training")
    model, placed, moe = MoELM(CFG), _batch(CFG), list(CFG.moe_layers)
    samples = [(t, r) for t, r in _rollout_routes(CFG)][::-1]
    other = place_left_padded(samples, WIDTH, prompt_lens=list(PROMPTS[::-1]))
    rows = placed.replay_mask.reshape(-1)
    expected = _expected_targets(placed, CFG, "decoder")
    assert bool(
        (differing_routes(_expected_targets(other, CFG, "decoder"), expected).any(-1) & rows.bool()).any()
    ), "the two batches' rollout routes agree at every row: no test"
    training.old_logprobs(model, other, "R3", moe_layers=moe)
    old = training.old_logprobs(model, placed, "R3", moe_layers=moe)
    new = training.policy_logprobs(model, placed, "R3", old=old, moe_layers=moe, use_checkpoint=True)
    training.backward(new[_valid(placed)].sum(), model)
    _assert_dispatched(
        model,
        expected,
        rows,
        ("recompute dispatched", "this update's rollout routes"),
        "R3 with recompute, after a forward-only pass on another batch",
    )


@settings(max_examples=25)
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    extra=st.integers(0, 3),
    axis=st.sampled_from(AXES),
    seed=st.integers(0, 2**31 - 1),
)
def test_router_statistics_count_only_rows_that_hold_a_route(
    subject: Subject, lengths: list[int], extra: int, axis: str, seed: int
) -> None:
    """``tokens_per_expert`` of a padded micro-batch counts, per MoE layer and expert, the routes of the
    rows that exist: never the padding, a sample's last token, or the filler their slots hold (a mask of
    shape ``[tokens]`` applied against ``[tokens, experts]`` counts them, SkyRL #1908 bug 4). Counted by
    hand from each sample's own rows."""
    note(f"counterexample: lengths={lengths}, extra={extra}, axis={axis}, seed={seed}")
    training = require(subject, "training")
    gen = torch.Generator().manual_seed(seed)
    moe, layers = list(CFG.moe_layers), CFG.num_layers if axis == "decoder" else len(CFG.moe_layers)
    expected = torch.zeros(len(moe), CFG.num_experts, dtype=torch.long)
    samples = []
    for n in lengths:
        ids = torch.rand(max(n - 1, 0), layers, CFG.num_experts, generator=gen).argsort(-1)[..., : CFG.top_k]
        samples.append((torch.randint(1, CFG.vocab_size, (n,), generator=gen), ids))
        slots = ids[:, moe] if axis == "decoder" else ids
        for j in range(len(moe)):
            expected[j] += torch.bincount(slots[:, j].reshape(-1), minlength=CFG.num_experts)
    placed = place_left_padded(samples, max(lengths) + extra)
    got = as_ids(training.tokens_per_expert(placed, moe, CFG.num_experts, axis), "tokens_per_expert")
    assert tuple(got.shape) == tuple(expected.shape), (
        f"tokens_per_expert has shape {tuple(got.shape)}, expected {tuple(expected.shape)} "
        "(MoE layers × experts)"
    )
    wrong = (got != expected).nonzero().tolist()
    assert not wrong, (
        f"tokens_per_expert of samples of lengths {lengths} ({axis} trace): at (MoE layer, expert) "
        f"{wrong[:4]} "
        f"counted {[int(got[j, e]) for j, e in wrong[:4]]}, the rows that hold a route give "
        f"{[int(expected[j, e]) for j, e in wrong[:4]]} ({int(got.sum()) - int(expected.sum())} routes "
        "more in all: padding or last-token rows counted?)"
    )


@pytest.mark.parametrize("use_checkpoint", [False, True], ids=["no-recompute", "recompute"])
def test_disabled_mode_routes_every_pass_natively(subject: Subject, use_checkpoint: bool) -> None:
    """DISABLED is the no-replay baseline: on a batch that carries rollout routes (differing from native
    routing) the old pass, the update pass and its recompute dispatch the model's native routes and give
    its native log-probs."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    moe, rows, valid = list(CFG.moe_layers), placed.attention_mask.reshape(-1), _valid(placed)
    native_logprobs = _native_logprobs(model, placed)
    native = model.dispatched_routes()
    rollout = _expected_targets(placed, CFG, "decoder")
    _assert_replay_is_observable(native, rollout, placed.replay_mask.reshape(-1))
    where = f"DISABLED {'with' if use_checkpoint else 'without'} activation recompute"
    old = training.old_logprobs(model, placed, "disabled", moe_layers=moe)
    _assert_dispatched(model, native, rows, ("dispatched", "native"), f"{where}: the old pass")
    assert_close_logprobs(
        old.logprobs, native_logprobs, names=("π_old", "native π"), what=f"{where}: the old pass", mask=valid
    )
    new = training.policy_logprobs(
        model, placed, "disabled", old=old, moe_layers=moe, use_checkpoint=use_checkpoint
    )
    _assert_dispatched(model, native, rows, ("dispatched", "native"), f"{where}: the update pass")
    assert_close_logprobs(
        new, native_logprobs, names=("π_θ", "native π"), what=f"{where}: the update pass", mask=valid
    )
    training.backward(new[valid].sum(), model)
    _assert_dispatched(
        model, native, rows, ("dispatched", "native"), f"{where}: the backward (or its recompute)"
    )


def test_every_pass_hands_the_model_back_routing_natively(subject: Subject) -> None:
    """Each pass clears its replay state when it ends (DESIGN §3.7: one FIFO entry per forward, nothing
    left over), so a plain forward after it routes natively: after the R3, R2 and DISABLED old and update
    passes (the update pass without recompute unless asked), after backward with recompute, and after
    the reference pass."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    tokens_only = training.place_without_routes([t for t, _ in _rollout_routes(CFG)], WIDTH)
    moe = list(CFG.moe_layers)
    for mode, batch in (("R3", placed), ("R2", tokens_only), ("disabled", placed)):
        old = training.old_logprobs(model, batch, mode, moe_layers=moe)
        _assert_routes_natively(model, placed, f"the {mode} old pass")
        training.policy_logprobs(model, batch, mode, old=old, moe_layers=moe)
        _assert_routes_natively(model, placed, f"the {mode} update pass, called without use_checkpoint")
        new = training.policy_logprobs(model, batch, mode, old=old, moe_layers=moe, use_checkpoint=True)
        training.backward(new.sum(), model)
        _assert_routes_natively(model, placed, f"the {mode} update pass with recompute and its backward")
    training.reference_logprobs(model, placed)
    _assert_routes_natively(model, placed, "the reference pass")


def test_a_failed_update_pass_or_a_leaked_fifo_entry_is_an_error_and_resets_the_routers(
    subject: Subject,
) -> None:
    """An R2 update pass given the recording of another batch fails, and so does a backward that leaves a
    recompute FIFO entry unpopped (it would be replayed by the next recompute: a FIFO leak, DESIGN §3.7);
    either way the model is handed back routing natively."""
    training = require(subject, "training")
    model = MoELM(CFG)
    samples = [t for t, _ in _rollout_routes(CFG)]
    moe = list(CFG.moe_layers)
    placed = training.place_without_routes(samples, WIDTH)
    other = training.old_logprobs(
        model, training.place_without_routes(samples[:2], WIDTH), "R2", moe_layers=moe
    )
    with pytest.raises((ValueError, RuntimeError)):
        training.policy_logprobs(model, placed, "R2", old=other, moe_layers=moe)
    _assert_routes_natively(model, placed, "an R2 update pass that failed on another batch's recording")
    old = training.old_logprobs(model, placed, "R2", moe_layers=moe)
    new = training.policy_logprobs(model, placed, "R2", old=old, moe_layers=moe, use_checkpoint=True)
    with pytest.raises((ValueError, RuntimeError)):
        training.backward(new.detach().sum().requires_grad_(), model)  # no recompute ran: entries left
    _assert_routes_natively(model, placed, "a backward that left the recompute FIFO unpopped")


def test_reference_logprobs_never_replay(subject: Subject) -> None:
    """π_ref routes natively: after an R3 old pass, and in the middle of an R3 update pass with recompute,
    on a batch whose rollout routes differ from the model's native routing."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    moe = list(CFG.moe_layers)
    native = _native_logprobs(model, placed)
    valid = _valid(placed)
    old = training.old_logprobs(model, placed, "R3", moe_layers=moe)
    assert not torch.equal(old.logprobs[valid], native[valid]), (
        f"R3 π_old equals the native π at all {int(valid.sum())} valid columns: replay moved nothing, no test"
    )
    reference = training.reference_logprobs(model, placed)
    assert_close_logprobs(
        reference,
        native,
        names=("π_ref", "native π"),
        what="after an R3 old pass (π_ref replayed?)",
        mask=valid,
    )
    new = training.policy_logprobs(model, placed, "R3", old=old, moe_layers=moe, use_checkpoint=True)
    reference = training.reference_logprobs(model, placed)
    assert_close_logprobs(
        reference,
        native,
        names=("π_ref", "native π"),
        what="during an R3 update pass (π_ref replayed?)",
        mask=valid,
    )
    training.backward(new[valid].sum(), model)  # the update pass's recompute FIFO is still intact
    _assert_dispatched(
        model,
        _expected_targets(placed, CFG, "decoder"),
        placed.replay_mask.reshape(-1),
        ("dispatched by the recompute", "rollout routes"),
        "after a reference pass in the middle of an R3 update (it disturbed the recompute FIFO?)",
    )


def test_reference_logprobs_ignore_armed_targets(subject: Subject) -> None:
    """π_ref routes natively even while every router is armed with targets set on the model directly."""
    training = require(subject, "training")
    model, placed = MoELM(CFG), _batch(CFG)
    native = _native_logprobs(model, placed)
    valid = _valid(placed)
    everyone_to_first = torch.arange(CFG.top_k).expand(placed.tokens.numel(), len(CFG.moe_layers), CFG.top_k)
    model.set_replay_targets(everyone_to_first)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    reference = training.reference_logprobs(model, placed)
    model.clear_replay()
    model.set_routing_mode(RoutingMode.NATIVE)
    assert_close_logprobs(
        reference,
        native,
        names=("π_ref", "native π"),
        what="with every router armed (π_ref replayed?)",
        mask=valid,
    )
