"""Unit and property tests of the canonical trace (DESIGN §3.1–3.3)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.errors import HarnessError, TraceError, TraceFileError
from harness.strategies import malformed_traces, sample_lengths, trace_specs, traces, valid_routes
from harness.trace import (
    LayerAxis,
    Provenance,
    RoutingTrace,
    compare,
    coverage_rows,
    storage,
    storage_dtype,
)


def make(routes: object, num_experts: int = 8, **kwargs: object) -> RoutingTrace:
    return RoutingTrace(routes, num_experts=num_experts, **kwargs)  # type: ignore[arg-type]


# --- construction and storage dtype ---------------------------------------------------------


@pytest.mark.parametrize(
    ("experts", "dtype"), [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16)]
)
def test_storage_dtype_is_the_narrowest(experts: int, dtype: type) -> None:
    assert storage_dtype(experts) == np.dtype(dtype)


@given(spec=trace_specs(max_experts=65536), data=st.data())
def test_ids_never_wrap(spec, data) -> None:  # type: ignore[no-untyped-def]
    """Stored ids equal the input ids for every expert count up to 65536 (verl #7407)."""
    routes = data.draw(valid_routes(spec))
    trace = RoutingTrace(routes, **spec.kwargs())
    assert trace.experts.dtype == storage_dtype(spec.num_experts)
    np.testing.assert_array_equal(trace.experts.astype(np.int64), routes)


def test_max_ids_survive_at_the_dtype_edges() -> None:
    for experts in (256, 257, 65536):
        routes = np.array([[[experts - 1, 0]]])
        assert int(make(routes, experts).experts.max()) == experts - 1


@pytest.mark.parametrize(
    "convert",
    [
        lambda a: a,
        lambda a: torch.from_numpy(a),
        lambda a: a.tolist(),
        lambda a: a.astype(np.int32),
        lambda a: np.frombuffer(a.astype("<i4").tobytes(), dtype="<i4").reshape(a.shape),  # read-only
    ],
    ids=["numpy", "torch", "lists", "int32", "readonly"],
)
def test_accepts_numpy_torch_lists_and_readonly(convert) -> None:  # type: ignore[no-untyped-def]
    routes = np.array([[[1, 2], [3, 0]], [[4, 5], [6, 7]]])
    assert np.array_equal(make(convert(routes)).experts, routes)


def test_trace_is_immutable() -> None:
    trace = make([[[1, 2]]])
    with pytest.raises(ValueError, match="read-only"):
        trace.experts[0, 0, 0] = 3
    with pytest.raises(AttributeError, match="immutable"):
        trace.start = 3  # type: ignore[misc]


def test_input_is_copied() -> None:
    routes = np.array([[[1, 2]]])
    trace = make(routes)
    routes[0, 0, 0] = 5
    assert trace.experts[0, 0, 0] == 1


# --- validation -------------------------------------------------------------------------------


@settings(max_examples=400)  # 15 malformations (strategies._MALFORMATIONS): each drawn ~25 times
@given(bad=malformed_traces())
def test_every_malformed_trace_raises_trace_error(bad) -> None:  # type: ignore[no-untyped-def]
    """Every malformation raises TraceError naming the field — never another exception type."""
    try:
        RoutingTrace(bad.experts, **bad.kwargs)
    except TraceError as err:
        assert str(err).startswith(bad.field_name), (bad.kind, str(err))
    except Exception as err:
        pytest.fail(f"{bad.kind}: raised {type(err).__name__} instead of TraceError: {err}")
    else:
        pytest.fail(f"{bad.kind}: accepted a malformed trace")


def test_messages_name_position_layer_and_expectation() -> None:
    routes = np.array([[[1, 2], [3, 4]], [[1, 2], [5, 5]]])
    with pytest.raises(TraceError, match=r"experts\[1, 1\] \(position 11, layer 1\): repeated expert id"):
        make(routes, start=10)
    with pytest.raises(TraceError, match=r"id 9 is outside \[0, num_experts=8\)"):
        make([[[1, 9]]])
    with pytest.raises(TraceError, match="all-zero MoE route"):
        make([[[0, 0]]])


def test_dense_slots_are_not_checked_for_distinctness() -> None:
    trace = make([[[0, 0], [1, 2]]], moe_layers=[1], num_layers=2)
    assert trace.moe_slots == (1,)
    with pytest.raises(TraceError, match="all-zero MoE route"):
        make([[[0, 0], [1, 2]]], moe_layers=[0, 1])


def test_top_k_one_allows_expert_zero() -> None:
    assert make([[[0]], [[0]]]).rows == 2


# --- coverage ---------------------------------------------------------------------------------


@given(lengths=sample_lengths(), start=st.integers(0, 4))
def test_coverage_rows_rule(lengths, start) -> None:  # type: ignore[no-untyped-def]
    prompt, response = lengths
    if start > prompt + response - 1:
        with pytest.raises(TraceError, match="start"):
            coverage_rows(prompt, response, start)
        return
    rows = coverage_rows(prompt, response, start)
    assert rows == prompt + response - 1 - start
    routes = np.tile(np.arange(2), (rows, 1, 1))
    make(routes, start=start).check_coverage(prompt, response)
    with pytest.raises(TraceError, match=rf"trace has {rows + 1} rows .* expected {rows}"):
        make(np.tile(np.arange(2), (rows + 1, 1, 1)), start=start).check_coverage(prompt, response)


# --- layer axes -------------------------------------------------------------------------------


@given(trace=traces())
def test_layer_axis_round_trip(trace: RoutingTrace) -> None:
    ordinal = trace.to_moe_ordinal()
    assert ordinal.layer_axis is LayerAxis.MOE_ORDINAL
    assert ordinal.experts.shape[1] == len(trace.moe_layers)
    np.testing.assert_array_equal(ordinal.experts, trace.moe_routes())
    back = ordinal.to_decoder_axis()
    np.testing.assert_array_equal(back.moe_routes(), trace.moe_routes())
    assert back.experts.shape[1] == trace.num_layers


def test_moe_ordinal_slot_maps_to_its_decoder_layer() -> None:
    ordinal = make([[[1, 2], [3, 4]]], moe_layers=[1, 3], num_layers=4, layer_axis="moe_ordinal")
    decoder = ordinal.to_decoder_axis().experts
    assert decoder[0, 1].tolist() == [1, 2] and decoder[0, 3].tolist() == [3, 4]
    assert decoder[0, 0].tolist() == [0, 0] and decoder[0, 2].tolist() == [0, 0]


# --- set-based comparison ---------------------------------------------------------------------


@given(trace=traces())
def test_identical_traces_agree(trace: RoutingTrace) -> None:
    result = compare(trace, trace)
    if trace.rows and trace.moe_layers:
        assert result.disagreement == 0.0 and result.token_disagreement == 0.0
        assert result.topk_overlap == 1.0
    else:
        assert np.isnan(result.disagreement)


@given(trace=traces(max_experts=400), seed=st.integers(0, 2**32 - 1))
def test_lane_order_does_not_matter(trace: RoutingTrace, seed: int) -> None:
    """Kernels order top-k differently: equal sets are equal routes (DESIGN §3.3)."""
    permuted = np.random.default_rng(seed).permuted(trace.experts, axis=-1)
    other = RoutingTrace(permuted, **trace.metadata() | {"provenance": None})
    if trace.rows and trace.moe_layers:
        assert compare(trace, other).disagreement == 0.0


def test_disjoint_traces_disagree_everywhere() -> None:
    a = make(np.tile([0, 1], (5, 3, 1)))
    b = make(np.tile([2, 3], (5, 3, 1)))
    result = compare(a, b)
    assert result.disagreement == 1.0 and result.token_disagreement == 1.0 and result.topk_overlap == 0.0
    assert result.per_layer.tolist() == [1.0, 1.0, 1.0]


def test_comparison_by_hand() -> None:
    # 2 positions × 2 MoE layers, top-2. One route shares one expert, one is disjoint.
    a = make([[[1, 2], [3, 4]], [[5, 6], [0, 7]]])
    b = make([[[2, 1], [3, 5]], [[5, 6], [1, 2]]])
    result = compare(a, b)
    assert result.overlap.tolist() == [[2, 1], [2, 0]]
    assert result.disagreement == 0.5
    assert result.per_layer.tolist() == [0.0, 1.0]
    assert result.token_disagreement == 1.0
    assert result.topk_overlap == pytest.approx((2 + 1 + 2 + 0) / 4 / 2)


def test_comparison_refuses_different_samples() -> None:
    with pytest.raises(TraceError, match="start: traces differ"):
        compare(make([[[1, 2]]]), make([[[1, 2]]], start=1))
    with pytest.raises(TraceError, match="rows: traces differ"):
        compare(make([[[1, 2]]]), make([[[1, 2]], [[1, 2]]]))


# --- storage ----------------------------------------------------------------------------------


@given(trace=traces())
def test_bytes_round_trip_is_exact(trace: RoutingTrace) -> None:
    back = RoutingTrace.from_bytes(trace.to_bytes())
    assert back == trace
    assert back.experts.dtype == trace.experts.dtype


def test_file_round_trip_keeps_provenance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = make([[[1, 2]], [[3, 4]]], start=3, provenance=Provenance("vllm", "0.22.0", "vllm-0.22"))
    path = tmp_path / "t.safetensors"
    trace.save(path)
    back = RoutingTrace.load(path)
    assert back == trace and back.provenance.version == "0.22.0"
    assert [p.name for p in tmp_path.iterdir()] == ["t.safetensors"]  # no temporary left behind


@given(data=st.data())
def test_truncated_or_corrupted_files_raise_trace_file_error(data) -> None:  # type: ignore[no-untyped-def]
    blob = data.draw(traces(max_rows=8)).to_bytes()
    if data.draw(st.booleans()):
        broken = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        at = data.draw(st.integers(0, len(blob) - 1))
        broken = blob[:at] + bytes([blob[at] ^ data.draw(st.integers(1, 255))]) + blob[at + 1 :]
    try:
        RoutingTrace.from_bytes(broken)
    except TraceFileError:
        pass
    except HarnessError as err:
        pytest.fail(f"raised {type(err).__name__}, expected TraceFileError: {err}")
    except Exception as err:
        pytest.fail(f"raised {type(err).__name__} instead of TraceFileError: {err}")
    else:  # a flip inside the JSON metadata can keep it valid only if it changed nothing we read
        back = RoutingTrace.from_bytes(broken)
        assert back == RoutingTrace.from_bytes(blob)


@pytest.mark.parametrize("shape", [(1, 0, 2), (0, 0, 2)])
def test_zero_layers_are_refused(shape: tuple[int, int, int], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A trace with no layer carries no routing: refused when built and when read from a file."""
    message = "experts: layer axis width 0; expected at least one layer"
    with pytest.raises(TraceError, match=message):
        RoutingTrace(np.zeros(shape, np.uint8), num_experts=4)
    metadata = {
        "num_experts": 4,
        "num_layers": 0,
        "moe_layers": [],
        "layer_axis": "decoder",
        "start": 0,
        "provenance": Provenance().as_dict(),
    }
    path = tmp_path / "no_layers.safetensors"
    storage.save(path, np.zeros(shape, np.uint8), metadata)  # written past the constructor
    with pytest.raises(TraceFileError, match=f"stored trace is invalid: {message}"):
        RoutingTrace.load(path)
    with pytest.raises(TraceFileError, match=f"stored trace is invalid: {message}"):
        RoutingTrace.from_bytes(path.read_bytes())


@pytest.mark.parametrize(
    "blob",
    [b"", b"\x00" * 7, b"hello world, not a trace", json.dumps({"a": 1}).encode()],
    ids=["empty", "short", "text", "json"],
)
def test_foreign_files_raise_trace_file_error(blob: bytes) -> None:
    with pytest.raises(TraceFileError):
        RoutingTrace.from_bytes(blob)


def test_foreign_safetensors_file_raises(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.numpy import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(path))
    with pytest.raises(TraceFileError, match="not a trace file"):
        RoutingTrace.load(path)
    with pytest.raises(TraceFileError, match="cannot read"):
        RoutingTrace.load(tmp_path / "missing.safetensors")
