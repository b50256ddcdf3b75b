"""The reference serving engine: its features really run, and serve what the plain engine serves."""

from __future__ import annotations

import copy

import pytest
import torch

from reference_impl import MoEConfig, MoELM, RolloutEngine
from reference_impl.serving import ServingEngine

MODEL = MoELM(MoEConfig.tiny())
PROMPT = [7, 11, 13, 17, 19, 23] * 3 + [7, 11]


def _forwards(engine: ServingEngine) -> list[int]:
    """Tokens fed per forward of ``engine``'s model, counted by a hook (what the engine did, observed)."""
    fed: list[int] = []
    engine.model.register_forward_hook(lambda _m, args, _out: fed.append(args[0].shape[1]))
    return fed


def test_every_feature_serves_what_the_plain_engine_serves() -> None:
    plain = RolloutEngine(MODEL).generate_one(PROMPT, 16)
    for features in ({"prefill_chunk": 5}, {"prefix_block": 4}, {"speculative_tokens": 3}, {}):
        served = ServingEngine(copy.deepcopy(MODEL), **features).generate(PROMPT, 16)
        assert torch.equal(served.tokens, plain.tokens), features
        assert torch.equal(served.routes, plain.routes[:, 1:]), features  # MoE-ordinal rows
        torch.testing.assert_close(served.logprobs, plain.logprobs)


def test_speculation_accepts_and_rejects_drafts() -> None:
    """On a repeating prompt some steps keep several tokens and some feed drafts they then reject."""
    engine = ServingEngine(copy.deepcopy(MODEL), speculative_tokens=3, ngram=1)
    fed = _forwards(engine)
    answer = engine.generate(PROMPT, 24)
    decode_steps = fed[1:]
    assert len(decode_steps) < 23, f"no draft accepted: {decode_steps}"  # 23 forwards without speculation
    assert sum(decode_steps) > answer.tokens.shape[0] - 1, f"no draft rejected: {decode_steps}"


def test_chunks_and_the_store_change_the_forwards_not_the_rows() -> None:
    engine = ServingEngine(copy.deepcopy(MODEL), prefill_chunk=8, prefix_block=4)
    fed = _forwards(engine)
    first = engine.generate(PROMPT, 2)
    assert fed[:3] == [8, 8, 4], fed
    assert len(engine.store) == len(PROMPT) // 4
    again = engine.generate(PROMPT, 2)
    assert torch.equal(again.routes, first.routes)


def test_disaggregated_request_equals_one_engines() -> None:
    whole = ServingEngine(copy.deepcopy(MODEL)).generate(PROMPT, 8)
    prefill, decode = ServingEngine(copy.deepcopy(MODEL)), ServingEngine(copy.deepcopy(MODEL))
    split = decode.decode(prefill.prefill(PROMPT), 8)
    assert torch.equal(split.tokens, whole.tokens) and torch.equal(split.routes, whole.routes)


def test_a_weight_update_empties_the_store() -> None:
    engine = ServingEngine(copy.deepcopy(MODEL), prefix_block=4)
    engine.generate(PROMPT, 2)
    engine.load_weights(MODEL.state_dict())
    assert engine.store == {}


@pytest.mark.parametrize(
    ("features", "words"),
    [
        ({"prefill_chunk": 0}, "prefill_chunk = 0"),
        ({"prefix_block": -1}, "prefix_block = -1"),
        ({"speculative_tokens": -1}, "speculative_tokens = -1"),
        ({"ngram": 0}, "ngram = 0"),
    ],
)
def test_bad_features_are_refused(features: dict[str, int], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ServingEngine(MODEL, **features)


def test_bad_requests_are_refused() -> None:
    engine = ServingEngine(copy.deepcopy(MODEL))
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([], 2)
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        engine.generate(PROMPT, 0)
    cache = MODEL.new_cache(1)
    with pytest.raises(ValueError, match="truncate to 1"):
        cache.truncate(1)
