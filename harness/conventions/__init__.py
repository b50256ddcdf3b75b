"""Engine conventions: how each engine version returns routed experts (DESIGN §3.1, FACTS §1).

A *convention* says, for one engine and a range of its versions, which field holds the routed
experts, in which dtype, along which layer axis, and how many rows it must have. ``decode`` turns
the engine's real payload (an in-process ndarray, the HTTP base64 string, nested lists) into a
canonical ``RoutingTrace`` and checks the row rule: a payload with another row count, dtype or
layer-axis width is a ``ConventionError`` — never padded, trimmed or cast silently. Validity of the
ids themselves (range, distinctness, all-zero captures) is ``RoutingTrace``'s job and its
``TraceError`` propagates unchanged.

No engine is imported here, ever: the payload formats are reproduced from the engines' source
(``encode_vllm_npy_b64`` and ``encode_sglang_b64`` build the bytes the way the engines do) so the
decoders are tested on real bytes on a CPU-only machine.

One module per concept: ``convention`` (the ``Convention`` type, ``ModelSpec``, the checks every
payload goes through), ``vllm`` and ``sglang`` (each engine's conventions, wire forms, decoders and
encoders), ``registry`` (every engine version's convention, ``resolve``). This package re-exports
their public names.

================  ==================  ==========  ==========  =======================================
convention        versions            dtype       layer axis  rows
================  ==================  ==========  ==========  =======================================
vllm-0.14         >=0.14,<0.16        int32       decoder     P + R − 1 (physical ids under EPLB)
vllm-0.16         >=0.16,<0.21        int32       decoder     P + R − 1
vllm-0.21         >=0.21,<0.22        int16       MoE ordinal prompt P (+) generated R − 1
vllm-0.22         >=0.22,<0.27        uint8/16    decoder     P + R − 1 − routed_experts_prompt_start
vllm-0.27         >=0.27,<0.31        uint8/16    decoder     P + R − 1 − routed_experts_prompt_start
vllm-0.31         >=0.31,<0.34        uint8/16    decoder     P + R − 1 − routed_experts_prompt_start
sglang            >=0.5               int32 LE    decoder     P + R − 1 − routed_experts_start_len
================  ==================  ==========  ==========  =======================================

The trainer side has conventions too: ``hf_families`` says, for each router family of the MoE
models transformers ships, how its router's return value is read and rebuilt and its gate-weight
rule, and ``hf_routers`` finds a model's routers by path and class. The replay hooks
(``harness.trainers.hf``), the probe (``harness.probes.hf``) and the gate's adapter all read them
here, below all three. Layer: core; torch and ``reference_impl`` only, never an engine.
"""

from harness.conventions.convention import (
    Convention,
    EngineConventions,
    ModelSpec,
    PayloadForm,
    format_range,
)
from harness.conventions.registry import CONVENTIONS, ENGINES, decode_payload, known_ranges, resolve
from harness.conventions.sglang import SGLANG, decode_sglang_meta, encode_sglang_b64
from harness.conventions.vllm import (
    NEWEST_KNOWN_VLLM,
    VLLM_0_14,
    VLLM_0_16,
    VLLM_0_21,
    VLLM_0_22,
    VLLM_0_27,
    VLLM_0_31,
    decode_vllm_021,
    decode_vllm_http,
    encode_vllm_npy_b64,
)

__all__ = [
    "CONVENTIONS",
    "ENGINES",
    "NEWEST_KNOWN_VLLM",
    "SGLANG",
    "VLLM_0_14",
    "VLLM_0_16",
    "VLLM_0_21",
    "VLLM_0_22",
    "VLLM_0_27",
    "VLLM_0_31",
    "Convention",
    "EngineConventions",
    "ModelSpec",
    "PayloadForm",
    "decode_payload",
    "decode_sglang_meta",
    "decode_vllm_021",
    "decode_vllm_http",
    "encode_sglang_b64",
    "encode_vllm_npy_b64",
    "format_range",
    "known_ranges",
    "resolve",
]
