"""Engine conventions: each engine's real payload bytes decode to the canonical trace (DESIGN §3.1–3.2)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, note, settings

from harness.conventions import ModelSpec
from harness.strategies import EnginePayload, engine_payloads
from harness.subjects import Subject
from harness.testing.asserts import assert_same_routes
from harness.testing.suite import require

pytestmark = pytest.mark.capability("decode_payload")


def _decode(subject: Subject, sample: EnginePayload):  # type: ignore[no-untyped-def]
    decode = require(subject, "decode_payload")
    return decode(
        sample.engine,
        sample.version,
        sample.payload,
        model=sample.model,
        prompt_len=sample.prompt_len,
        response_len=sample.response_len,
        start=sample.start,
    )


def vllm_payload(num_experts: int, top_k: int, prompt_len: int, response_len: int) -> EnginePayload:
    """A vLLM 0.18 int32 payload (decoder axis, layer 0 dense) whose ids are all below 256 and distinct
    per route: pins the boundaries a derandomised profile may never draw."""
    rows = prompt_len + response_len - 1
    routes = np.zeros((rows, 2, top_k), dtype=np.int64)
    routes[:, 1, :] = (np.arange(rows)[:, None] + np.arange(top_k)[None, :]) % min(num_experts, 256)
    model = ModelSpec(2, num_experts, top_k, (1,))
    return EnginePayload(
        "vllm", "0.18.0", routes.astype(np.int32), model, prompt_len, response_len, 0, routes, "int32 ndarray"
    )


BOUNDARY_PAYLOADS = (
    vllm_payload(257, 2, 3, 2),  # storage follows num_experts (uint16), not the largest id (< 256)
    vllm_payload(8, 1, 2, 1),  # top_k = 1, a one-token response
    vllm_payload(4, 4, 1, 3),  # top_k = num_experts
)


@settings(max_examples=200)
@given(sample=engine_payloads())
@example(sample=BOUNDARY_PAYLOADS[0])
@example(sample=BOUNDARY_PAYLOADS[1])
@example(sample=BOUNDARY_PAYLOADS[2])
def test_payload_decodes_to_the_routes_the_engine_sent(subject: Subject, sample: EnginePayload) -> None:
    """Every convention's payload decodes to the routes the engine sent, position by position."""
    note(f"counterexample: {sample.describe()}")
    trace = _decode(subject, sample)
    moe = list(sample.model.moe_layers)
    assert_same_routes(
        trace.to_decoder_axis().experts[:, moe, :],
        sample.routes[:, moe, :],
        names=("decoded", "sent"),
        what=sample.describe(),
        axes=("row", "MoE ordinal"),
    )


@given(sample=engine_payloads())
@example(sample=BOUNDARY_PAYLOADS[0])
@example(sample=BOUNDARY_PAYLOADS[1])
@example(sample=BOUNDARY_PAYLOADS[2])
def test_decoded_trace_covers_the_engine_row_rule(subject: Subject, sample: EnginePayload) -> None:
    """Decoded rows cover positions [start, P + R − 1), in the narrowest dtype, with provenance."""
    note(f"counterexample: {sample.describe()}")
    trace = _decode(subject, sample)
    trace.check_coverage(sample.prompt_len, sample.response_len)
    assert trace.start == sample.start, f"{sample.describe()}: start {trace.start}, expected {sample.start}"
    expected_dtype = np.uint8 if sample.model.num_experts <= 256 else np.uint16
    assert trace.experts.dtype == expected_dtype, (
        f"{sample.describe()}: stored as {trace.experts.dtype}, expected {np.dtype(expected_dtype)} "
        f"(the narrowest dtype that holds num_experts = {sample.model.num_experts})"
    )
    got = (trace.provenance.engine, trace.provenance.version)
    assert got == (sample.engine, sample.version), (
        f"{sample.describe()}: provenance (engine, version) {got}, expected {(sample.engine, sample.version)}"
    )


@given(sample=engine_payloads())
@example(sample=BOUNDARY_PAYLOADS[0])
@example(sample=BOUNDARY_PAYLOADS[2])
def test_a_payload_of_another_row_count_is_refused(subject: Subject, sample: EnginePayload) -> None:
    """A payload one row short of the engine's rule for the lengths given, or two rows over it, is a
    convention violation (DESIGN §3.1): decoding raises (any exception, in the subject's words); it
    never hands back rows padded with copies or cut to fit."""
    note(f"counterexample: {sample.describe()}")
    decode = require(subject, "decode_payload")
    told = [sample.response_len + 1] + ([sample.response_len - 2] if sample.response_len >= 3 else [])
    for response_len in told:
        try:
            trace = decode(
                sample.engine, sample.version, sample.payload, model=sample.model,
                prompt_len=sample.prompt_len, response_len=response_len, start=sample.start,
            )  # fmt: skip
        except Exception:
            continue
        expected = sample.prompt_len + response_len - 1 - sample.start
        raise AssertionError(
            f"{sample.describe()}: told {response_len} generated tokens, the rule expects {expected} rows; "
            f"the payload holds {len(sample.routes)}, yet decoding returned {trace.experts.shape[0]} rows: "
            "expected it refused"
        )
