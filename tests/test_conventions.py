"""Tests of harness.conventions: real engine payload bytes in, canonical traces out, every
malformed payload a ConventionError, and version resolution at the range boundaries."""

from __future__ import annotations

import base64
import dataclasses
import io
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from harness.conventions import (
    CONVENTIONS,
    SGLANG,
    VLLM_0_14,
    VLLM_0_16,
    VLLM_0_21,
    VLLM_0_22,
    VLLM_0_27,
    VLLM_0_31,
    Convention,
    ModelSpec,
    decode_payload,
    decode_sglang_meta,
    decode_vllm_021,
    decode_vllm_http,
    encode_sglang_b64,
    encode_vllm_npy_b64,
    format_range,
    resolve,
)
from harness.errors import ConventionError, HarnessError, TraceError
from harness.trace import LayerAxis, RoutingTrace

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------------------------
# samples: a model, lengths, and the canonical routes of positions [start, P + R − 1)
# --------------------------------------------------------------------------------------------


@dataclass
class Sample:
    model: ModelSpec
    prompt_len: int
    response_len: int
    start: int
    decoder: np.ndarray  # [rows, num_layers, k] int64, dense slots 0 (decoder axis)

    @property
    def moe(self) -> np.ndarray:  # [rows, num_moe_layers, k] (MoE-ordinal axis)
        return self.decoder[:, list(self.model.moe_layers), :]

    @property
    def rows(self) -> int:
        return self.decoder.shape[0]


def make_routes(rng: np.random.Generator, rows: int, model: ModelSpec) -> np.ndarray:
    """Distinct ids per (row, MoE layer) route; dense-layer slots 0."""
    full = np.zeros((rows, model.num_layers, model.top_k), dtype=np.int64)
    moe = list(model.moe_layers)
    if rows and moe:
        keys = rng.random((rows, len(moe), model.num_experts))
        full[:, moe, :] = np.argsort(keys, axis=-1)[..., : model.top_k]
    return full


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    num_layers = draw(st.integers(1, 4))
    dense_first = draw(st.integers(0, num_layers - 1))
    num_experts = draw(st.sampled_from([1, 2, 3, 8, 16, 255, 256, 257, 300]))
    top_k = draw(
        st.one_of(st.just(1), st.just(num_experts), st.integers(1, min(num_experts, 8)))
        if num_experts <= 16
        else st.integers(1, 4)
    )
    return ModelSpec(num_layers, num_experts, top_k, tuple(range(dense_first, num_layers)))


@st.composite
def samples(draw: st.DrawFn, with_start: bool = True) -> Sample:
    model = draw(models())
    prompt_len = draw(st.integers(1, 6))
    response_len = draw(st.sampled_from([0, 1, 2, 3, 5]))
    start = draw(st.integers(0, prompt_len + response_len - 1)) if with_start else 0
    rows = prompt_len + response_len - 1 - start
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return Sample(model, prompt_len, response_len, start, make_routes(rng, rows, model))


def kw(s: Sample, start: bool = True) -> dict[str, object]:
    out: dict[str, object] = dict(model=s.model, prompt_len=s.prompt_len, response_len=s.response_len)
    if start:
        out["start"] = s.start
    return out


def vllm022_dtype(model: ModelSpec) -> type:
    return np.uint8 if model.num_experts <= 256 else np.uint16


# payload builders, each the way the engine builds it


def vllm014_payload(s: Sample) -> np.ndarray:
    return s.decoder.astype(np.int32)


def vllm021_payload(s: Sample, http: bool) -> tuple[object, object]:
    moe = s.moe.astype(np.int16)
    n_prompt = min(s.prompt_len, s.prompt_len + s.response_len - 1)
    prompt, generated = moe[:n_prompt], moe[n_prompt:]
    return (prompt.tolist(), generated.tolist()) if http else (prompt, generated)


def vllm022_array(s: Sample) -> np.ndarray:
    return s.decoder.astype(vllm022_dtype(s.model))


def check_trace(trace: RoutingTrace, s: Sample, conv: Convention, version: str = "") -> None:
    assert isinstance(trace, RoutingTrace)
    assert trace.layer_axis is conv.layer_axis
    expected = s.decoder if conv.layer_axis is LayerAxis.DECODER else s.moe
    assert trace.experts.shape == expected.shape
    assert np.array_equal(trace.experts, expected)
    assert trace.start == s.start
    assert trace.num_layers == s.model.num_layers
    assert trace.num_experts == s.model.num_experts
    assert trace.moe_layers == s.model.moe_layers
    assert trace.provenance.engine == conv.engine
    assert trace.provenance.convention == conv.name
    assert trace.provenance.version == version
    trace.check_coverage(s.prompt_len, s.response_len)
    # the MoE routes agree whatever the axis
    assert np.array_equal(trace.moe_routes(), s.moe)


