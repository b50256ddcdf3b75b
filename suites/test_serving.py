"""What an engine captures while it serves (DESIGN §2, §3.1; FACTS §4): the subject's ``serving`` engine.

The row rule holds whatever the engine does to serve faster: a greedy request of prompt length P that
sampled R tokens returns one row per fed position ``[0, P + R − 1)``, and row p is the routing of the
model, under the weights live when p was fed, for position p. The harness builds the model, hands
it to the subject's engine, and judges every returned row against its own full forward of
``prompt ⊕ tokens[:-1]`` (fp32: DESIGN §6, a chunk, a cached and a full forward route alike), so
nothing the engine says about itself is taken on trust. Under:

- chunked prefill: every chunk's rows at their own positions (TensorRT-LLM #18397 review: at row 0);
- n-gram speculative decoding: the accepted path's rows only, in order (SGLang #37949), on prompts
  that repeat so that drafts are proposed, accepted and rejected;
- a prefix route store across a weight update: no row routed by the old weights (vLLM 0.31+'s route
  store keeps a block's rows until a prefix-cache reset);
- prefill/decode disaggregation: the decode replica returns the prefill replica's prompt rows and its
  own from P on (llm-d-router #1473, vLLM RFC #55584).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from harness.subjects import Subject
from harness.subjects.capabilities import ServedEngine, missing_members
from harness.testing.asserts import assert_same_routes
from harness.testing.judge import as_ids
from harness.testing.suite import require
from reference_impl import MoEConfig, MoELM, RoutingMode

pytestmark = pytest.mark.capability("serving")

MODEL = MoELM(MoEConfig.tiny())
"""The served model (fp32, 8 experts top-2, one dense layer first); each test serves a copy."""


def _engine(subject: Subject, model: MoELM, **features: Any) -> Any:
    """The subject's engine on ``model`` with ``features``; a skip naming what it lacks."""
    engine = require(subject, "serving")(model, **features)
    missing = missing_members(engine, ServedEngine)
    if missing:
        pytest.skip(
            f"subject {subject.name!r}: its serving engine has no {', '.join(missing)} (ServedEngine)"
        )
    return engine


def _repeating_prompt(pattern_len: int, repeats: int, seed: int) -> list[int]:
    """A prompt that repeats a random pattern: n-gram lookup finds drafts in it."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randint(3, MODEL.cfg.vocab_size, (pattern_len,), generator=gen).tolist()
    return pattern * repeats + pattern[: pattern_len // 2]


def _native_rows(model: MoELM, prompt: list[int], tokens: torch.Tensor) -> torch.Tensor:
    """The harness's own routing of ``prompt ⊕ tokens[:-1]``: one full forward in RECORD."""
    sequence = torch.tensor([*prompt, *tokens.tolist()][:-1])[None]
    model.set_routing_mode(RoutingMode.RECORD)
    try:
        with torch.no_grad():
            model(sequence)
        return model.pop_recording()
    finally:
        model.set_routing_mode(RoutingMode.NATIVE)


def _judge(answer: Any, prompt: list[int], max_new_tokens: int, model: MoELM, where: str) -> None:
    """``answer`` has R = ``max_new_tokens`` tokens and P + R − 1 rows, each ``model``'s own routing."""
    tokens = as_ids(torch.as_tensor(answer.tokens), f"{where}: tokens")
    assert tokens.shape == (max_new_tokens,), (
        f"{where}: {tokens.shape[0]} tokens sampled, expected {max_new_tokens} (greedy, no stop token)"
    )
    routes = as_ids(torch.as_tensor(answer.routes), f"{where}: routes")
    expected = len(prompt) + max_new_tokens - 1
    assert routes.shape[0] == expected, (
        f"{where}: {routes.shape[0]} rows, expected P + R − 1 = {len(prompt)} + {max_new_tokens} − 1 = "
        f"{expected} (one per fed position)"
    )
    assert_same_routes(
        routes,
        _native_rows(model, prompt, tokens),
        names=("served", "the model's own routing"),
        what=where,
        axes=("position", "MoE ordinal"),
    )


@settings(max_examples=12)
@given(prompt_len=st.integers(1, 40), chunk=st.integers(1, 16), max_new_tokens=st.integers(1, 6))
@example(prompt_len=37, chunk=8, max_new_tokens=3)
def test_chunked_prefill_writes_each_chunks_rows_at_its_positions(
    subject: Subject, prompt_len: int, chunk: int, max_new_tokens: int
) -> None:
    """A prompt prefilled in chunks returns each position's own row, whichever chunk computed it."""
    where = f"prompt of {prompt_len} tokens prefilled in chunks of {chunk}, {max_new_tokens} new tokens"
    note(f"counterexample: {where}")
    prompt = _repeating_prompt(max(1, prompt_len), 1, seed=prompt_len)[:prompt_len]
    engine = _engine(subject, copy.deepcopy(MODEL), prefill_chunk=chunk)
    _judge(engine.generate(prompt, max_new_tokens), prompt, max_new_tokens, MODEL, where)


