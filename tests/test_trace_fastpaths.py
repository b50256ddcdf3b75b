"""The fast paths of ``harness.trace`` against simple reference implementations.

Validation and set overlap rotate the lanes of a machine word when a route fits one
(``k · itemsize`` of 2, 4 or 8 bytes, compiled) and otherwise compare parity-tagged flat ids with
themselves shifted (any k); large arrays are split into spans scanned by threads; files are
checked with a CRC-32 computed in parallel spans and combined. Each is checked here against the
obvious slow computation, over top_k 1..9, uint8/uint16 (and wider input dtypes), permuted lanes
and dense slots. Tiny chunk and parallelism thresholds are patched in so that small arrays cross
chunk and span boundaries.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import trace as tr
from harness.errors import TraceError, TraceFileError
from harness.trace import kernels, storage

DTYPES = [np.uint8, np.uint16]


@contextmanager
def tiny_chunks(chunk_bytes: int, workers: int = 3) -> Iterator[None]:
    """Chunks of ``chunk_bytes`` and ``workers`` parallel spans, even for a few routes."""
    with (
        mock.patch.object(kernels, "CHUNK_BYTES", chunk_bytes),
        mock.patch.object(kernels, "PARALLEL_MIN_BYTES", 0),
        mock.patch.object(kernels, "available_cpus", lambda: workers),
    ):
        yield


def distinct_routes(
    rng: np.random.Generator, rows: int, layers: int, k: int, num_experts: int
) -> npt.NDArray[np.int64]:
    """Routes of k distinct ids drawn from a pool that holds 0 and ``num_experts − 1``."""
    sample = rng.choice(num_experts, size=min(num_experts, 24), replace=False)
    pool = np.unique(np.concatenate([[0, num_experts - 1], sample]))
    keys = rng.random((rows, layers, pool.size))
    return pool[np.argsort(keys, axis=-1)[..., :k]]


def reference_overlap(a: npt.NDArray[np.integer], b: npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """``Σ_i Σ_j [a_i = b_j]`` per route, by broadcasting."""
    return (a[..., :, None].astype(np.int64) == b[..., None, :].astype(np.int64)).sum(axis=(-1, -2))


def reference_repeats(routes: npt.NDArray[np.integer]) -> npt.NDArray[np.bool_]:
    """Which routes hold an id twice, by sorting."""
    ordered = np.sort(routes.astype(np.int64), axis=-1)
    return (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)


@st.composite
def route_cases(draw: st.DrawFn) -> tuple[np.dtype, int, npt.NDArray[np.int64], np.random.Generator]:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    k = draw(st.integers(1, 9))
    high = 256 if dtype == np.uint8 else 65536
    num_experts = draw(st.one_of(st.just(high), st.just(max(k, 2)), st.integers(k, high)))
    rows, layers = draw(st.integers(0, 30)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return dtype, num_experts, distinct_routes(rng, rows, layers, k, num_experts), rng


# --- validation -------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    case=route_cases(),
    input_dtype=st.sampled_from(["same", np.int32, np.int64, ">u2", ">i4"]),
    dense=st.sets(st.integers(0, 4)),
    repeats=st.integers(0, 3),
    chunk_bytes=st.sampled_from([1, 24, 100, 1 << 17]),
)
def test_validation_matches_reference(case, input_dtype, dense, repeats, chunk_bytes) -> None:  # type: ignore[no-untyped-def]
    dtype, num_experts, routes, rng = case
    rows, layers, k = routes.shape
    routes = routes.astype(dtype if input_dtype == "same" else input_dtype)
    moe_slots = [layer for layer in range(layers) if layer not in dense]
    if k > 1 and rows:  # copy one lane over another in a few routes, dense slots included
        for _ in range(repeats):
            row, layer = rng.integers(rows), rng.integers(layers)
            i, j = rng.choice(k, size=2, replace=False)
            routes[row, layer, i] = routes[row, layer, j]
    bad = reference_repeats(routes) & np.isin(np.arange(layers), moe_slots)
    with tiny_chunks(chunk_bytes):
        if not bad.any():
            tr.validate_routes(routes, num_experts, moe_slots, start=5)
            return
        row, layer = (int(i) for i in np.argwhere(bad)[0])
        with pytest.raises(
            TraceError, match=rf"^experts\[{row}, {layer}\] \(position {row + 5}, layer {layer}\)"
        ):
            tr.validate_routes(routes, num_experts, moe_slots, start=5)


@settings(max_examples=100, deadline=None)
@given(case=route_cases(), chunk_bytes=st.sampled_from([1, 24, 1 << 17]), data=st.data())
def test_out_of_range_ids_are_found_in_the_input_dtype_first(case, chunk_bytes, data) -> None:  # type: ignore[no-untyped-def]
    """An id out of range is reported before any repeat, and never wraps through a cast."""
    _, num_experts, routes, rng = case
    rows, layers, k = routes.shape
    if not rows:
        return
    routes = routes.astype(np.int64)
    if k > 1:  # a repeat before the bad id must not be reported first
        routes[0, 0, 1] = routes[0, 0, 0]
    row, layer, slot = (int(rng.integers(n)) for n in (rows, layers, k))
    routes[row, layer, slot] = data.draw(st.sampled_from([-1, num_experts, num_experts + 256, 65536, -65536]))
    with (
        tiny_chunks(chunk_bytes),
        pytest.raises(TraceError, match=rf"is outside \[0, num_experts={num_experts}\)"),
    ):
        tr.validate_routes(routes, num_experts)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int32, np.uint64])
@pytest.mark.parametrize("k", range(2, 10))
def test_every_pair_of_lanes_is_compared(dtype: type, k: int) -> None:
    """A repeat at any two lanes is found, and a route matches itself rotated by any number of lanes."""
    route = np.arange(1, k + 1, dtype=dtype)
    for i, j in itertools.combinations(range(k), 2):
        repeated = route.copy()
        repeated[j] = repeated[i]
        with pytest.raises(TraceError, match="repeated expert id"):
            tr.validate_routes(repeated.reshape(1, 1, k), k + 1)
    rotations = np.stack([np.roll(route, s) for s in range(k)]).reshape(k, 1, k)
    np.testing.assert_array_equal(tr.route_overlap(np.broadcast_to(route, rotations.shape), rotations), k)


def test_all_zero_routes_are_reported_as_skipped_captures() -> None:
    routes = np.ones((40, 4, 8), dtype=np.uint8) * np.arange(8, dtype=np.uint8)
    routes[33, 2] = 0
    with tiny_chunks(64), pytest.raises(TraceError, match=r"experts\[33, 2\] .*all-zero MoE route"):
        tr.validate_routes(routes, 8)


# --- set overlap ------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    case=route_cases(),
    mix=st.sampled_from(["same", "few", "most", "all"]),
    chunk_bytes=st.sampled_from([1, 40, 256, 1 << 17]),
    input_dtype=st.sampled_from(["same", np.int32, ">u2", ">i4"]),
)
def test_overlap_matches_reference(case, mix, chunk_bytes, input_dtype) -> None:  # type: ignore[no-untyped-def]
    """Equal words, permuted lanes, partly and wholly different sets: exact |A ∩ B| everywhere."""
    dtype, num_experts, a, rng = case
    rows, layers, k = a.shape
    b = a.copy()
    fraction = {"same": 0.0, "few": 0.1, "most": 0.6, "all": 1.0}[mix]
    change = rng.random((rows, layers)) < fraction
    fresh = distinct_routes(rng, rows, layers, k, num_experts)
    shuffled = rng.permuted(b, axis=-1)
    how = rng.integers(0, 3, (rows, layers))  # lanes permuted, another set, or one id swapped
    b = np.where((change & (how == 0))[..., None], shuffled, b)
    b = np.where((change & (how == 1))[..., None], fresh, b)
    swap = change & (how == 2)
    for row, layer in np.argwhere(swap):
        outside = np.setdiff1d(fresh[row, layer], b[row, layer])
        if outside.size:
            b[row, layer, rng.integers(k)] = outside[0]
    as_dtype = dtype if input_dtype == "same" else input_dtype
    a, b = a.astype(as_dtype), b.astype(as_dtype)
    with tiny_chunks(chunk_bytes):
        got = tr.route_overlap(a, b)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, reference_overlap(a, b))


@pytest.mark.parametrize("k", range(1, 10))
def test_overlap_of_different_dtypes_uses_the_general_kernel(k: int) -> None:
    rng = np.random.default_rng(k)
    a = distinct_routes(rng, 20, 3, k, 300)
    b = rng.permuted(a, axis=-1)
    np.testing.assert_array_equal(tr.route_overlap(a.astype(np.uint16), b), np.full((20, 3), k))


# --- storage ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 7, 1000, 100_003])
@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_parallel_crc32_equals_zlib(size: int, workers: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with tiny_chunks(1, workers):
        assert storage.crc32(memoryview(data)) == zlib.crc32(data)


@settings(max_examples=50, deadline=None)
@given(case=route_cases())
def test_files_are_what_safetensors_writes_and_reads(case) -> None:  # type: ignore[no-untyped-def]
    from safetensors.numpy import load, save

    _, num_experts, routes, _ = case
    trace = tr.RoutingTrace(routes, num_experts=num_experts, start=3)
    blob = trace.to_bytes()
    canonical = json.dumps(trace.metadata(), sort_keys=True, separators=(",", ":")).encode()
    meta = {"format": tr.FORMAT_NAME, "format_version": tr.FORMAT_VERSION, "crc32": zlib.crc32(trace.experts)}
    meta |= {"metadata_crc32": zlib.crc32(canonical)} | trace.metadata()
    assert blob == save({"experts": trace.experts}, metadata={"routing_trace": json.dumps(meta)})
    np.testing.assert_array_equal(load(blob)["experts"], trace.experts)


def test_read_traces_are_read_only_and_independent_of_the_source(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tr.RoutingTrace(np.arange(24).reshape(2, 3, 4) % 8, num_experts=8, moe_layers=[], num_layers=3)
    blob = trace.to_bytes()
    from_bytes = tr.RoutingTrace.from_bytes(blob)
    assert from_bytes == trace and not from_bytes.experts.flags.writeable
    mutable = bytearray(blob)
    copied = tr.RoutingTrace.from_bytes(mutable)  # type: ignore[arg-type]
    mutable[-1] ^= 1
    assert copied == trace
    path = tmp_path / "t.safetensors"
    trace.save(path)
    loaded = tr.RoutingTrace.load(path)
    assert loaded == trace and not loaded.experts.flags.writeable


def _with_header(blob: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    """``blob`` with its JSON header rewritten by ``edit`` (and re-padded)."""
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + size :]


@pytest.mark.parametrize(
    ("edit", "tail", "match"),
    [
        (lambda h: h["experts"].update(dtype="F32"), b"", "integer dtype"),
        (lambda h: h["experts"].update(dtype=["U8"]), b"", "integer dtype"),
        (lambda h: h["experts"].update(shape=[2, 3, -4]), b"", "non-negative"),
        (lambda h: h["experts"].update(shape=[2, 3, 8]), b"", "truncated or corrupted"),
        (lambda h: h["experts"].update(data_offsets=[0, 4]), b"", "truncated or corrupted"),
        (lambda h: None, b"\x00", "truncated or corrupted"),
        (lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), b"", "exactly one"),
        (lambda h: h.update(experts=[1]), b"", "integer dtype"),
    ],
)
def test_inconsistent_headers_raise_trace_file_error(edit, tail: bytes, match: str) -> None:  # type: ignore[no-untyped-def]
    blob = tr.RoutingTrace(np.tile([0, 1, 2, 3], (2, 3, 1)), num_experts=8).to_bytes()
    with pytest.raises(TraceFileError, match=match):
        tr.RoutingTrace.from_bytes(_with_header(blob, edit) + tail)


@given(
    overlap=st.lists(st.integers(0, 4), min_size=1, max_size=60).map(lambda v: np.array(v, dtype=np.uint8)),
    layers=st.sampled_from([1, 2, 3]),
)
def test_disagreement_is_the_mean_of_differs(overlap: npt.NDArray[np.uint8], layers: int) -> None:
    overlap = np.resize(overlap, (len(overlap), layers))
    result = tr.RoutingComparison(overlap, top_k=4)
    assert result.disagreement == float(result.differs.mean())


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(0, 70),
    layers=st.integers(1, 6),
    top_k=st.integers(1, 9),
    workers=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_agreement_counts_are_numpys(rows: int, layers: int, top_k: int, workers: int, seed: int) -> None:
    """The compiled counting pass gives numpy's counts, over any split into spans."""
    overlap = np.random.default_rng(seed).integers(0, top_k + 1, (rows, layers)).astype(np.uint8)
    with tiny_chunks(1 << 17, workers):
        counts = tr.AgreementCounts.of(overlap[:, ::-1], top_k)  # a strided view, too
    differs = overlap[:, ::-1] < top_k
    np.testing.assert_array_equal(counts.differs_per_layer, np.count_nonzero(differs, axis=0))
    assert counts.differs_per_layer.dtype == np.int64
    assert counts.tokens_differ == np.count_nonzero(differs.any(axis=1))
    assert counts.overlap_sum == int(overlap.sum())
    assert (counts.positions, counts.top_k) == (rows, top_k)
