"""Canonical routing traces (DESIGN §2, §3.1–3.3), one concept per module.

- ``routing_trace``: ``RoutingTrace`` (the routed experts of one sample, validated and immutable)
  and its metadata types;
- ``validation``: validity of routes (``validate_routes``) and of a trace's declared sizes, the
  bounds ``MAX_EXPERTS`` and ``MAX_LAYERS``, ``storage_dtype`` and ``coverage_rows``;
- ``kernels``: the chunked, threaded numpy kernels that validate and compare routes at near
  memory speed;
- ``storage``: trace files (safetensors, CRC-32-checked, written atomically);
- ``comparison``: set-based comparison of two traces (``compare``, ``RoutingComparison``).

Import the public names from here: ``from harness.trace import RoutingTrace, compare``.
"""

from harness.trace.comparison import AgreementCounts, RoutingComparison, compare, route_overlap
from harness.trace.routing_trace import LayerAxis, Provenance, RoutingTrace
from harness.trace.storage import FORMAT_NAME, FORMAT_VERSION
from harness.trace.validation import MAX_EXPERTS, MAX_LAYERS, coverage_rows, storage_dtype, validate_routes

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_EXPERTS",
    "MAX_LAYERS",
    "AgreementCounts",
    "LayerAxis",
    "Provenance",
    "RoutingComparison",
    "RoutingTrace",
    "compare",
    "coverage_rows",
    "route_overlap",
    "storage_dtype",
    "validate_routes",
]
