"""Engine conventions: each engine's real payload bytes decode to the canonical trace (DESIGN §3.1–3.2)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from harness.strategies import EnginePayload, engine_payloads
from harness.subjects import Subject
from suites.conftest import require


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


@settings(max_examples=200)
@given(sample=engine_payloads())
def test_payload_decodes_to_the_routes_the_engine_sent(subject: Subject, sample: EnginePayload) -> None:
    """Every convention's payload decodes to the routes the engine sent, position by position."""
    trace = _decode(subject, sample)
    moe = list(sample.model.moe_layers)
    decoded = trace.to_decoder_axis().experts[:, moe, :].astype(np.int64)
    assert np.array_equal(decoded, sample.routes[:, moe, :]), f"{sample.describe()}: routes differ"


@given(sample=engine_payloads())
def test_decoded_trace_covers_the_engine_row_rule(subject: Subject, sample: EnginePayload) -> None:
    """Decoded rows cover positions [start, P + R − 1), in the narrowest dtype, with provenance."""
    trace = _decode(subject, sample)
    trace.check_coverage(sample.prompt_len, sample.response_len)
    assert trace.start == sample.start, f"{sample.describe()}: start {trace.start}"
    expected_dtype = np.uint8 if sample.model.num_experts <= 256 else np.uint16
    assert trace.experts.dtype == expected_dtype, f"{sample.describe()}: stored as {trace.experts.dtype}"
    assert (trace.provenance.engine, trace.provenance.version) == (sample.engine, sample.version)
