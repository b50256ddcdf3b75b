"""The reference MoE LM: replay effect, recompute FIFO, KV cache, padding, determinism."""

from __future__ import annotations

import pytest
import torch

from reference_impl import ROUTER_FAMILIES, MoEConfig, MoELM, ReplayError, RoutingMode

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


def _model(family: str = "softmax_topk", **kw) -> MoELM:
    cfg = MoEConfig(**{**SMALL, "router_family": family, **kw})
    return MoELM(cfg)


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed)
    )


def _record(model: MoELM, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.set_routing_mode(RoutingMode.RECORD)
    with torch.no_grad():
        logits = model(input_ids)
    model.set_routing_mode(RoutingMode.NATIVE)
    return logits, model.pop_recording()


def _random_targets(rows: int, layers: int, seed: int, experts: int = 8, k: int = 2):
    scores = torch.rand(rows, layers, experts, generator=torch.Generator().manual_seed(seed))
    return scores.argsort(dim=-1)[..., :k]


def _sets(ids: torch.Tensor) -> list:
    return [frozenset(row) for row in ids.reshape(-1, ids.shape[-1]).tolist()]


def _grads(model: MoELM) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ROUTER_FAMILIES)
def test_replaying_own_recording_is_bit_exact(family):
    model = _model(family, first_k_dense=1, shared_expert=family == "llama4")
    x = _tokens(2, 9)
    logits, trace = _record(model, x)
    assert trace.shape == (18, 2, 2)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    model.set_replay_targets(trace)
    with torch.no_grad():
        replayed = model(x)
    assert torch.equal(replayed, logits)
    assert all(torch.equal(d, trace[:, i]) for i, d in enumerate(model.last_dispatch))


@pytest.mark.parametrize("family", ROUTER_FAMILIES)
def test_replay_dispatches_targets_whatever_the_logits(family):
    model = _model(family)
    x = _tokens(2, 7)
    _, trace = _record(model, x)
    with torch.no_grad():
        for router in model.routers():
            router.gate.weight.neg_()
    _, negated = _record(model, x)
    assert _sets(negated) != _sets(trace)  # natively the routing now differs...
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    model.set_replay_targets(trace)
    with torch.no_grad():
        model(x)
    for ordinal, dispatched in enumerate(model.last_dispatch):  # ...but replay forces it
        assert _sets(dispatched) == _sets(trace[:, ordinal])


@pytest.mark.parametrize("family", ROUTER_FAMILIES)
def test_router_gradient_at_target_the_live_topk_would_not_pick(family):
    model = _model(family)
    x = _tokens(1, 6)
    _, trace = _record(model, x)
    # First MoE layer: its input does not depend on replay, so "live top-k" is well defined.
    live = trace[:, 0]
    unpicked = torch.stack([torch.tensor([e for e in range(8) if e not in row][:2]) for row in live.tolist()])
    targets = trace.clone()
    targets[:, 0] = unpicked
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    model.set_replay_targets(targets)
    model(x).float().pow(2).mean().backward()
    assert torch.equal(model.last_dispatch[0], unpicked)
    grad_norm = model.routers()[0].gate.weight.grad.norm(dim=1)
    for expert in set(unpicked.flatten().tolist()):
        assert grad_norm[expert] > 0, f"no router gradient at target expert {expert}"


@pytest.mark.parametrize("family", ["softmax_topk", "sigmoid_grouped"])
def test_recompute_replays_forward_targets_per_micro_batch(family):
    """Two micro-batches forward under REPLAY_FORWARD, then backward with recompute under
    REPLAY_BACKWARD: each recompute pops its own micro-batch's targets and the gradients equal
    those of the same replay without recompute."""
    micro = [
        (_tokens(2, 5, seed=1), _random_targets(10, 3, seed=1)),
        (_tokens(2, 5, seed=2), _random_targets(10, 3, seed=2)),
    ]

    reference = _model(family)
    reference.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    for x, targets in micro:
        reference.set_replay_targets(targets)
        reference(x).float().pow(2).mean().backward()
    expected = _grads(reference)

    model = _model(family)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    losses = []
    for x, targets in micro:
        model.set_replay_targets(targets)
        losses.append(model(x, use_checkpoint=True).float().pow(2).mean())
    assert all(len(r.replay.backward_targets) == 2 for r in model.routers())
    model.set_routing_mode(RoutingMode.REPLAY_BACKWARD)
    for loss, (_, targets) in zip(losses, micro, strict=True):
        loss.backward()
        for ordinal, dispatched in enumerate(model.last_dispatch):  # set by the recompute
            assert torch.equal(dispatched, targets[:, ordinal])
    assert all(len(r.replay.backward_targets) == 0 for r in model.routers())
    got = _grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_replay_mask_routes_masked_rows_natively():
    model = _model("softmax_topk")
    x = _tokens(2, 6)
    logits, trace = _record(model, x)
    mask = torch.ones(12, dtype=torch.bool)
    mask[[5, 11]] = False  # e.g. the last token of each sample: no row
    filler = trace.clone()
    filler[~mask] = 0  # all-zero rows (invalid) are fine where they are not replayed
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    model.set_replay_targets(filler, mask)
    with torch.no_grad():
        assert torch.equal(model(x), logits)