# --------------------------------------------------------------------------------------------
# round trips on real payload bytes, per convention
# --------------------------------------------------------------------------------------------


@FAST
@given(samples(with_start=False), st.sampled_from([VLLM_0_14, VLLM_0_16]), st.booleans())
def test_vllm_014_020_int32_ndarray(s: Sample, conv: Convention, read_only: bool) -> None:
    payload = vllm014_payload(s)
    payload.flags.writeable = not read_only
    version = "0.14.1" if conv is VLLM_0_14 else "0.20.5"
    trace = decode_payload("vllm", version, payload, **kw(s))
    check_trace(trace, s, conv, version)
    assert conv.logical_ids is (conv is VLLM_0_16)


@FAST
@given(samples(with_start=False), st.booleans())
def test_vllm_021_split_prompt_then_generated(s: Sample, http: bool) -> None:
    prompt, generated = vllm021_payload(s, http)
    trace = decode_vllm_021(prompt, generated, **kw(s, start=False))
    check_trace(trace, s, VLLM_0_21, "0.21.0")
    assert trace.experts.shape[1] == len(s.model.moe_layers)  # MoE ordinal, not num_layers


def test_vllm_021_concatenates_prompt_rows_first() -> None:
    model = ModelSpec(3, 4, 2, (1, 2))  # layer 0 dense
    prompt = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], dtype=np.int16)  # P = 2
    generated = np.array([[[3, 2], [1, 0]]], dtype=np.int16)  # R = 2 → 1 generated row
    trace = decode_vllm_021(prompt, generated, model=model, prompt_len=2, response_len=2)
    assert trace.experts.tolist() == prompt.tolist() + generated.tolist()
    assert trace.to_decoder_axis().experts[:, 0].tolist() == [[0, 0]] * 3


def test_vllm_021_generated_none_allowed_only_when_no_generated_rows() -> None:
    model = ModelSpec(1, 4, 2)
    prompt = [[[0, 1]], [[2, 3]]]
    trace = decode_vllm_021(prompt, None, model=model, prompt_len=2, response_len=1)
    assert trace.rows == 2
    with pytest.raises(ConventionError, match=r"CompletionOutput\.routed_experts is None"):
        decode_vllm_021(prompt, None, model=model, prompt_len=2, response_len=2)
    with pytest.raises(ConventionError, match="prompt_routed_experts is None"):
        decode_vllm_021(None, [], model=model, prompt_len=2, response_len=1)


@FAST
@given(samples())
def test_vllm_022_in_process_ndarray(s: Sample) -> None:
    payload = vllm022_array(s)
    payload.flags.writeable = False
    trace = VLLM_0_22.decode(payload, **kw(s), version="0.22.0")
    check_trace(trace, s, VLLM_0_22, "0.22.0")


@FAST
@given(samples(), st.booleans())
def test_vllm_022_http_npy_base64(s: Sample, fortran: bool) -> None:
    array = vllm022_array(s)
    if fortran:
        array = np.asfortranarray(array)
    field = encode_vllm_npy_b64(array)
    # the documented client decode gives the same array
    assert np.array_equal(np.load(io.BytesIO(base64.b64decode(field)), allow_pickle=False), array)
    trace = decode_vllm_http(field, **kw(s), version="0.26.3")
    check_trace(trace, s, VLLM_0_22, "0.26.3")
    # the generic entry point takes the same string
    check_trace(decode_payload("vllm", "0.22.0", field, **kw(s)), s, VLLM_0_22, "0.22.0")


@FAST
@given(samples())
def test_sglang_base64_int32(s: Sample) -> None:
    b64 = encode_sglang_b64(s.decoder)
    raw = base64.b64decode(b64)
    assert len(raw) == 4 * s.decoder.size
    # what SGLang's clients do, a read-only array
    flat = np.frombuffer(raw, dtype=np.int32)
    assert not flat.flags.writeable
    assert np.array_equal(flat.reshape(-1, s.model.num_layers, s.model.top_k), s.decoder)
    trace = decode_sglang_meta(b64, **kw(s), version="0.5.6.post2")
    check_trace(trace, s, SGLANG, "0.5.6.post2")
    check_trace(decode_sglang_meta(b64.encode("ascii"), **kw(s)), s, SGLANG, "")


