"""The convention type: how one engine, over a range of its versions, returns routed experts.

A ``Convention`` holds what is common to every engine: the model shape a payload is checked
against (``ModelSpec``), the checks of one payload array (dtype, rank, layer-axis width, top-k, row
count) and the canonical ``RoutingTrace`` it decodes to. What differs per engine is the payload's
wire form (an ndarray, a base64 ``.npy``, raw int32 bytes, a pair of halves): a ``PayloadForm``
defined in that engine's module (``harness.conventions.vllm``, ``harness.conventions.sglang``)
reads it into one array. ``EngineConventions`` is one engine's list of conventions, oldest first,
with the reason a version none of them covers is refused.
"""

from __future__ import annotations

import abc
import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from harness.errors import ConventionError
from harness.trace import MAX_EXPERTS, LayerAxis, Provenance, RoutingTrace, coverage_rows
from reference_impl.config import check_moe_layers, layer_width


def format_range(versions: SpecifierSet) -> str:
    """``>=0.14,<0.16`` (lower bound first; ``str(SpecifierSet)`` sorts ``<`` first)."""
    return ",".join(sorted((str(s) for s in versions), key=lambda t: (not t.startswith(">"), t)))


def release_of(version: str) -> Version:
    """The release part of ``version`` (pre-releases resolve by it); ``InvalidVersion`` if not PEP 440."""
    return Version(".".join(str(p) for p in Version(str(version)).release))


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


class PayloadForm(abc.ABC):
    """How a convention's payload arrives on the wire, and how it is read into one array.

    ``name`` labels the form (``"ndarray"``, ``"split"``, ``"npy"``, ``"sglang"``) for strategies and
    failure messages.
    """

    name: str

    @abc.abstractmethod
    def dtype(self, model: ModelSpec) -> np.dtype[Any]:
        """The dtype the engine emits for ``model``."""

    @abc.abstractmethod
    def read(
        self, conv: Convention, payload: object, model: ModelSpec, prompt_len: int, response_len: int
    ) -> tuple[npt.NDArray[Any], str]:
        """The payload's rows ``[rows, layer slots, top_k]``, checked but for their count, and the
        field they were read from (for the row-count message)."""

    def __repr__(self) -> str:
        return f"<payload form {self.name}>"


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
        form: the payload's wire form, which reads it (defined in the engine's module).
        notes: known bugs and caveats (issue numbers from the engine's tracker).
        cpu_capture: the versions of this range whose CPU build is known to capture routed
            experts (None: none known — vLLM 0.27.1–0.29.0 refuse with a monolithic CPU MoE kernel,
            ≥ 0.31 captures only through Model Runner V2, which needs GPU Triton, and before 0.27
            no CPU build installs beside our torch to find out); on a CPU machine the engine
            suites of other versions skip, naming why, instead of failing to start.
            ``captures_on_cpu(version)`` asks it.
        start_param: the engine's prompt-skip parameter (None: the range has none).
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
    form: PayloadForm
    notes: tuple[str, ...] = ()
    cpu_capture: SpecifierSet | None = None
    start_param: str | None = None

    def captures_on_cpu(self, version: str) -> bool:
        """Whether ``version``'s CPU build can capture routed experts (see ``cpu_capture``)."""
        if self.cpu_capture is None:
            return False
        return self.cpu_capture.contains(release_of(version), prereleases=True)

    def emitted_dtype(self, model: ModelSpec) -> np.dtype[Any]:
        """The dtype this engine version emits for ``model``."""
        return self.form.dtype(model)

    def layer_width(self, model: ModelSpec) -> int:
        """Slots on the layer axis of this convention's payload for ``model``."""
        return layer_width(self.layer_axis, model.num_layers, model.moe_layer_tuple)

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
        routes, where = self.form.read(self, payload, model, prompt_len, response_len)
        self.check_rows(where, routes.shape[0], expected, prompt_len, response_len, start)
        return RoutingTrace(
            routes,
            num_experts=model.num_experts,
            moe_layers=model.moe_layer_tuple,
            num_layers=model.num_layers,
            layer_axis=self.layer_axis,
            start=start,
            provenance=Provenance(self.engine, version, self.name),
        )

    # --- the checks every form's reader uses ------------------------------------------------

    def missing(self, where: str) -> ConventionError:
        """The error for a payload that is ``None`` at ``where``."""
        return ConventionError(
            f"{self.name}: {where} is None: the request was aborted before any forward ran, or "
            "routed-expert capture is off; expected routed experts"
        )

    def ndarray(self, payload: object, where: str) -> npt.NDArray[Any]:
        """``payload`` when it is a numpy array (``None`` and anything else refused)."""
        if payload is None:
            raise self.missing(where)
        if not isinstance(payload, np.ndarray):
            raise ConventionError(
                f"{self.name}: {where}: expected a numpy ndarray, got {type(payload).__name__}"
            )
        return payload

    def check_array(
        self, array: npt.NDArray[Any], model: ModelSpec, where: str, *, dtype: np.dtype[Any] | None = None
    ) -> npt.NDArray[Any]:
        """Dtype, rank, layer-axis width and top_k of one payload array (rows are checked later)."""
        want = self.emitted_dtype(model) if dtype is None else dtype
        if array.dtype != want:
            depends = "num_experts" in self.dtype  # the dtype the engine picks by the expert count
            raise ConventionError(
                f"{self.name}: {where}: dtype {array.dtype}, expected {want} ({self.dtype}"
                f"{', num_experts=' + str(model.num_experts) if depends else ''})"
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

    def check_rows(
        self, where: str, found: int, expected: int, prompt_len: int, response_len: int, start: int
    ) -> None:
        """Refuse a payload at ``where`` whose row count is not the ``expected`` one."""
        if found != expected:
            raise ConventionError(
                f"{self.name}: {where} has {found} rows, expected {expected} (rule: {self.row_rule}; "
                f"prompt {prompt_len}, generated {response_len}, start {start})"
            )

    def base64_bytes(self, payload: object, where: str) -> bytes:
        """The bytes of a base64 string payload (``None``, other types and bad base64 refused)."""
        if payload is None:
            raise self.missing(where)
        if not isinstance(payload, (str, bytes)):
            raise ConventionError(
                f"{self.name}: {where}: expected a base64 string, got {type(payload).__name__}"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ConventionError(f"{self.name}: {where}: not valid base64 ({err})") from None


@dataclass(frozen=True)
class EngineConventions:
    """One engine's conventions, oldest first, and why a version none of them covers is refused.

    ``unknown(release)`` says why, in words (routed experts not returned yet, a release not read).
    """

    engine: str
    conventions: tuple[Convention, ...]
    unknown: Callable[[Version], str]

    def known_ranges(self) -> str:
        """``"vllm-0.14 >=0.14,<0.16; …"`` for the error messages."""
        return "; ".join(f"{c.name} {format_range(c.versions)}" for c in self.conventions)

    def resolve(self, version: str) -> Convention:
        """The convention at ``version``; pre-releases resolve by their release part.

        A version that is not PEP 440 or that no range covers is a ``ConventionError`` naming the
        known ranges.
        """
        try:
            release = release_of(version)
        except InvalidVersion:
            raise ConventionError(
                f"version: {self.engine} version {version!r} is not a PEP 440 version; "
                f"known ranges: {self.known_ranges()}"
            ) from None
        for conv in self.conventions:
            if conv.versions.contains(release, prereleases=True):
                return conv
        raise ConventionError(
            f"{self.engine} {version}: {self.unknown(release)}; known ranges: {self.known_ranges()}"
        )
