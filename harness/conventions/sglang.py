"""SGLang's convention (0.5 on): its payload form, its decoder and the encoder of its bytes.

SGLang returns ``meta_info["routed_experts"]`` (``/generate``; ``sglext.routed_experts`` on the
OpenAI endpoints): the base64 of the raw little-endian int32 bytes of a ``[rows, num_hidden_layers,
top_k]`` tensor, flattened (FACTS §1). No SGLang is imported here: ``encode_sglang_b64`` builds the
bytes the way SGLang does.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import numpy.typing as npt
from packaging.specifiers import SpecifierSet

from harness.conventions.convention import Convention, EngineConventions, ModelSpec, PayloadForm
from harness.errors import ConventionError
from harness.trace import LayerAxis, RoutingTrace


class _Int32Bytes(PayloadForm):
    """SGLang: base64 of raw little-endian int32 bytes, ``num_hidden_layers × top_k`` per row."""

    name = "sglang"

    def dtype(self, model: ModelSpec) -> np.dtype[Any]:
        return np.dtype("<i4")

    def read(
        self, conv: Convention, payload: object, model: ModelSpec, prompt_len: int, response_len: int
    ) -> tuple[npt.NDArray[Any], str]:
        raw = conv.base64_bytes(payload, conv.field)
        unit = 4 * model.num_layers * model.top_k
        if len(raw) % unit:
            raise ConventionError(
                f"{conv.name}: {conv.field}: {len(raw)} bytes is not a multiple of 4 × num_hidden_layers "
                f"{model.num_layers} × num_experts_per_tok {model.top_k} = {unit} (int32 rows)"
            )
        flat = np.frombuffer(raw, dtype="<i4")  # read-only, exactly as SGLang's clients decode it
        return flat.reshape(-1, model.num_layers, model.top_k), conv.field


SGLANG_BYTES = _Int32Bytes()

SGLANG = Convention(
    name="sglang",
    engine="sglang",
    versions=SpecifierSet(">=0.5"),
    dtype="int32 (little-endian bytes, base64)",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1 − routed_experts_start_len",
    logical_ids=True,
    field='meta_info["routed_experts"]',
    http_field='meta_info["routed_experts"] (/generate), sglext.routed_experts (OpenAI endpoints)',
    form=SGLANG_BYTES,
    notes=(
        "version range is permissive: the feature came with sgl-project/sglang PR #12162 (late 2025); the "
        "first release carrying it was not verified (believed 0.5.6); routed_experts_start_len and the "
        "OpenAI-endpoint field (PR #17434) arrived later",
        "needs --enable-return-routed-experts on the server and return_routed_experts per request; without "
        "the server flag the request flag silently returns nothing",
        "a row-count mismatch only logs a warning in SGLang",
        "capture is per KV slot: prefix-cache hits return the rows of whichever request filled the slots",
        "#36404: stale padded rows at chunked-prefill boundaries; #26975: HiCache restored prefixes stale",
        "no aggregation across pipeline stages: MoE layers all zero under PP",
    ),
    start_param="routed_experts_start_len",
    # Tried end to end here (FACTS §6): 0.5.23's CPU engine mode with the ci/sglang_cpu stand-ins.
    cpu_capture=SpecifierSet("==0.5.23"),
)

SGLANG_ENGINE = EngineConventions(
    "sglang",
    (SGLANG,),
    lambda release: "routed experts are not returned before 0.5 (sgl-project/sglang PR #12162)",
)


def decode_sglang_meta(
    b64: str | bytes | None,
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int,
    start: int = 0,
    version: str | None = None,
) -> RoutingTrace:
    """Decode SGLang's ``meta_info["routed_experts"]`` / ``sglext.routed_experts``.

    ``start`` is the request's ``routed_experts_start_len``.
    """
    conv = SGLANG if version is None else SGLANG_ENGINE.resolve(version)
    if isinstance(prompt_len, int) and not isinstance(prompt_len, bool) and prompt_len < 1:
        raise ConventionError(
            f"{conv.name}: prompt_len: expected at least 1 prompt token (SGLang serves no empty prompt), "
            f"got {prompt_len}"
        )
    return conv.decode(
        b64, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version or ""
    )


def encode_sglang_b64(array: npt.ArrayLike) -> str:
    """What SGLang does: the int32 tensor's raw (little-endian) bytes, flattened, then base64."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")