def test_model_level_replay_errors():
    model = _model("softmax_topk", first_k_dense=1)
    x = _tokens(1, 4)
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    with pytest.raises(ReplayError, match=r"decoder layer 1.*no replay targets"):
        model(x)
    with pytest.raises(ReplayError, match=r"expected \[tokens, 2, 2\]"):
        model.set_replay_targets(torch.zeros(4, 3, 2, dtype=torch.long))
    model.set_replay_targets(_random_targets(5, 2, seed=0))
    with pytest.raises(ReplayError, match=r"expected \[4, 2\]"):
        model(x)
    model.clear_replay()
    assert all(r.replay.targets is None and not r.replay.backward_targets for r in model.routers())
    with pytest.raises(ReplayError, match="cannot pop a recording"):
        model.pop_recording()


def test_pop_recording_concatenates_calls_and_clears():
    model = _model("softmax_topk", first_k_dense=1)
    model.set_routing_mode(RoutingMode.RECORD)
    with torch.no_grad():
        model(_tokens(1, 4))
        model(_tokens(2, 3))
    trace = model.pop_recording()
    assert trace.shape == (10, 2, 2) and trace.dtype == torch.int64
    assert all(not r.replay.recorded for r in model.routers())
    model.routers()[0].replay.recorded.append(torch.tensor([[0, 1]]))  # routers out of step
    with pytest.raises(ReplayError, match=r"entries per router \[1, 0\]"):
        model.pop_recording()


def test_kv_cache_prefill_then_decode_matches_full_forward():
    model = _model("softmax_topk")
    x = _tokens(2, 12)
    full, full_trace = _record(model, x)

    cache = model.new_cache(2)
    model.set_routing_mode(RoutingMode.RECORD)
    with torch.no_grad():
        steps = [model(x[:, :7], cache=cache)]
        prefill_trace = model.pop_recording()
        decode_traces = []
        for t in range(7, 12):
            steps.append(model(x[:, t : t + 1], cache=cache))
            decode_traces.append(model.pop_recording())
    assert cache.length == 12
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    # Rows are b*T + t within each call: rebuild [B, T, layers, k] and compare routing.
    layers = len(model.routers())
    by_sample = torch.cat(
        [prefill_trace.view(2, 7, layers, 2)] + [d.view(2, 1, layers, 2) for d in decode_traces], dim=1
    )
    assert torch.equal(by_sample, full_trace.view(2, 12, layers, 2))


def test_left_padding_gives_unpadded_logits_for_real_tokens():
    model = _model("sigmoid_grouped")
    short, long = _tokens(1, 5, seed=3), _tokens(1, 8, seed=4)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1), long])
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[0, :3] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=attention_mask)
        assert torch.allclose(padded[0, 3:], model(short)[0], atol=1e-5)
        assert torch.allclose(padded[1], model(long)[0], atol=1e-5)


def test_same_config_gives_bit_identical_weights():
    cfg = MoEConfig(**SMALL, router_family="topk_softmax")
    a, b = MoELM(cfg).state_dict(), MoELM(cfg).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = MoELM(MoEConfig(**SMALL, router_family="topk_softmax", seed=1)).state_dict()
    assert not torch.equal(a["embed.weight"], other["embed.weight"])


def test_bfloat16_model_records_and_replays():
    model = _model("softmax_topk_fp32", dtype="bfloat16", shared_expert=True)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = _tokens(2, 6)
    logits, trace = _record(model, x)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
    model.set_replay_targets(trace)
    with torch.no_grad():
        assert torch.equal(model(x), logits)
