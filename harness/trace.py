"""Canonical routing traces (DESIGN §2, §3.1–3.3).

A *trace* holds the routed experts of one sample: an integer array ``[rows, layers, top_k]`` where
row ``i`` is the routing computed when the token at position ``start + i`` was the model input.
Engines return rows for positions ``[start, P + R − 1)``: the last sampled token is never fed back,
so it has no row.

``RoutingTrace`` validates on construction and is immutable afterwards. Every rejection raises
``TraceError`` with a message that names the field, the position/layer and the expected value.
Ids are stored in the narrowest unsigned dtype that holds ``num_experts`` (uint8 up to 256
experts, uint16 up to 65536), after a range check on the input dtype, so nothing ever wraps
(verl #7407 cast ids to uint8 on a 384-expert model).

The checks and the comparison are vectorised and run over cache-sized chunks of rows: a trace of
256 × 4096 positions × 48 layers × top-8 is 400 MB, and both must run near memory speed.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import TraceError, TraceFileError

MAX_EXPERTS = 1 << 16
"""The largest ``num_experts`` a trace can store (uint16)."""

FORMAT_NAME = "rrh.routing_trace"
FORMAT_VERSION = 1
_METADATA_KEY = "routing_trace"
_TENSOR_NAME = "experts"

# (row, layer) pairs examined per chunk; k bytes each, so a chunk stays in L2 cache.
_CHUNK_PAIRS = 1 << 15


class LayerAxis(str, enum.Enum):
    """What the layer axis of a trace indexes (DESIGN §2 "layer axis")."""

    DECODER = "decoder"
    """One slot per hidden layer; dense-layer slots hold filler (vLLM ≠ 0.21, SGLang)."""
    MOE_ORDINAL = "moe_ordinal"
    """One slot per MoE layer, in model order (vLLM 0.21, Megatron R2 recordings)."""


@dataclass(frozen=True)
class Provenance:
    """Where a trace came from: engine name, engine version and the convention that decoded it."""

    engine: str = "unknown"
    version: str = ""
    convention: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"engine": self.engine, "version": self.version, "convention": self.convention}


def storage_dtype(num_experts: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype that holds every id in ``[0, num_experts)``."""
    _check_num_experts(num_experts)
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