@settings(max_examples=12)
@given(
    pattern_len=st.integers(2, 8),
    drafts=st.integers(1, 5),
    ngram=st.integers(1, 3),
    max_new_tokens=st.integers(2, 24),
    seed=st.integers(0, 2**16),
)
@example(pattern_len=6, drafts=3, ngram=2, max_new_tokens=20, seed=0)
def test_speculative_decoding_returns_the_accepted_paths_rows(
    subject: Subject, pattern_len: int, drafts: int, ngram: int, max_new_tokens: int, seed: int
) -> None:
    """With n-gram drafts verified in one forward, the rows are those of the tokens kept, in order:
    no row of a rejected draft, none missing for an accepted one."""
    prompt = _repeating_prompt(pattern_len, 3, seed)
    where = (
        f"prompt of {len(prompt)} tokens repeating a {pattern_len}-token pattern (seed {seed}), "
        f"{drafts} n-gram drafts per step (n = {ngram}), {max_new_tokens} new tokens"
    )
    note(f"counterexample: {where}")
    engine = _engine(subject, copy.deepcopy(MODEL), speculative_tokens=drafts, ngram=ngram)
    _judge(engine.generate(prompt, max_new_tokens), prompt, max_new_tokens, MODEL, where)


def _negated_routers(model: MoELM) -> dict[str, torch.Tensor]:
    """``model``'s weights with every router weight negated: live routing prefers other experts."""
    return {
        name: -value if name.endswith("router.gate.weight") else value.clone()
        for name, value in model.state_dict().items()
    }


@settings(max_examples=8)
@given(block=st.integers(1, 16), shared=st.integers(1, 40), seed=st.integers(0, 2**16))
@example(block=8, shared=32, seed=0)
def test_a_weight_update_serves_no_stale_prefix_rows(
    subject: Subject, block: int, shared: int, seed: int
) -> None:
    """A prompt prefix served before a weight update, served again after it: every row is the routing
    of the new weights (whatever the engine keeps across the update, the rows must not be the old)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, MODEL.cfg.vocab_size, (shared,), generator=gen).tolist()
    first, second = [*prefix, 3, 4], [*prefix, 5, 6, 7]
    where = f"prefix of {shared} tokens served in blocks of {block}, then again after a weight update"
    note(f"counterexample: {where}")
    engine = _engine(subject, copy.deepcopy(MODEL), prefix_block=block)
    _judge(engine.generate(first, 3), first, 3, MODEL, f"{where}: the first request")
    updated = copy.deepcopy(MODEL)
    updated.load_state_dict(_negated_routers(MODEL))
    engine.load_weights(_negated_routers(MODEL))
    _judge(engine.generate(second, 3), second, 3, updated, f"{where}: the request after the update")


@settings(max_examples=8)
@given(
    prompt_len=st.integers(1, 40),
    chunk=st.sampled_from([None, 4, 16]),
    drafts=st.integers(0, 3),
    max_new_tokens=st.integers(1, 12),
)
@example(prompt_len=20, chunk=None, drafts=0, max_new_tokens=6)
def test_a_decode_replica_returns_the_prefill_replicas_prompt_rows(
    subject: Subject, prompt_len: int, chunk: int | None, drafts: int, max_new_tokens: int
) -> None:
    """Prefill on one engine, decode on another (the KV handed over): the prompt rows are those of the
    replica that ran the prompt, the rest the decode replica's, with no row lost or doubled at P."""
    prompt = _repeating_prompt(4, 1 + prompt_len // 4, seed=prompt_len)[:prompt_len]
    where = (
        f"prompt of {prompt_len} tokens prefilled on one replica (chunks of {chunk}), decoded on another "
        f"({drafts} drafts per step), {max_new_tokens} new tokens"
    )
    note(f"counterexample: {where}")
    prefill_replica = _engine(subject, copy.deepcopy(MODEL), prefill_chunk=chunk)
    decode_replica = _engine(subject, copy.deepcopy(MODEL), speculative_tokens=drafts)
    answer = decode_replica.decode(prefill_replica.prefill(prompt), max_new_tokens)
    _judge(answer, prompt, max_new_tokens, MODEL, where)
