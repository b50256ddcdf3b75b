"""Replay effect (DESIGN §3.7–3.8) for every router family, through the subject's ``install_replay``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.subjects import Subject
from harness.subjects.capabilities import ReplayController as ReplayHandle
from reference_impl import ROUTER_FAMILIES, MoEConfig, MoELM
from suites.conftest import require

BATCH, SEQ = 2, 6


@functools.cache
def _model(family: str, dtype: str = "float32") -> MoELM:
    """A tiny model with a dense first layer and two MoE layers of ``family`` (built once per family)."""
    grouped = family == "sigmoid_grouped"
    cfg = MoEConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        first_k_dense=1,
        num_experts=8,
        top_k=2,
        router_family=family,
        n_group=2 if grouped else 1,
        topk_group=1,
        routed_scaling_factor=2.5 if grouped else 1.0,
        shared_expert=family == "llama4",
        dtype=dtype,
        seed=7,
    )
    return MoELM(cfg)


def _fresh(family: str, dtype: str = "float32") -> MoELM:
    return copy.deepcopy(_model(family, dtype))


def _handle(subject: Subject, model: MoELM) -> ReplayHandle:
    return require(subject, "install_replay")(model)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _random_targets(model: MoELM, seed: int) -> torch.Tensor:
    """Valid targets ``[B·T, n_moe, k]``: distinct uniformly random ids per route."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    rows = BATCH * SEQ * len(cfg.moe_layers)
    ids = torch.argsort(torch.rand(rows, cfg.num_experts, generator=gen), dim=-1)[:, : cfg.top_k]
    return ids.reshape(BATCH * SEQ, len(cfg.moe_layers), cfg.top_k)


def _as_sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.sort(dim=-1).values


families = pytest.mark.parametrize("family", ROUTER_FAMILIES)


@families
@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), negate=st.booleans())
def test_dispatched_experts_equal_targets(subject: Subject, family: str, seed: int, negate: bool) -> None:
    """Under replay the experts receive exactly the targets, whatever the live logits say."""
    model = _fresh(family)
    if negate:  # live logits now prefer the opposite experts
        with torch.no_grad():
            for router in model.routers():
                router.gate.weight.neg_()
    handle = _handle(subject, model)
    targets = _random_targets(model, seed)
    handle.replay(targets)
    with torch.no_grad():
        model(_tokens(seed))
    dispatched = handle.dispatched()
    handle.disarm()
    differs = (_as_sets(dispatched) != _as_sets(targets)).any(-1)
    assert not differs.any(), (
        f"{family}: {int(differs.sum())} of {differs.numel()} (token, layer) routes dispatched other experts "
        f"than their targets, first at (token, layer) {tuple(differs.nonzero()[0].tolist())}"
    )


@families
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=10)
@given(seed=st.integers(0, 2**31 - 1))
def test_replaying_own_recording_is_bit_exact(subject: Subject, family: str, dtype: str, seed: int) -> None:
    """Replaying a model's own recording reproduces its un-replayed logits bit for bit (fp32 and bf16)."""
    model = _fresh(family, dtype)
    handle = _handle(subject, model)
    tokens = _tokens(seed)
    handle.record()
    with torch.no_grad():
        native = model(tokens)
    handle.replay(handle.recording())
    with torch.no_grad():
        replayed = model(tokens)
    handle.disarm()
    assert torch.equal(native, replayed), (
        f"{family} {dtype}: replayed logits differ from native by "
        f"{(native - replayed).float().abs().max().item():.3e}"
    )


@families
def test_router_gets_gradient_at_targets_live_top_k_would_not_pick(subject: Subject, family: str) -> None:
    """The gate weights are recomputed from live logits at the targets, so the router gets gradients there."""
    model = _fresh(family)
    handle = _handle(subject, model)
    tokens = _tokens(0)
    handle.record()
    with torch.no_grad():
        model(tokens)
    natural = handle.recording()
    unpicked = next(e for e in range(model.cfg.num_experts) if e not in natural[0, 0].tolist())
    targets = natural.clone()
    targets[0, 0, -1] = unpicked  # token 0, first MoE layer: one expert its live top-k did not pick
    handle.replay(targets)
    model(tokens).float().logsumexp(-1).sum().backward()
    handle.disarm()
    grad = model.routers()[0].gate.weight.grad
    assert grad is not None, f"{family}: the router weight received no gradient"
    assert grad[unpicked].abs().sum() > 0, f"{family}: no gradient for replayed expert {unpicked}"


@families
def test_recompute_replays_the_forward_targets(subject: Subject, family: str) -> None:
    """With activation recompute, each backward replays what its own forward used (one FIFO entry each)."""
    model = _fresh(family)
    handle = _handle(subject, model)
    first, second = _tokens(1), _tokens(2)
    targets_first, targets_second = _random_targets(model, 1), _random_targets(model, 2)

    handle.replay(targets_first)
    model(first).float().logsumexp(-1).sum().backward()
    handle.disarm()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)

    # Two micro-batches forward before the first backward, as under pipeline parallelism.
    handle.replay(targets_first)
    loss_first = model(first, use_checkpoint=True).float().logsumexp(-1).sum()
    handle.replay(targets_second)
    model(second, use_checkpoint=True)
    handle.prepare_backward()
    loss_first.backward()
    handle.disarm()
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(got) == len(expected), (
        f"{family}: {len(got)} parameters got gradients, expected {len(expected)}"
    )
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e), f"{family}: recompute replayed other targets than the forward"


@families
def test_missing_targets_are_an_error_not_native_routing(subject: Subject, family: str) -> None:
    """Replay with targets for the wrong number of MoE layers raises instead of routing natively."""
    model = _fresh(family)
    handle = _handle(subject, model)
    too_few = _random_targets(model, 0)[:, :1, :]
    with pytest.raises(Exception) as info:
        handle.replay(too_few)
        with torch.no_grad():
            model(_tokens(0))
    handle.disarm()
    assert not isinstance(info.value, AssertionError)
