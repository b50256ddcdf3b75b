"""The reference rollout engine: row rule, layer axes, decode-vs-prefill, batching, episodes."""

from __future__ import annotations

import pytest
import torch

from reference_impl import ROUTER_FAMILIES, MoEConfig, MoELM, RoutingMode
from reference_impl.engine import RolloutEngine
from reference_impl.episode import AttemptPlan, EpisodeError, Schedule, run_episode
from reference_impl.splice import splice, splice_replace

PROMPTS = [[3, 14, 15], [9, 2, 6, 5, 35, 8, 9], [7, 9, 32, 38]]  # different lengths


def _model(family: str = "softmax_topk", **kw) -> MoELM:
    return MoELM(MoEConfig.tiny(router_family=family, **kw))


def _full_forward(model: MoELM, prompt: list[int], response: torch.Tensor):
    """Routes and log-probs of the sampled tokens from one forward of prompt ⊕ response[:-1]."""
    sequence = torch.tensor(prompt + response.tolist())
    model.set_routing_mode(RoutingMode.RECORD)
    with torch.no_grad():
        logits = model(sequence[None, :-1])[0]
    model.set_routing_mode(RoutingMode.NATIVE)
    logprobs = logits[len(prompt) - 1 :].float().log_softmax(-1).gather(-1, response[:, None])[:, 0]
    return model.pop_recording(), logprobs


@pytest.mark.parametrize("start", [0, 2])
def test_rows_cover_start_to_the_last_fed_position(start):
    model = _model()
    decoder = RolloutEngine(model, layer_axis="decoder", start=start).generate(PROMPTS, 5)
    ordinal = RolloutEngine(model, layer_axis="moe_ordinal", start=start).generate(PROMPTS, 5)
    full = RolloutEngine(model).generate(PROMPTS, 5)
    for prompt, dec, moe, whole in zip(PROMPTS, decoder, ordinal, full, strict=True):
        rows = len(prompt) + 5 - 1 - start
        assert (dec.prompt_len, dec.start, len(dec.tokens), dec.finish_reason) == (
            len(prompt),
            start,
            5,
            "length",
        )
        assert dec.routes.shape == (rows, 3, 2) and dec.routes.dtype == torch.int64
        assert moe.routes.shape == (rows, 2, 2)
        assert torch.equal(dec.routes[:, 0], torch.zeros(rows, 2, dtype=torch.int64))  # dense
        assert torch.equal(dec.routes[:, 1:], moe.routes)
        assert torch.equal(dec.routes, whole.routes[start:])  # the crop is the tail
        assert ((moe.routes >= 0) & (moe.routes < 8)).all()


def test_stop_token_ends_a_sample_and_cuts_its_rows():
    model = _model()
    free = RolloutEngine(model).generate(PROMPTS, 6)
    stop = int(free[1].tokens[2])
    first = int((free[1].tokens == stop).nonzero()[0])  # where sample 1 samples it first
    stopped = RolloutEngine(model).generate(PROMPTS, 6, stop_token=stop)
    assert stopped[1].finish_reason == "stop" and len(stopped[1].tokens) == first + 1
    for prompt, before, after in zip(PROMPTS, free, stopped, strict=True):
        length = len(after.tokens)
        assert torch.equal(after.tokens, before.tokens[:length])
        assert after.routes.shape[0] == len(prompt) + length - 1
        assert torch.equal(after.routes, before.routes[: after.routes.shape[0]])
        assert after.finish_reason == ("stop" if int(after.tokens[-1]) == stop else "length")


def test_zero_new_tokens_runs_no_forward_and_leaves_the_routers_as_they_were():
    model = _model()
    model.set_routing_mode(RoutingMode.RECORD)
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]))  # a recording the caller has not popped yet
    rollouts = RolloutEngine(model).generate(PROMPTS, 0)
    assert [(len(r.tokens), r.routes, r.finish_reason) for r in rollouts] == [(0, None, "length")] * 3
    RolloutEngine(model).generate(PROMPTS, 3)
    assert all(router.replay.mode is RoutingMode.RECORD for router in model.routers())
    assert model.pop_recording().shape == (3, 2, 2)  # only the caller's own forward


@pytest.mark.parametrize("family", ROUTER_FAMILIES)
def test_fp32_decode_routes_and_logprobs_equal_a_full_forward(family):
    model = _model(family, shared_expert=family == "llama4")
    engine = RolloutEngine(model, layer_axis="moe_ordinal")
    rollouts = engine.generate(PROMPTS, 8, greedy=False, generator=torch.Generator().manual_seed(1))
    for prompt, rollout in zip(PROMPTS, rollouts, strict=True):
        routes, logprobs = _full_forward(model, prompt, rollout.tokens)
        assert torch.equal(rollout.routes, routes)  # DESIGN §6: decode-vs-prefill never flips
        assert rollout.logprobs.dtype == torch.float32
        torch.testing.assert_close(rollout.logprobs, logprobs, atol=1e-5, rtol=0)


def test_a_sample_in_a_padded_batch_equals_the_sample_alone():
    model = _model()
    engine = RolloutEngine(model)
    batched = engine.generate(PROMPTS, 6)
    for prompt, in_batch in zip(PROMPTS, batched, strict=True):
        alone = engine.generate([torch.tensor(prompt)], 6)[0]
        assert torch.equal(in_batch.tokens, alone.tokens)
        assert torch.equal(in_batch.routes, alone.routes)
        torch.testing.assert_close(in_batch.logprobs, alone.logprobs, atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible():
    engine = RolloutEngine(_model())

    def sample(seed: int):
        return engine.generate(PROMPTS, 8, greedy=False, generator=torch.Generator().manual_seed(seed))

    first, again, other = sample(5), sample(5), sample(6)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routes, b.routes)
        assert torch.equal(a.logprobs, b.logprobs)
    assert any(not torch.equal(a.tokens, c.tokens) for a, c in zip(first, other, strict=True))


