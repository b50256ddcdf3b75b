"""Payload-decoding mutants: ids wrapped, physical, zeroed, on the wrong layer axis, or a payload of
another row count fitted to the expected one."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from harness.conventions import decode_payload
from harness.errors import ConventionError
from harness.mutants import Mutant, mutate
from harness.trace import LayerAxis, RoutingTrace


def rebuilt(trace: RoutingTrace, experts: Any, **changes: Any) -> RoutingTrace:
    """``trace`` with other ids (and any metadata ``changes``), provenance kept."""
    meta: dict[str, Any] = {
        "num_experts": trace.num_experts,
        "moe_layers": trace.moe_layers,
        "num_layers": trace.num_layers,
        "layer_axis": trace.layer_axis,
        "start": trace.start,
        "provenance": trace.provenance,
    }
    return RoutingTrace(experts, **(meta | changes))


def decode_wrapping_to_uint8(*args: Any, **kwargs: Any) -> RoutingTrace:
    """Ids stored as uint8 whatever the expert count: 256 becomes 0."""
    trace = decode_payload(*args, **kwargs)
    return rebuilt(trace, trace.experts.astype(np.uint8))


def decode_physical_ids(*args: Any, **kwargs: Any) -> RoutingTrace:
    """Ids captured after an EPLB logical→physical remap (here: each expert's replica one slot over)."""
    trace = decode_payload(*args, **kwargs)
    return rebuilt(trace, (trace.experts.astype(np.int64) + 1) % trace.num_experts)


def decode_with_zeroed_last_layer(*args: Any, **kwargs: Any) -> RoutingTrace:
    """The capture of the last MoE layer was skipped: its rows are all zeros."""
    trace = decode_payload(*args, **kwargs)
    experts = trace.experts.copy()
    experts[:, trace.moe_slots[-1], :] = 0
    return rebuilt(trace, experts)


def decode_ordinal_as_decoder_index(*args: Any, **kwargs: Any) -> RoutingTrace:
    """A MoE-ordinal payload read as if slot j were decoder layer j (dense-first layers shift it)."""
    trace = decode_payload(*args, **kwargs)
    if trace.layer_axis is not LayerAxis.MOE_ORDINAL:
        return trace
    return rebuilt(trace, trace.experts, moe_layers=range(len(trace.moe_layers)))


def decode_fitting_rows(
    engine: str,
    version: str,
    payload: object,
    *,
    model: Any,
    prompt_len: int,
    response_len: int,
    start: int = 0,
) -> RoutingTrace:
    """A payload of another row count than the engine's rule gives fitted to it with a warning: padded
    with copies of its last row, or cut (DESIGN §3.1: a convention violation, never silently fixed)."""
    kwargs = {"model": model, "prompt_len": prompt_len, "start": start}
    try:
        return decode_payload(engine, version, payload, response_len=response_len, **kwargs)
    except ConventionError:
        pass
    for fits in range(1, response_len + 64):  # the generated count the payload's rows do fit
        try:
            trace = decode_payload(engine, version, payload, response_len=fits, **kwargs)
        except ConventionError:
            continue
        expected = prompt_len + response_len - 1 - start
        rows = trace.experts
        fitted = (
            rows[:expected]
            if len(rows) >= expected
            else np.concatenate([rows, *[rows[-1:]] * (expected - len(rows))])
        )
        warnings.warn(f"routed_experts has {len(rows)} rows, expected {expected}: fitted", stacklevel=2)
        return rebuilt(trace, fitted)
    raise ConventionError(f"{engine} {version}: no generated count fits the payload")


MUTANTS = (
    Mutant(
        "dtype-wrap",
        "dtype wrap",
        "verl #7407: ids cast to uint8 on a model with more than 256 experts (hides below 257 experts)",
        mutate("dtype-wrap", decode_payload=decode_wrapping_to_uint8),
        killed_by="test_conventions.py::test_payload_decodes_to_the_routes_the_engine_sent",
    ),
    Mutant(
        "physical-ids",
        "physical ids",
        "vLLM 0.14: capture after the EPLB logical→physical remap (fixed by PR #33013 in 0.16)",
        mutate("physical-ids", decode_payload=decode_physical_ids),
        killed_by="test_conventions.py::test_payload_decodes_to_the_routes_the_engine_sent",
    ),
    Mutant(
        "all-zero-capture",
        "all-zero capture",
        "vLLM #33013 (capture bound too early), #44116/#54730 (monolithic FlashInfer MoE kernels)",
        mutate("all-zero-capture", decode_payload=decode_with_zeroed_last_layer),
        killed_by="test_conventions.py::test_payload_decodes_to_the_routes_the_engine_sent",
    ),
    Mutant(
        "layer-axis-convention",
        "layer axis convention",
        "vLLM 0.21 returns one slot per MoE layer; read as a decoder index every MoE layer takes another "
        "layer's routes (hides without dense-first layers)",
        mutate("layer-axis-convention", decode_payload=decode_ordinal_as_decoder_index),
        killed_by="test_conventions.py::test_payload_decodes_to_the_routes_the_engine_sent",
    ),
    Mutant(
        "fitted-payload",
        "payload fitted to its row count",
        "a payload of another row count than the engine's rule padded with copies of its last row or "
        "cut to fit, with a warning, instead of refused (issue #43; DESIGN §3.1)",
        mutate("fitted-payload", decode_payload=decode_fitting_rows),
        killed_by="test_conventions.py::test_a_payload_of_another_row_count_is_refused",
    ),
)