def test_uint8_vs_uint16_boundary() -> None:
    for experts, dtype in ((256, np.uint8), (257, np.uint16)):
        model = ModelSpec(2, experts, 2)
        assert VLLM_0_22.emitted_dtype(model) == np.dtype(dtype)
        routes = np.array([[[experts - 1, 0], [experts - 2, 1]]], dtype=dtype)
        trace = decode_vllm_http(encode_vllm_npy_b64(routes), model=model, prompt_len=1, response_len=1)
        assert trace.experts.tolist() == routes.tolist()  # nothing wrapped
        other = np.uint16 if dtype is np.uint8 else np.uint8
        with pytest.raises(ConventionError, match="dtype"):
            VLLM_0_22.decode(routes.astype(other), model=model, prompt_len=1, response_len=1)


def test_encoders_are_what_the_engines_emit() -> None:
    a = np.array([[[1, 2]], [[3, 4]]], dtype=np.int32)
    assert base64.b64decode(encode_sglang_b64(a)) == a.astype("<i4").tobytes()
    buf = io.BytesIO()
    np.save(buf, a)
    assert base64.b64decode(encode_vllm_npy_b64(a)) == buf.getvalue()


# --------------------------------------------------------------------------------------------
# malformed payloads: ConventionError naming the field and the expected value
# --------------------------------------------------------------------------------------------

M = ModelSpec(num_layers=3, num_experts=8, top_k=2, moe_layers=(1, 2))
P, R = 4, 3  # 6 rows


def _pickled_npy() -> str:
    buf = io.BytesIO()
    np.save(buf, np.array([1, "x"], dtype=object), allow_pickle=True)
    return base64.b64encode(buf.getvalue()).decode()


PICKLED_NPY = _pickled_npy()


def routes_m(rows: int = P + R - 1) -> np.ndarray:
    return make_routes(np.random.default_rng(0), rows, M)


@pytest.mark.parametrize("delta", [-2, -1, 1, 3])
@pytest.mark.parametrize("conv", CONVENTIONS, ids=lambda c: c.name)
def test_wrong_row_count_names_convention_field_rows_and_rule(conv: Convention, delta: int) -> None:
    routes = routes_m(P + R - 1 + delta)
    if conv in (VLLM_0_14, VLLM_0_16):
        payload: object = routes.astype(np.int32)
    elif conv is VLLM_0_21:
        moe = routes[:, [1, 2], :].astype(np.int16)
        payload = (moe[:P], moe[P:]) if delta > 0 else (moe[: P + delta], moe[P + delta :])
    elif conv in (VLLM_0_22, VLLM_0_27, VLLM_0_31):
        payload = encode_vllm_npy_b64(routes.astype(np.uint8))
    else:
        payload = encode_sglang_b64(routes)
    with pytest.raises(ConventionError) as info:
        conv.decode(payload, model=M, prompt_len=P, response_len=R)
    msg = str(info.value)
    assert conv.name in msg and "rows" in msg and "rule" in msg
    assert conv.row_rule in msg
    if conv is not VLLM_0_21:
        assert f"has {P + R - 1 + delta} rows, expected {P + R - 1}" in msg
        assert (conv.http_field if conv in (VLLM_0_22, VLLM_0_27, VLLM_0_31) else conv.field) in msg


def test_start_shifts_expected_rows() -> None:
    routes = routes_m(P + R - 1 - 2)
    b64 = encode_sglang_b64(routes)
    assert decode_sglang_meta(b64, model=M, prompt_len=P, response_len=R, start=2).start == 2
    with pytest.raises(ConventionError, match="has 4 rows, expected 6"):
        decode_sglang_meta(b64, model=M, prompt_len=P, response_len=R)
    with pytest.raises(ConventionError, match="routed_experts_prompt_start"):
        VLLM_0_16.decode(routes.astype(np.int32), model=M, prompt_len=P, response_len=R, start=2)


