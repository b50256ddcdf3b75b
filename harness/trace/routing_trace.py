"""The canonical routing trace: ``RoutingTrace``, its metadata and its files (DESIGN §2, §3.1–3.2).

A *trace* holds the routed experts of one sample: an integer array ``[rows, layers, top_k]`` where
row ``i`` is the routing computed when the token at position ``start + i`` was the model input.
Engines return rows for positions ``[start, P + R − 1)``: the last sampled token is never fed back,
so it has no row.

``RoutingTrace`` validates on construction (``harness.trace.validation``) and is immutable
afterwards. Every rejection raises ``TraceError`` with a message that names the field, the
position/layer and the expected value. Ids are stored in the narrowest unsigned dtype that holds
``num_experts`` (uint8 up to 256 experts, uint16 up to 65536), after a range check on the input
dtype, so nothing ever wraps (verl #7407 cast ids to uint8 on a 384-expert model). Files are
``harness.trace.storage``'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import TraceError, TraceFileError
from harness.trace import storage
from harness.trace.validation import (
    MAX_LAYERS,
    as_integer_array,
    check_moe_layers,
    check_num_experts,
    check_size,
    coverage_rows,
    storage_dtype,
    validate_routes,
)
from reference_impl.axes import LayerAxis


@dataclass(frozen=True)
class Provenance:
    """Where a trace came from: engine name, engine version and the convention that decoded it."""

    engine: str = "unknown"
    version: str = ""
    convention: str = ""

    def __post_init__(self) -> None:
        for name in ("engine", "version", "convention"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TraceError(f"provenance.{name}: expected a string, got {value!r}")

    def as_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "version": self.version, "convention": self.convention}


class RoutingTrace:
    """The routed experts of one sample, validated and immutable.

    Args:
        experts: integer array-like ``[rows, layers, top_k]`` (numpy, read-only numpy, torch, lists).
        num_experts: experts per MoE layer; ids must lie in ``[0, num_experts)``.
        moe_layers: decoder indices of the MoE layers (default: every layer is MoE).
        num_layers: decoder (hidden) layers of the model (default: inferred from the axis).
        layer_axis: whether the layer axis is the decoder index or the MoE ordinal.
        start: position of row 0 (engines may skip a prompt prefix).
        provenance: engine, version and convention the trace came from.
    """

    __slots__ = ("_experts", "layer_axis", "moe_layers", "num_experts", "num_layers", "provenance", "start")

    _experts: npt.NDArray[np.unsignedinteger[Any]]
    num_experts: int
    num_layers: int
    moe_layers: tuple[int, ...]
    layer_axis: LayerAxis
    start: int
    provenance: Provenance

    def __init__(
        self,
        experts: object,
        *,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        num_layers: int | None = None,
        layer_axis: LayerAxis | str = LayerAxis.DECODER,
        start: int = 0,
        provenance: Provenance | None = None,
    ) -> None:
        self._build(experts, True, num_experts, moe_layers, num_layers, layer_axis, start, provenance)

    @classmethod
    def _adopt(cls, experts: npt.NDArray[np.integer[Any]], **kwargs: Any) -> RoutingTrace:
        """Like the constructor, but keeps ``experts`` itself when it already has the stored dtype.

        Only for arrays nobody else can write to — the buffer ``harness.trace.storage`` has just
        read a file into — where it saves a copy of the whole trace. Validation is the same.
        """
        trace = cls.__new__(cls)
        trace._build(experts, False, **kwargs)
        return trace

    def _build(
        self,
        experts: object,
        copy: bool,
        num_experts: int,
        moe_layers: Sequence[int] | None = None,
        num_layers: int | None = None,
        layer_axis: LayerAxis | str = LayerAxis.DECODER,
        start: int = 0,
        provenance: Provenance | None = None,
    ) -> None:
        """The constructor's work; ``copy=False`` keeps a C-contiguous array of the stored dtype."""
        array = as_integer_array(experts)
        check_num_experts(num_experts)
        try:
            axis = LayerAxis(layer_axis)
        except (ValueError, TypeError):
            raise TraceError(
                f"layer_axis: expected one of {[a.value for a in LayerAxis]}, got {layer_axis!r}"
            ) from None
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or start < 0:
            raise TraceError(f"start: expected a non-negative integer, got {start!r}")
        if provenance is not None and not isinstance(provenance, Provenance):
            raise TraceError(f"provenance: expected a harness.trace.Provenance, got {provenance!r:.80}")
        # Declared sizes against the data first: nothing is built from num_layers or moe_layers
        # before they are known to be integers within bounds that agree with the array's width.
        width = check_size("experts: layer axis width", array.shape[1], MAX_LAYERS)
        if width == 0:  # no layer, no routing: such a trace would only ever vacuously "match"
            raise TraceError("experts: layer axis width 0; expected at least one layer")
        moe = None if moe_layers is None else check_moe_layers(moe_layers)
        if axis is LayerAxis.MOE_ORDINAL and moe == ():
            raise TraceError(
                "moe_layers: expected at least one MoE layer on the moe_ordinal axis (one slot per MoE layer)"
            )
        if num_layers is None:
            num_layers = width if axis is LayerAxis.DECODER or moe is None else moe[-1] + 1
        num_layers = check_size("num_layers", num_layers, MAX_LAYERS)
        expected_width = num_layers if axis is LayerAxis.DECODER or moe is None else len(moe)
        if width != expected_width:
            what = "num_layers" if axis is LayerAxis.DECODER or moe is None else "the number of MoE layers"
            raise TraceError(
                f"experts: layer axis ({axis.value}) has {width} slots, expected {expected_width} ({what})"
            )
        if moe is None:
            moe = tuple(range(num_layers))
        elif moe and moe[-1] >= num_layers:
            raise TraceError(
                f"moe_layers: expected distinct increasing decoder indices in [0, num_layers={num_layers}), "
                f"got {list(moe)}"
            )
        slots = moe if axis is LayerAxis.DECODER else range(len(moe))
        validate_routes(array, int(num_experts), slots, int(start))
        dtype = storage_dtype(int(num_experts))
        keep = not copy and array.dtype == dtype and array.flags.c_contiguous
        stored: npt.NDArray[Any] = array if keep else np.array(array, dtype=dtype, order="C")
        stored.flags.writeable = False
        self._experts = stored
        self.num_experts = int(num_experts)
        self.num_layers = int(num_layers)
        self.moe_layers = moe
        self.layer_axis = axis
        self.start = int(start)
        self.provenance = provenance or Provenance()

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, name):
            raise AttributeError(f"RoutingTrace is immutable: cannot set {name!r}")
        object.__setattr__(self, name, value)

    # --- shape and coverage -------------------------------------------------------------------

    @property
    def experts(self) -> npt.NDArray[np.unsignedinteger[Any]]:
        """The stored ids ``[rows, layers, top_k]`` (read-only)."""
        return self._experts

    @property
    def rows(self) -> int:
        return int(self._experts.shape[0])

    @property
    def top_k(self) -> int:
        return int(self._experts.shape[2])

    @property
    def stop(self) -> int:
        """One past the last covered position."""
        return self.start + self.rows

    @property
    def moe_slots(self) -> tuple[int, ...]:
        """Indices along the layer axis that hold MoE routes."""
        if self.layer_axis is LayerAxis.DECODER:
            return self.moe_layers
        return tuple(range(len(self.moe_layers)))

    def check_coverage(self, prompt_len: int, response_len: int) -> None:
        """Raise ``TraceError`` unless the rows are exactly positions ``[start, P + R − 1)``."""
        expected = coverage_rows(prompt_len, response_len, self.start)
        if self.rows != expected:
            raise TraceError(
                f"rows: trace has {self.rows} rows for positions [{self.start}, {self.stop}), expected "
                f"{expected} = prompt {prompt_len} + response {response_len} − 1 − start {self.start}"
            )

    # --- views and conversions ----------------------------------------------------------------

    def moe_routes(self) -> npt.NDArray[np.unsignedinteger[Any]]:
        """The MoE-layer routes ``[rows, num_moe_layers, top_k]`` (a view when no dense slots)."""
        if self.layer_axis is LayerAxis.MOE_ORDINAL or len(self.moe_layers) == self.num_layers:
            return self._experts
        return self._experts[:, list(self.moe_layers), :]

    def to_moe_ordinal(self) -> RoutingTrace:
        """The same routes with one layer slot per MoE layer."""
        return self._replace(self.moe_routes(), LayerAxis.MOE_ORDINAL)

    def to_decoder_axis(self) -> RoutingTrace:
        """The same routes with one slot per decoder layer, dense slots filled with 0."""
        if self.layer_axis is LayerAxis.DECODER:
            return self
        full = np.zeros((self.rows, self.num_layers, self.top_k), dtype=self._experts.dtype)
        full[:, list(self.moe_layers), :] = self._experts
        return self._replace(full, LayerAxis.DECODER)

    def _replace(self, experts: npt.NDArray[Any], axis: LayerAxis) -> RoutingTrace:
        return RoutingTrace(
            experts,
            num_experts=self.num_experts,
            moe_layers=self.moe_layers,
            num_layers=self.num_layers,
            layer_axis=axis,
            start=self.start,
            provenance=self.provenance,
        )

    def metadata(self) -> dict[str, Any]:
        """Everything but the ids, as JSON-able values."""
        return {
            "num_experts": self.num_experts,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "layer_axis": self.layer_axis.value,
            "start": self.start,
            "provenance": self.provenance.as_dict(),
        }

    def __eq__(self, other: object) -> bool:
        """Exact equality: same ids in the same order and the same metadata."""
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return self.metadata() == other.metadata() and np.array_equal(self._experts, other._experts)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"RoutingTrace(rows={self.rows}, layers={self._experts.shape[1]} ({self.layer_axis.value}), "
            f"top_k={self.top_k}, num_experts={self.num_experts}, start={self.start}, "
            f"engine={self.provenance.engine!r})"
        )

    # --- storage (the file format: harness.trace.storage) ---------------------------------------

    def to_bytes(self) -> bytes:
        """The trace as a safetensors file: one tensor ``experts`` and JSON metadata with CRC-32s."""
        return storage.to_bytes(self._experts, self.metadata())

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "<bytes>") -> RoutingTrace:
        """Read a trace written by ``to_bytes``; anything else raises ``TraceFileError``."""
        return cls._decode(*storage.from_bytes(data, source), source)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` atomically (``harness.atomic``: a temporary file, fsync, rename)."""
        storage.save(path, self._experts, self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by ``save``."""
        return cls._decode(*storage.load(path), str(path))

    @classmethod
    def _decode(
        cls, meta: dict[str, Any], experts: npt.NDArray[np.integer[Any]], source: str
    ) -> RoutingTrace:
        """The trace of a file's checked metadata and ids (a buffer read for it alone, so adopted).

        The trace is validated like any other: a file with matching checksums is still refused
        when its routes or metadata are not a valid trace.
        """
        try:
            prov = meta["provenance"]
            if not isinstance(prov, dict):
                raise TraceError(
                    f"provenance: expected an object with engine, version, convention, got {prov!r:.80}"
                )
            return cls._adopt(
                experts,
                num_experts=meta["num_experts"],
                moe_layers=meta["moe_layers"],
                num_layers=meta["num_layers"],
                layer_axis=meta["layer_axis"],
                start=meta["start"],
                provenance=Provenance(prov["engine"], prov["version"], prov["convention"]),
            )
        except (KeyError, TypeError) as err:
            raise TraceFileError(f"{source}: metadata field missing or malformed: {err}") from None
        except TraceError as err:
            raise TraceFileError(f"{source}: stored trace is invalid: {err}") from None
