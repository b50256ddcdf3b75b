"""Router families, per-router record/replay state, and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from harness.testing.asserts import assert_same_routes
from reference_impl import (
    FAMILIES,
    ROUTER_FAMILIES,
    ConfigError,
    MoEConfig,
    ReplayError,
    Router,
    RoutingMode,
    make_family,
)

LOGITS = torch.tensor([[1.0, 2.0, 3.0, 0.5], [0.2, -1.0, 0.1, 0.4]])


def _cfg(**kw) -> MoEConfig:
    base = dict(num_experts=4, top_k=2)
    base.update(kw)
    return MoEConfig(**base)


# --- each family's rule on a tiny hand-computed example -------------------------------------


@pytest.mark.parametrize("normalise", [True, False])
def test_softmax_topk_matches_hand_formula(normalise):
    family = make_family("softmax_topk", _cfg(norm_topk_prob=normalise))
    ids = family.select(LOGITS)
    assert_same_routes(ids, [[1, 2], [0, 3]], names=("selected", "by hand"))
    e = [math.exp(v) for v in LOGITS[0].tolist()]
    if normalise:
        expected = [e[2] / (e[2] + e[1]), e[1] / (e[2] + e[1])]
    else:
        expected = [e[2] / sum(e), e[1] / sum(e)]
    w = family.weights(LOGITS, ids)
    assert torch.allclose(w[0], torch.tensor(expected), atol=1e-6)
    assert family.weights(LOGITS.bfloat16(), ids).dtype == torch.bfloat16


def test_softmax_topk_fp32_always_renormalised_and_stays_fp32():
    family = make_family("softmax_topk_fp32", _cfg(norm_topk_prob=False))
    ids = family.select(LOGITS)
    w = family.weights(LOGITS.bfloat16(), ids)
    assert w.dtype == torch.float32
    assert torch.allclose(w.sum(-1), torch.ones(2))
    e = [math.exp(v) for v in LOGITS[0].tolist()]
    assert torch.allclose(
        family.weights(LOGITS, ids)[0], torch.tensor([e[2] / (e[2] + e[1]), e[1] / (e[2] + e[1])]), atol=1e-6
    )


def test_topk_softmax_is_softmax_over_chosen_logits():
    family = make_family("topk_softmax", _cfg())
    assert family.gate_bias
    ids = family.select(LOGITS)
    assert_same_routes(ids, [[1, 2], [0, 3]], names=("selected", "by hand"))
    w = family.weights(LOGITS, ids)
    a, b = LOGITS[1, ids[1, 0]].item(), LOGITS[1, ids[1, 1]].item()
    assert math.isclose(w[1, 0].item(), math.exp(a) / (math.exp(a) + math.exp(b)), rel_tol=1e-6)


def test_sigmoid_grouped_group_limit_excludes_masked_groups():
    cfg = _cfg(
        num_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5, router_family="sigmoid_grouped"
    )
    family = make_family("sigmoid_grouped", cfg)
    # Groups {0,1} {2,3} {4,5} {6,7}. Expert 0 has the best single score, but its group sums to
    # ~1.0 (expert 1 is very low), below groups {2,3} (~1.46) and {4,5} (~1.38).
    logits = torch.tensor([[5.0, -5.0, 1.0, 1.0, 0.8, 0.8, 0.0, 0.0]])
    ids = family.select(logits)
    assert_same_routes(ids, [[2, 3]], names=("selected", "by hand"))
    assert 0 not in ids.tolist()[0]
    assert set(torch.topk(logits.sigmoid(), 2).indices.tolist()[0]) != {2, 3}  # limit mattered

    # The correction bias steers the choice but never enters the weights.
    family.e_score_correction_bias[4] = 0.5
    ids = family.select(logits)
    assert 4 in ids.tolist()[0]
    s = logits.sigmoid()[0]
    chosen = ids.tolist()[0]
    expected = torch.stack([s[i] for i in chosen]) / sum(s[i] for i in chosen) * 2.5
    assert torch.allclose(family.weights(logits, ids)[0], expected, atol=1e-6)


def test_llama4_weights_are_sigmoid_of_logits_at_ids():
    family = make_family("llama4", _cfg())
    ids = family.select(LOGITS)
    assert_same_routes(ids, [[1, 2], [0, 3]], names=("selected", "by hand"))
    assert torch.allclose(family.weights(LOGITS, ids), LOGITS.gather(1, ids).sigmoid())
    forced = torch.tensor([[0, 3], [1, 2]])  # not the native choice: still sigmoid at the ids
    assert torch.allclose(family.weights(LOGITS, forced), LOGITS.gather(1, forced).sigmoid())


def test_family_registry_matches_config_names():
    assert tuple(FAMILIES) == ROUTER_FAMILIES


# --- one router's record / replay state -----------------------------------------------------


def _router(family: str) -> Router:
    cfg = MoEConfig(
        hidden_size=16, num_heads=2, num_experts=8, top_k=2, n_group=4, topk_group=2, router_family=family
    )
    torch.manual_seed(0)
    router = Router(cfg, layer=3)
    with torch.no_grad():
        router.gate.weight.normal_()
        if family == "sigmoid_grouped":
            router.family.e_score_correction_bias.normal_(0, 0.1)
    return router


@pytest.mark.parametrize("family", ROUTER_FAMILIES)
def test_replay_forces_targets_and_gradient_reaches_unpicked_expert(family):
    router = _router(family)
    hidden = torch.randn(6, 16)
    native, _, logits = router(hidden)
    # Targets: the two experts with the lowest logits, never in the native choice.
    targets = logits.detach().topk(2, largest=False).indices
    assert all(not set(a) & set(b) for a, b in zip(native.tolist(), targets.tolist(), strict=True))
    router.replay.mode = RoutingMode.REPLAY_FORWARD
    router.replay.set_targets(targets)
    ids, weights, logits = router(hidden)
    assert torch.equal(ids, targets)
    assert torch.equal(weights, router.family.weights(logits, targets))
    (weights * torch.randn_like(weights)).sum().backward()
    grad_norm = router.gate.weight.grad.norm(dim=1)
    for expert in set(targets.flatten().tolist()):
        assert grad_norm[expert] > 0, f"no gradient at target expert {expert}"


def test_record_appends_one_detached_cpu_entry_per_call():
    router = _router("softmax_topk")
    router.replay.mode = RoutingMode.RECORD
    first, _, _ = router(torch.randn(5, 16))
    router(torch.randn(3, 16))
    assert [r.shape for r in router.replay.recorded] == [(5, 2), (3, 2)]
    assert router.replay.recorded[0].dtype == torch.int64 and not router.replay.recorded[0].requires_grad
    assert torch.equal(router.replay.recorded[0], first)


def test_replay_mask_routes_unmasked_rows_natively():
    router = _router("softmax_topk")
    hidden = torch.randn(4, 16)
    native, _, _ = router(hidden)
    filler = torch.zeros(4, 2, dtype=torch.long)  # invalid rows, but never replayed
    targets = torch.tensor([[6, 7], [6, 7], [0, 0], [0, 0]])
    router.replay.set_targets(
        torch.where(torch.tensor([True, True, False, False])[:, None], targets, filler),
        mask=torch.tensor([True, True, False, False]),
    )
    router.replay.mode = RoutingMode.REPLAY_FORWARD
    ids, _, _ = router(hidden)
    assert torch.equal(ids[:2], targets[:2])
    assert torch.equal(ids[2:], native[2:])


def test_fifo_replays_forward_targets_in_order():
    router = _router("softmax_topk")
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[4, 5], [6, 7]])
    router.replay.mode = RoutingMode.REPLAY_FORWARD
    router.replay.set_targets(a)
    router(torch.randn(2, 16))
    router.replay.set_targets(b)
    router(torch.randn(2, 16))
    router.replay.mode = RoutingMode.REPLAY_BACKWARD
    assert torch.equal(router(torch.randn(2, 16))[0], a)
    assert torch.equal(router(torch.randn(2, 16))[0], b)
    with pytest.raises(ReplayError, match="FIFO is empty"):
        router(torch.randn(2, 16))


# --- errors: nothing falls back to native silently ------------------------------------------


def test_replay_without_targets_raises_naming_layer():
    router = _router("softmax_topk")
    router.replay.mode = RoutingMode.REPLAY_FORWARD
    with pytest.raises(ReplayError, match=r"decoder layer 3.*no replay targets"):
        router(torch.randn(2, 16))


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor([[0, 1, 2]]), r"expected \[T, 2\]"),
        (torch.tensor([0, 1]), r"expected \[T, 2\]"),
        (torch.tensor([[0, 8]]), r"outside \[0, 8\)"),
        (torch.tensor([[-1, 2]]), r"outside \[0, 8\)"),
        (torch.tensor([[3, 3]]), "repeats an expert"),
        (torch.tensor([[0.0, 1.0]]), "integer dtype"),
    ],
)
def test_malformed_targets_raise(bad, message):
    with pytest.raises(ReplayError, match=message):
        _router("softmax_topk").replay.set_targets(bad)


def test_targets_for_wrong_token_count_raise_at_forward():
    router = _router("softmax_topk")
    router.replay.set_targets(torch.tensor([[0, 1], [2, 3]]))
    router.replay.mode = RoutingMode.REPLAY_FORWARD
    with pytest.raises(ReplayError, match=r"decoder layer 3.*expected \[3, 2\]"):
        router(torch.randn(3, 16))


def test_bad_mask_raises():
    router = _router("softmax_topk")
    with pytest.raises(ReplayError, match="replay mask"):
        router.replay.set_targets(torch.tensor([[0, 1], [2, 3]]), mask=torch.tensor([1, 0]))


# --- config validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_k=0), "top_k"),
        (dict(top_k=9), "top_k"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=2, topk_group=3), "topk_group"),
        (dict(router_family="sinkhorn"), "router_family"),
        (dict(router_family=("softmax_topk",) * 3), "router_family"),
        (dict(first_k_dense=5), "first_k_dense"),
        (dict(dtype="float16"), "dtype"),
        (dict(hidden_size=66), "hidden_size"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(router_family="sigmoid_grouped", n_group=8, topk_group=1), "top_k"),
    ],
)
def test_bad_config_raises_config_error_naming_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"MoEConfig.{field}"):
        MoEConfig(**kwargs)


def test_unknown_family_lists_known_ones():
    with pytest.raises(ConfigError) as info:
        MoEConfig(router_family="sinkhorn")
    assert all(name in str(info.value) for name in ROUTER_FAMILIES)


def test_config_layers_and_families():
    cfg = MoEConfig(first_k_dense=1, router_family=["llama4", "softmax_topk", "topk_softmax", "llama4"])
    assert cfg.moe_layers == (1, 2, 3)
    assert cfg.family_of(2) == "topk_softmax"
    assert isinstance(cfg.router_family, tuple)
    assert MoEConfig(dtype="bfloat16").torch_dtype == torch.bfloat16