@pytest.mark.parametrize(
    ("conv", "payload", "match"),
    [
        (VLLM_0_22, routes_m().astype(np.int64), r"dtype int64, expected uint8"),
        (VLLM_0_22, routes_m().astype(np.int32), r"dtype int32, expected uint8"),
        (VLLM_0_16, routes_m().astype(np.int64), r"dtype int64, expected int32"),
        (VLLM_0_14, routes_m().astype(np.uint8), r"dtype uint8, expected int32"),
        (VLLM_0_22, routes_m()[:, 1:].astype(np.uint8), r"layer axis \(decoder\) has 2 slots, expected 3"),
        (VLLM_0_16, routes_m()[:, :, :1].astype(np.int32), r"top_k=2"),
        (VLLM_0_16, routes_m()[0].astype(np.int32), r"expected 3 dimensions"),
        (VLLM_0_16, routes_m().tolist(), r"expected a numpy ndarray, got list"),
        (VLLM_0_16, encode_sglang_b64(routes_m()), r"returns routed experts in-process only"),
        (VLLM_0_14, None, r"is None: the request was aborted"),
        (VLLM_0_22, None, r"is None: the request was aborted"),
        (SGLANG, None, r"is None: the request was aborted"),
        (SGLANG, 42, r"expected a base64 string, got int"),
        (SGLANG, "not base64!", r"not valid base64"),
        (SGLANG, encode_sglang_b64(routes_m())[:-4], r"not a multiple of 4 × num_hidden_layers 3 × "),
        (VLLM_0_22, "AAAA", r"not a \.npy file"),
        (VLLM_0_22, encode_vllm_npy_b64(routes_m()[0].astype(np.uint8)), r"shape \(3, 2\), expected 3 dim"),
        (VLLM_0_22, PICKLED_NPY, r"Python objects"),
        (VLLM_0_21, routes_m().astype(np.int16), r"expected the pair"),
        (
            VLLM_0_21,
            (routes_m()[:P, 1:].astype(np.int16), [[[1], [2]]]),
            r"CompletionOutput.routed_experts: last axis",
        ),
        (VLLM_0_21, (routes_m()[:P, 1:].astype(np.int32), []), r"dtype int32, expected int16"),
        (
            VLLM_0_21,
            (routes_m()[:P].astype(np.int16), []),
            r"layer axis \(moe_ordinal\) has 3 slots, expected 2",
        ),
        (VLLM_0_21, ([[[1, 2], [3, 4]], [[1]]], []), r"rectangular|ragged"),
        (VLLM_0_21, ([[[1.0, 2.0], [3.0, 4.0]]] * P, []), r"float64 values, expected integers"),
        (VLLM_0_21, ("xyz", []), r"expected an int16 ndarray or nested int lists, got str"),
    ],
)
def test_malformed_payloads(conv: Convention, payload: object, match: str) -> None:
    with pytest.raises(ConventionError, match=match) as info:
        conv.decode(payload, model=M, prompt_len=P, response_len=R)
    assert conv.name in str(info.value)


def test_npy_with_trailing_or_missing_bytes() -> None:
    raw = base64.b64decode(encode_vllm_npy_b64(routes_m().astype(np.uint8)))
    for bad in (raw + b"\x00", raw[:-1], raw[:20]):
        with pytest.raises(ConventionError, match="npy"):
            decode_vllm_http(base64.b64encode(bad).decode(), model=M, prompt_len=P, response_len=R)


def test_trace_errors_propagate_unchanged() -> None:
    routes = routes_m().astype(np.int32)
    routes[2, 1] = [5, 5]  # repeated id on a MoE layer
    with pytest.raises(TraceError, match="repeated expert id"):
        decode_sglang_meta(encode_sglang_b64(routes), model=M, prompt_len=P, response_len=R)
    routes[2, 1] = [9, 1]  # outside [0, 8)
    with pytest.raises(TraceError, match="outside"):
        VLLM_0_16.decode(routes, model=M, prompt_len=P, response_len=R)
    routes[2, 1] = [-1, 1]  # int32 negative from a broken capture
    with pytest.raises(TraceError):
        decode_sglang_meta(encode_sglang_b64(routes), model=M, prompt_len=P, response_len=R)
    zero = routes_m().astype(np.uint8)
    zero[0, 2] = 0
    with pytest.raises(TraceError, match="all-zero"):
        decode_vllm_http(encode_vllm_npy_b64(zero), model=M, prompt_len=P, response_len=R)
    with pytest.raises(TraceError, match="start"):
        decode_sglang_meta("", model=M, prompt_len=P, response_len=R, start=P + R)