def coverage_rows(prompt_len: int, response_len: int, start: int = 0) -> int:
    """Rows an engine returns for a sample: positions ``[start, P + R − 1)`` (DESIGN §3.1)."""
    for name, value in (("prompt_len", prompt_len), ("response_len", response_len), ("start", start)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise TraceError(f"{name}: expected a non-negative integer, got {value!r}")
    if prompt_len + response_len < 1:
        raise TraceError("prompt_len + response_len: expected at least 1 token, got 0")
    if start > prompt_len + response_len - 1:
        raise TraceError(f"start: expected at most P + R − 1 = {prompt_len + response_len - 1}, got {start}")
    return prompt_len + response_len - 1 - start


def _check_num_experts(num_experts: object) -> None:
    if (
        not isinstance(num_experts, (int, np.integer))
        or isinstance(num_experts, bool)
        or not 1 <= num_experts <= MAX_EXPERTS
    ):
        raise TraceError(f"num_experts: expected an integer in [1, {MAX_EXPERTS}], got {num_experts!r}")


def _as_integer_array(experts: object) -> npt.NDArray[np.integer[Any]]:
    """numpy (read-only too), torch tensors and nested lists → a 3-D integer numpy array."""
    if hasattr(experts, "detach") and hasattr(experts, "cpu"):  # a torch tensor, without importing torch
        experts = experts.detach().cpu().numpy()  # type: ignore[attr-defined]
    if isinstance(experts, np.ndarray):
        array = experts
    else:
        try:
            array = np.asarray(experts)
        except (ValueError, TypeError) as err:
            raise TraceError(
                f"experts: expected a rectangular [rows, layers, top_k] array of integers ({err})"
            ) from None
    if array.dtype.kind not in "iu":
        raise TraceError(
            f"experts: expected an integer dtype (int*/uint*), got {array.dtype}"
            + (" (ragged nested lists?)" if array.dtype == object else "")
        )
    if array.ndim != 3:
        raise TraceError(
            f"experts: expected 3 dimensions [rows, layers, top_k], got shape {tuple(array.shape)}"
        )
    return array


def _chunk_rows(layers: int) -> int:
    """Rows per chunk so that a chunk holds about ``_CHUNK_PAIRS`` (row, layer) pairs."""
    return max(1, _CHUNK_PAIRS // max(1, layers))


def _check_range(routes: npt.NDArray[np.integer[Any]], num_experts: int, start: int) -> None:
    """Every slot holds an id in ``[0, num_experts)``; checked on the input dtype, before any cast."""
    if routes.size == 0:
        return
    lo, hi = routes.min(), routes.max()
    if lo >= 0 and hi < num_experts:
        return
    bad = np.argwhere((routes < 0) | (routes >= num_experts))[0]
    row, layer, slot = (int(i) for i in bad)
    raise TraceError(
        f"experts[{row}, {layer}, {slot}] (position {start + row}, layer {layer}): id "
        f"{int(routes[row, layer, slot])} is outside [0, num_experts={num_experts})"
    )


def _repeated_pairs(chunk: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.bool_]:
    """For a chunk ``[rows, layers, k]``: which (row, layer) routes repeat an id.

    The chunk is transposed to ``[k, rows·layers]`` so that each of the k·(k−1)/2 pairwise
    comparisons is one contiguous vector operation.
    """
    rows, layers, k = chunk.shape
    columns = np.ascontiguousarray(chunk.reshape(-1, k).T)
    repeated = np.zeros(rows * layers, dtype=bool)
    equal = np.empty(rows * layers, dtype=bool)
    for i in range(k):
        for j in range(i + 1, k):
            np.equal(columns[i], columns[j], out=equal)
            repeated |= equal
    return repeated.reshape(rows, layers)


def validate_routes(
    routes: npt.NDArray[np.integer[Any]],
    num_experts: int,
    moe_slots: Sequence[int] | None = None,
    start: int = 0,
) -> None:
    """Check DESIGN §3.2 validity of ``routes [rows, layers, top_k]``; raise ``TraceError`` if broken.

    Every slot holds an id in ``[0, num_experts)``. MoE slots (``moe_slots``; all slots when
    None) hold ``top_k`` distinct ids; dense slots are not checked for distinctness. An all-zero
    MoE row with top_k > 1 is reported as such: it is how a skipped capture looks (vLLM #33013).
    """
    _check_num_experts(num_experts)
    rows, layers, k = routes.shape
    if not 1 <= k <= num_experts:
        raise TraceError(f"top_k: expected a value in [1, num_experts={num_experts}], got {k}")
    _check_range(routes, num_experts, start)
    if k == 1 or rows == 0:
        return
    moe_mask = np.zeros(layers, dtype=bool)
    moe_mask[list(range(layers)) if moe_slots is None else list(moe_slots)] = True
    if not moe_mask.any():
        return
    step = _chunk_rows(layers)
    for r0 in range(0, rows, step):
        chunk = routes[r0 : r0 + step]
        bad = _repeated_pairs(chunk) & moe_mask
        if bad.any():
            row, layer = (int(i) for i in np.argwhere(bad)[0])
            route = [int(x) for x in chunk[row, layer]]
            row += r0
            what = "all-zero MoE route (a skipped capture)" if not any(route) else "repeated expert id"
            raise TraceError(
                f"experts[{row}, {layer}] (position {start + row}, layer {layer}): {what} in route "
                f"{route}; expected top_k={k} distinct ids"
            )


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
        array = _as_integer_array(experts)
        _check_num_experts(num_experts)
        try:
            axis = LayerAxis(layer_axis)
        except ValueError:
            raise TraceError(
                f"layer_axis: expected one of {[a.value for a in LayerAxis]}, got {layer_axis!r}"
            ) from None
        if not isinstance(start, (int, np.integer)) or isinstance(start, bool) or start < 0:
            raise TraceError(f"start: expected a non-negative integer, got {start!r}")
        width = array.shape[1]
        if num_layers is None:
            num_layers = width if axis is LayerAxis.DECODER or moe_layers is None else max(moe_layers) + 1
        if moe_layers is None:
            moe_layers = range(num_layers)
        moe = tuple(int(i) for i in moe_layers)
        if list(moe) != sorted(set(moe)) or any(not 0 <= i < num_layers for i in moe):
            raise TraceError(
                f"moe_layers: expected distinct increasing decoder indices in [0, num_layers={num_layers}), "
                f"got {list(moe)}"
            )
        expected_width = num_layers if axis is LayerAxis.DECODER else len(moe)
        if width != expected_width:
            what = "num_layers" if axis is LayerAxis.DECODER else "the number of MoE layers"
            raise TraceError(
                f"experts: layer axis ({axis.value}) has {width} slots, expected {expected_width} ({what})"
            )
        slots = moe if axis is LayerAxis.DECODER else range(len(moe))
        validate_routes(array, int(num_experts), slots, int(start))
        stored = np.array(array, dtype=storage_dtype(int(num_experts)), order="C")
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

    # --- storage ------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The trace as a safetensors file: one tensor ``experts`` and JSON metadata with a CRC32."""
        from safetensors.numpy import save

        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "crc32": zlib.crc32(self._experts.data),
            **self.metadata(),
        }
        return save({_TENSOR_NAME: self._experts}, metadata={_METADATA_KEY: json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "<bytes>") -> RoutingTrace:
        """Read a trace written by ``to_bytes``; anything else raises ``TraceFileError``."""
        meta = _read_header_metadata(data, source)
        from safetensors import SafetensorError
        from safetensors.numpy import load

        try:
            tensors = load(data)
        except (SafetensorError, ValueError) as err:
            raise TraceFileError(f"{source}: not a readable safetensors file ({err})") from None
        if set(tensors) != {_TENSOR_NAME}:
            raise TraceFileError(
                f"{source}: expected exactly one tensor {_TENSOR_NAME!r}, got {sorted(tensors)}"
            )
        experts = tensors[_TENSOR_NAME]
        if zlib.crc32(np.ascontiguousarray(experts).data) != meta.get("crc32"):
            raise TraceFileError(
                f"{source}: crc32 of {_TENSOR_NAME!r} does not match its metadata (corrupted)"
            )
        try:
            prov = meta["provenance"]
            return cls(
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

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` atomically (a temporary file, then a rename)."""
        target = Path(path)
        data = self.to_bytes()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent or ".")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by ``save``."""
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise TraceFileError(f"{path}: cannot read ({err.strerror})") from None
        return cls.from_bytes(data, source=str(path))


def _read_header_metadata(data: bytes, source: str) -> dict[str, Any]:
    """Parse the safetensors header ourselves, so every failure gets a precise message."""
    if len(data) < 8:
        raise TraceFileError(f"{source}: {len(data)} bytes is too short for a safetensors header (truncated)")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise TraceFileError(
            f"{source}: header length {size} exceeds the {len(data) - 8} bytes that follow (truncated or foreign)"
        )
    try:
        header = json.loads(data[8 : 8 + size])
        meta = json.loads(header["__metadata__"][_METADATA_KEY])
    except (ValueError, KeyError, TypeError):
        raise TraceFileError(
            f"{source}: no routing-trace metadata in the safetensors header (not a trace file)"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise TraceFileError(f"{source}: metadata format is not {FORMAT_NAME!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise TraceFileError(
            f"{source}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}"
        )
    return meta


# --- set-based comparison (DESIGN §3.3) -------------------------------------------------------


@dataclass(frozen=True)
class RoutingComparison:
    """Per-(position, MoE layer) comparison of two traces of the same sample.

    Two routes are equal when their expert *sets* are equal: kernels order top-k differently.
    ``overlap[r, l]`` is ``|A ∩ B|`` for row r and MoE layer l (0..top_k).
    """

    overlap: npt.NDArray[np.uint8]
    top_k: int
    moe_layers: tuple[int, ...] = field(default=())

    @property
    def differs(self) -> npt.NDArray[np.bool_]:
        """``[rows, num_moe_layers]``: True where the two expert sets differ."""
        return self.overlap < self.top_k

    @property
    def disagreement(self) -> float:
        """Mean over (position, MoE layer) of [sets differ]; nan when there is nothing to compare."""
        return float(self.differs.mean()) if self.overlap.size else float("nan")

    @property
    def per_layer(self) -> npt.NDArray[np.float64]:
        """Disagreement of each MoE layer (model order); nan for every layer when there are no rows."""
        if self.overlap.shape[0] == 0:
            return np.full(self.overlap.shape[1], np.nan)
        return self.differs.mean(axis=0)

    @property
    def token_disagreement(self) -> float:
        """Fraction of positions whose route differs in at least one MoE layer."""
        return float(self.differs.any(axis=1).mean()) if self.overlap.size else float("nan")

    @property
    def topk_overlap(self) -> float:
        """Mean of ``|A ∩ B| / top_k`` over (position, MoE layer)."""
        return float(self.overlap.mean() / self.top_k) if self.overlap.size else float("nan")


def route_overlap(a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` for each (row, layer) of two valid route arrays ``[rows, layers, top_k]``.

    With distinct ids per route, ``|A ∩ B| = Σ_i Σ_j [a_i = b_j]``: k² vector comparisons on
    transposed, cache-sized chunks.
    """
    if a.shape != b.shape:
        raise TraceError(
            f"routes: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}; expected equal shapes"
        )
    rows, layers, k = a.shape
    out = np.empty((rows, layers), dtype=np.uint8)
    step = _chunk_rows(layers)
    for r0 in range(0, rows, step):
        ca = np.ascontiguousarray(a[r0 : r0 + step].reshape(-1, k).T)
        cb = np.ascontiguousarray(b[r0 : r0 + step].reshape(-1, k).T)
        count = np.zeros(ca.shape[1], dtype=np.uint8)
        equal = np.empty(ca.shape[1], dtype=bool)
        for i in range(k):
            for j in range(k):
                np.equal(ca[i], cb[j], out=equal)
                count += equal
        out[r0 : r0 + step] = count.reshape(-1, layers)
    return out


def compare(a: RoutingTrace, b: RoutingTrace) -> RoutingComparison:
    """Compare the MoE routes of two traces of the same sample, position by position.

    The traces may use different layer axes; they must cover the same positions, with the same
    ``top_k``, ``num_experts`` and MoE layers, otherwise ``TraceError`` says which field differs.
    """
    for name in ("start", "rows", "top_k", "num_experts", "moe_layers"):
        if getattr(a, name) != getattr(b, name):
            raise TraceError(
                f"{name}: traces differ ({getattr(a, name)} vs {getattr(b, name)}); expected equal"
            )
    return RoutingComparison(route_overlap(a.moe_routes(), b.moe_routes()), a.top_k, a.moe_layers)