def _perturb_routers(model: MoELM, version: int = 1) -> None:
    """A weight update between attempts that changes routing (fully-async RL)."""
    gen = torch.Generator().manual_seed(6 + version)
    with torch.no_grad():
        for router in model.routers():
            router.gate.weight.add_(0.5 * torch.randn(router.gate.weight.shape, generator=gen))


def test_episode_attempts_add_up_and_the_splice_keeps_the_live_rows():
    prompt = PROMPTS[1]
    plans = (
        AttemptPlan(4, finish_reason="abort"),
        AttemptPlan(0, finish_reason="abort"),
        AttemptPlan(3, tool_tokens=(5, 6), update_weights=True, finish_reason="length"),
    )
    engine = RolloutEngine(_model())
    episode = run_episode(
        engine.generate_one,
        Schedule(tuple(prompt), plans),
        update_weights=lambda version: _perturb_routers(engine.model, version),
    )
    P, attempts = len(prompt), episode.attempts
    assert [a.new_tokens for a in attempts] == [4, 0, 2 + 3]
    assert sum(a.new_tokens for a in attempts) == len(episode.tokens) - P
    assert [a.finish_reason for a in attempts] == ["abort", "abort", "length"]
    assert attempts[1].routes is None
    assert attempts[0].routes.shape[0] == P + 4 - 1 and attempts[2].routes.shape[0] == P + 9 - 1
    assert episode.tokens[P + 4 : P + 6].tolist() == [5, 6]
    assert episode.sampled_mask.tolist() == [True] * 4 + [False] * 2 + [True] * 3
    assert (episode.response_logprobs[~episode.sampled_mask] == 0).all()
    assert (episode.response_logprobs[episode.sampled_mask] < 0).all()

    # The re-prefill under the new weights routes some earlier position differently ...
    early = P + 4 - 1
    assert not torch.equal(attempts[2].routes[:early], attempts[0].routes)
    # ... so the splice (rows live when each token was consumed) and the latest payload differ.
    trace = splice(P, attempts)
    assert trace.shape[0] == P + 9 - 1 == len(episode.tokens) - 1
    assert torch.equal(trace[:early], attempts[0].routes)
    assert torch.equal(trace[early:], attempts[2].routes[early:])
    assert not torch.equal(trace, splice_replace(P, attempts))


def test_episode_without_weight_updates_splices_to_a_single_generation():
    model, prompt = _model(), PROMPTS[0]
    engine = RolloutEngine(model)
    plans = (AttemptPlan(3, finish_reason="abort"), AttemptPlan(2, finish_reason="abort"), AttemptPlan(4))
    episode = run_episode(engine.generate_one, Schedule(tuple(prompt), plans))
    single = engine.generate([prompt], 9)[0]
    assert torch.equal(episode.tokens[len(prompt) :], single.tokens)
    trace = splice(len(prompt), episode.attempts)
    assert torch.equal(trace, single.routes)  # fp32: re-prefill reproduces decode routing
    assert torch.equal(trace, splice_replace(len(prompt), episode.attempts))
    torch.testing.assert_close(episode.response_logprobs, single.logprobs, atol=1e-5, rtol=0)


def test_tool_tokens_of_a_zero_budget_attempt_count_for_the_attempt_that_prefills_them():
    prompt = PROMPTS[2]
    plans = (
        AttemptPlan(2),
        AttemptPlan(0, tool_tokens=(5, 6)),
        AttemptPlan(2),
        AttemptPlan(0, tool_tokens=(11,)),
    )
    episode = run_episode(RolloutEngine(_model()).generate_one, Schedule(tuple(prompt), plans))
    assert [a.kind for a in episode.attempts] == ["start", "turn", "turn", "turn"]
    assert [a.new_tokens for a in episode.attempts] == [2, 0, 2 + 2, 0]
    assert len(episode.tokens) == len(prompt) + 2 + 2 + 2 + 1  # trailing tool token: no row
    assert splice(len(prompt), episode.attempts).shape[0] == len(episode.tokens) - 1 - 1
    assert episode.sampled_mask.tolist() == [True, True, False, False, True, True, False]


def test_invalid_requests_are_refused():
    model = _model()
    with pytest.raises(EpisodeError, match="start = 2"):
        run_episode(
            RolloutEngine(model, start=2).generate_one, Schedule(tuple(PROMPTS[0]), (AttemptPlan(1),))
        )
    with pytest.raises(EpisodeError, match="update_weights"):
        run_episode(RolloutEngine(model).generate_one, Schedule((1,), (AttemptPlan(1, update_weights=True),)))
    with pytest.raises(EpisodeError, match="finish_reason"):
        AttemptPlan(1, finish_reason="aborted")
    with pytest.raises(EpisodeError, match="at most max_new_tokens = 1"):
        run_episode(
            lambda context, budget: RolloutEngine(model).generate_one(context, 2),
            Schedule((1,), (AttemptPlan(1),)),
        )
    with pytest.raises(ValueError, match="start = 4"):
        RolloutEngine(model, start=4).generate(PROMPTS, 1)
    with pytest.raises(ValueError, match="layer_axis"):
        RolloutEngine(model, layer_axis="moe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        RolloutEngine(model).generate([[]], 1)