def test_http_helpers_check_the_version() -> None:
    field = encode_vllm_npy_b64(routes_m().astype(np.uint8))
    with pytest.raises(ConventionError, match=r"no base64 \.npy HTTP field"):
        decode_vllm_http(field, model=M, prompt_len=P, response_len=R, version="0.21.0")
    with pytest.raises(ConventionError, match=r"no base64 \.npy HTTP field"):
        decode_vllm_http(field, model=M, prompt_len=P, response_len=R, version="0.18.0")
    with pytest.raises(ConventionError, match="no convention is registered"):
        decode_vllm_http(field, model=M, prompt_len=P, response_len=R, version="0.34.0")
    for version in ("0.27.1", "0.30.0", "0.31.0", "0.33.0"):
        trace = decode_vllm_http(field, model=M, prompt_len=P, response_len=R, version=version)
        assert trace.provenance.version == version
    with pytest.raises(ConventionError, match="does not split"):
        decode_vllm_021([], [], model=M, prompt_len=1, response_len=0, version="0.22.0")
    with pytest.raises(ConventionError, match="is None"):
        decode_vllm_http(None, model=M, prompt_len=P, response_len=R)
    with pytest.raises(ConventionError, match="expected a base64 string, got list"):
        decode_vllm_http([1], model=M, prompt_len=P, response_len=R)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# corruption by hypothesis: never an exception outside HarnessError
# --------------------------------------------------------------------------------------------


def _encode(conv: Convention, s: Sample) -> str:
    if conv is VLLM_0_22:
        return encode_vllm_npy_b64(vllm022_array(s))
    return encode_sglang_b64(s.decoder)


def _decode(conv: Convention, s: Sample, payload: object) -> RoutingTrace:
    return conv.decode(payload, **kw(s))


@FAST
@given(samples(), st.sampled_from([VLLM_0_22, SGLANG]), st.data())
def test_truncated_base64_is_a_convention_error(s: Sample, conv: Convention, data: st.DataObject) -> None:
    b64 = _encode(conv, s)
    assume(len(b64) > 0)
    cut = data.draw(st.integers(0, len(b64) - 1))
    with pytest.raises(ConventionError):
        _decode(conv, s, b64[:cut])


@FAST
@given(samples(), st.sampled_from([VLLM_0_22, SGLANG]), st.data())
def test_flipped_bytes_decode_or_raise_harness_errors(
    s: Sample, conv: Convention, data: st.DataObject
) -> None:
    raw = bytearray(base64.b64decode(_encode(conv, s)))
    assume(len(raw) > 0)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    try:
        trace = _decode(conv, s, base64.b64encode(bytes(raw)).decode())
    except HarnessError:
        return
    trace.check_coverage(s.prompt_len, s.response_len)  # a decode that succeeds is a valid trace


@FAST
@given(samples(), st.sampled_from([VLLM_0_22, SGLANG]), st.data())
def test_mangled_base64_text_raises_harness_errors(s: Sample, conv: Convention, data: st.DataObject) -> None:
    b64 = list(_encode(conv, s))
    assume(b64)
    i = data.draw(st.integers(0, len(b64) - 1))
    b64[i] = data.draw(st.characters(codec="utf-8", exclude_characters="\r\n"))
    extra = data.draw(st.text(max_size=3))
    try:
        _decode(conv, s, "".join(b64) + extra)
    except HarnessError:
        pass


@FAST
@given(samples(with_start=False), st.integers(-3, 3).filter(bool), st.booleans())
def test_wrong_rows_in_split_payload(s: Sample, delta: int, which: bool) -> None:
    prompt, generated = vllm021_payload(s, http=False)
    part = prompt if which else generated
    grown = (
        np.concatenate([part, part[:1].repeat(delta, 0)]) if delta > 0 else part[: max(len(part) + delta, 0)]
    )
    assume(len(grown) != len(part))
    payload = (grown, generated) if which else (prompt, grown)
    with pytest.raises(ConventionError, match="rows"):
        decode_vllm_021(*payload, **kw(s, start=False))


@FAST
@given(samples(), st.integers(1, 3))
def test_wrong_layer_axis_width(s: Sample, extra: int) -> None:
    wide = np.concatenate([vllm022_array(s)] + [vllm022_array(s)[:, :1]] * extra, axis=1)
    with pytest.raises(ConventionError, match="layer axis"):
        decode_vllm_http(encode_vllm_npy_b64(wide), **kw(s))


