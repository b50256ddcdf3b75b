"""The reference MoE LM by hand: replay error texts, recordings, KV cache, padding, determinism.

The replay properties (targets reach the experts, bit-exact replay, gradients at unpicked targets,
recompute FIFO, masked rows native) are checked on every router family in ``suites/test_replay.py``.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl import MoEConfig, MoELM, ReplayError, RoutingMode


def _model(family: str = "softmax_topk", **kw) -> MoELM:
    return MoELM(MoEConfig.tiny(router_family=family, **kw))


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, MoEConfig.tiny().vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed)
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


def test_model_level_replay_errors():
    model = _model("softmax_topk")
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
    model = _model("softmax_topk")
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
    cfg = MoEConfig.tiny(router_family="topk_softmax")
    a, b = MoELM(cfg).state_dict(), MoELM(cfg).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    other = MoELM(MoEConfig.tiny(router_family="topk_softmax", seed=1)).state_dict()
    assert not torch.equal(a["embed.weight"], other["embed.weight"])
