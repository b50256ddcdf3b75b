"""Payload-decoding mutants: ids wrapped, physical, zeroed, or on the wrong layer axis."""

from __future__ import annotations

from typing import Any

import numpy as np

from harness.conventions import decode_payload
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
)