# --------------------------------------------------------------------------------------------
# version resolution
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "version", "conv"),
    [
        ("vllm", "0.14.0", VLLM_0_14),
        ("vllm", "0.14.0rc1.dev505+g49e6b86c9", VLLM_0_14),
        ("vllm", "0.15.1", VLLM_0_14),
        ("vllm", "0.16.0", VLLM_0_16),
        ("vllm", "0.20.5", VLLM_0_16),
        ("vllm", "0.21.0", VLLM_0_21),
        ("vllm", "0.21.0rc2", VLLM_0_21),
        ("vllm", "0.22.0", VLLM_0_22),
        ("vllm", "0.22.1.dev3+gabc", VLLM_0_22),
        ("vllm", "0.26.3", VLLM_0_22),
        ("VLLM", "v0.24.0", VLLM_0_22),
        ("sglang", "0.5.0", SGLANG),
        ("sglang", "0.5.6.post2", SGLANG),
        ("sglang", "0.5.10rc0", SGLANG),
    ],
)
def test_resolve(engine: str, version: str, conv: Convention) -> None:
    assert resolve(engine, version) is conv


@pytest.mark.parametrize(
    ("engine", "version", "match"),
    [
        (
            "vllm",
            "0.13.9",
            r"^vllm 0\.13\.9: routed experts are not returned before 0\.14; known ranges: "
            r"vllm-0\.14 >=0\.14,<0\.16; vllm-0\.16 >=0\.16,<0\.21; vllm-0\.21 >=0\.21,<0\.22; "
            r"vllm-0\.22 >=0\.22,<0\.27; vllm-0\.27 >=0\.27,<0\.31; vllm-0\.31 >=0\.31,<0\.34$",
        ),
        ("vllm", "0.13.0", r"not returned before 0\.14"),
        ("vllm", "0.34.0", r"no convention is registered for releases from 0\.34 on"),
        ("vllm", "0.34.0.dev12+gdeadbee", r"known ranges: .*vllm-0\.31 >=0\.31,<0\.34"),
        ("vllm", "1.0.0", r"AuxOutputConfig"),
        ("sglang", "0.4.9.post6", r"not returned before 0\.5"),
        ("trtllm", "1.0", r"unknown engine 'trtllm'; known engines: vllm, sglang"),
        ("vllm", "banana", r"not a PEP 440 version"),
    ],
)
def test_resolve_errors(engine: str, version: str, match: str) -> None:
    with pytest.raises(ConventionError, match=match) as info:
        resolve(engine, version)
    if engine == "vllm" and version[0].isdigit():
        for conv in (VLLM_0_14, VLLM_0_16, VLLM_0_21, VLLM_0_22, VLLM_0_27, VLLM_0_31):
            assert format_range(conv.versions) in str(info.value)


def test_ranges_are_contiguous_and_disjoint() -> None:
    probes = [f"0.{minor}.{patch}" for minor in range(10, 40) for patch in (0, 5)]
    for version in probes:
        matches = [c for c in CONVENTIONS if c.engine == "vllm" and c.versions.contains(version)]
        assert len(matches) <= 1
        assert bool(matches) == (14 <= int(version.split(".")[1]) <= 33)


def test_convention_metadata() -> None:
    assert VLLM_0_21.layer_axis is LayerAxis.MOE_ORDINAL
    assert all(c.layer_axis is LayerAxis.DECODER for c in CONVENTIONS if c is not VLLM_0_21)
    assert [c.logical_ids for c in CONVENTIONS] == [False, True, True, True, True, True, True]
    versions = ("0.22.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.30.1rc1", "0.31.0", "0.33.0")
    assert [v for v in versions if resolve("vllm", v).captures_on_cpu(v)] == ["0.30.0", "0.30.1rc1"]
    assert "#33013" in " ".join(VLLM_0_14.notes)
    assert "#54730" in " ".join(VLLM_0_22.notes) and "#48622" in " ".join(VLLM_0_22.notes)
    assert "#36404" in " ".join(SGLANG.notes)
    assert VLLM_0_22.row_rule == "prompt + generated − 1 − routed_experts_prompt_start"
    assert {c.engine for c in CONVENTIONS} == {"vllm", "sglang"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        VLLM_0_22.name = "x"  # type: ignore[misc]


def test_model_spec_validation() -> None:
    assert ModelSpec(3, 8, 2).moe_layers == (0, 1, 2)
    for args, field in [
        ((0, 8, 2), "num_layers"),
        ((2, 8, 9), "top_k"),
        ((2, 1 << 17, 2), "num_experts"),
        ((2, 8, 2, (1, 0)), "moe_layers"),
        ((2, 8, 2, (2,)), "moe_layers"),
    ]:
        with pytest.raises(ConventionError, match=f"model.{field}"):
            ModelSpec(*args)
