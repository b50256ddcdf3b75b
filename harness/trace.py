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

The checks and the comparison are vectorised and run over cache-sized chunks of rows, in one
thread per CPU: a trace of 256 × 4096 positions × 48 layers × top-8 is 400 MB, and both must run
near memory speed. When a route fits a machine word (``top_k · itemsize`` of 2, 4 or 8 bytes, e.g.
top-8 of uint8) they compare whole words and their lane rotations (SWAR) instead of transposing.
Files are safetensors written and parsed here, so that saving streams the ids straight from the
array and loading reads them into the buffer the trace keeps; a CRC-32 still covers the ids.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import operator
import os
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from harness.atomic import atomic_write
from harness.errors import TraceError, TraceFileError

MAX_EXPERTS = 1 << 16
"""The largest ``num_experts`` a trace can store (uint16)."""

MAX_LAYERS = 1 << 16
"""The longest layer axis a trace declares (``num_layers``, MoE layer indices, stored width).

Declared sizes are checked against this bound and against the data before anything is built
from them, so a forged ``num_layers`` in a 400-byte file cannot make the reader allocate."""

FORMAT_NAME = "rrh.routing_trace"
FORMAT_VERSION = 1
_METADATA_KEY = "routing_trace"
_TENSOR_NAME = "experts"

# Bytes of routes per chunk: a chunk and the kernels' few temporaries of its size stay in L2 cache.
_CHUNK_BYTES = 1 << 19
# Arrays smaller than this are processed on the calling thread only.
_PARALLEL_MIN_BYTES = 1 << 23

_T = TypeVar("_T")


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

    def __post_init__(self) -> None:
        for name in ("engine", "version", "convention"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TraceError(f"provenance.{name}: expected a string, got {value!r}")

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


def _check_size(name: str, value: object, upper: int) -> int:
    """``value`` as an int when it is an integer (not a bool, not a float) in ``[0, upper]``.

    Anything with ``__index__`` counts (numpy and 0-d torch integers); nothing is truncated.
    """
    try:
        number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if number is None or not 0 <= number <= upper:
        raise TraceError(f"{name}: expected an integer in [0, {upper}], got {value!r:.80}")
    return number


def _check_moe_layers(moe_layers: object) -> tuple[int, ...]:
    """Declared MoE layer indices: a sequence of distinct increasing integers in ``[0, MAX_LAYERS)``.

    Checked element by element, without converting: ``"012"``, ``[0.5]`` or ``[True]`` are not
    indices, and a sequence longer than ``MAX_LAYERS`` is refused before it is walked.
    """
    if isinstance(moe_layers, (str, bytes, Mapping)) or not isinstance(moe_layers, Collection):
        raise TraceError(
            f"moe_layers: expected a sequence of decoder layer indices, got {type(moe_layers).__name__} "
            f"{moe_layers!r:.80}"
        )
    if len(moe_layers) > MAX_LAYERS:
        raise TraceError(
            f"moe_layers: expected at most MAX_LAYERS={MAX_LAYERS} indices, got {len(moe_layers)}"
        )
    moe = tuple(_check_size(f"moe_layers[{n}]", i, MAX_LAYERS - 1) for n, i in enumerate(moe_layers))
    if any(a >= b for a, b in itertools.pairwise(moe)):
        raise TraceError(f"moe_layers: expected distinct increasing decoder indices, got {list(moe)}")
    return moe


def _as_integer_array(experts: object) -> npt.NDArray[np.integer[Any]]:
    """numpy (read-only too), torch tensors and nested lists → a 3-D integer numpy array."""
    if hasattr(experts, "detach") and hasattr(experts, "cpu"):  # a torch tensor, without importing torch
        try:
            experts = experts.detach().cpu().numpy()  # type: ignore[attr-defined]
        except (TypeError, RuntimeError):  # numpy has no such dtype (bfloat16, float8, …)
            raise TraceError(
                f"experts: expected an integer dtype (int*/uint*), got {getattr(experts, 'dtype', '?')}"
            ) from None
    if isinstance(experts, np.ndarray):
        array = experts
    else:
        try:
            array = np.asarray(experts)
        except (ValueError, TypeError, OverflowError, RecursionError) as err:
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


# --- chunked, threaded kernels ----------------------------------------------------------------
#
# The kernels walk cache-sized chunks of rows. Large arrays are split into one contiguous span of
# chunks per CPU, each scanned by its own thread: numpy releases the GIL inside every vector
# operation, so the spans run in parallel.


def _chunk_rows(row_bytes: int) -> int:
    """Rows per chunk so that a chunk of routes holds about ``_CHUNK_BYTES`` bytes."""
    return max(1, _CHUNK_BYTES // max(1, row_bytes))


def _workers() -> int:
    """CPUs this process may run on (never more threads than that: no oversubscription)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _map_spans(fn: Callable[[int, int], _T], length: int, nbytes: int) -> list[_T]:
    """``fn(lo, hi)`` over contiguous spans covering ``[0, length)``, in order.

    One span per CPU, each in its own thread, when the work is at least ``_PARALLEL_MIN_BYTES``;
    otherwise one span on the calling thread (threads would cost more than they save).
    """
    spans = _workers() if nbytes >= _PARALLEL_MIN_BYTES else 1
    bounds = [length * i // spans for i in range(spans + 1)]
    pairs = [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]
    if len(pairs) <= 1:
        return [fn(lo, hi) for lo, hi in pairs]
    with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        return list(pool.map(lambda span: fn(*span), pairs))


@dataclass(frozen=True)
class _Words:
    """A route as one unsigned machine *word* whose *lanes* are its ids (SWAR).

    When ``k`` ids of ``itemsize`` bytes make 2, 4 or 8 bytes, a chunk of routes viewed as words
    is processed with whole-word operations: no transpose, and one vector operation handles every
    lane of every route. Lane ``i`` of ``rotate(w, s)`` is lane ``(i + s) mod k`` of ``w`` (lanes
    are whole ids in any byte order), so comparing ``w`` with its rotations compares id pairs.
    """

    k: int
    lane: np.dtype[Any]
    word: np.dtype[Any]

    @classmethod
    def of(cls, dtype: np.dtype[Any], k: int) -> _Words | None:
        """The word view of routes of ``k`` ids of ``dtype``, or None when no word fits them."""
        width = k * dtype.itemsize
        if width not in (2, 4, 8):
            return None
        return cls(k, np.dtype(f"u{dtype.itemsize}"), np.dtype(f"u{width}"))

    def view(self, routes: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
        """One word per route of ``routes [rows, layers, k]`` (a view when already contiguous)."""
        return np.ascontiguousarray(routes).reshape(-1).view(self.word)

    def lanes(self, words: npt.NDArray[np.unsignedinteger[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
        return words.view(self.lane)

    def rotate(
        self, words: npt.NDArray[Any], s: int, out: npt.NDArray[Any], scratch: npt.NDArray[Any]
    ) -> None:
        """``out = rotate(words, s)``: lanes shifted down by ``s``, the low ones wrapping to the top."""
        bits = 8 * self.lane.itemsize * s
        np.right_shift(words, self.word.type(bits), out=out)
        np.left_shift(words, self.word.type(8 * self.word.itemsize - bits), out=scratch)
        np.bitwise_or(out, scratch, out=out)


def _in_range(chunk: npt.NDArray[np.integer[Any]], num_experts: int) -> bool:
    """All ids of ``chunk`` lie in ``[0, num_experts)``; compared in the chunk's own dtype."""
    if chunk.size == 0:
        return True
    return bool(chunk.max() < num_experts) and (chunk.dtype.kind == "u" or bool(chunk.min() >= 0))


def _check_range(routes: npt.NDArray[np.integer[Any]], num_experts: int, start: int) -> None:
    """Every slot holds an id in ``[0, num_experts)``; checked on the input dtype, before any cast."""
    if _in_range(routes, num_experts):
        return
    bad = np.argwhere((routes < 0) | (routes >= num_experts))[0]
    row, layer, slot = (int(i) for i in bad)
    raise TraceError(
        f"experts[{row}, {layer}, {slot}] (position {start + row}, layer {layer}): id "
        f"{int(routes[row, layer, slot])} is outside [0, num_experts={num_experts})"
    )


def _repeated_pairs(chunk: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.bool_]:
    """For a chunk ``[rows, layers, k]``: which (row, layer) routes repeat an id.

    The general kernel, for any ``k`` and dtype: the chunk is transposed to ``[k, rows·layers]``
    so that each of the k·(k−1)/2 pairwise comparisons is one contiguous vector operation.
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


def _repeat_lanes(
    spec: _Words, words: npt.NDArray[Any], acc: npt.NDArray[Any], scratch: tuple[npt.NDArray[Any], ...]
) -> npt.NDArray[Any]:
    """Lanes of ``min over s = 1..k//2 of words ^ rotate(words, s)``: a route repeats an id iff a lane is 0.

    Rotations by ``s`` and ``k − s`` compare the same pairs, so ``k // 2`` rotations cover all
    k·(k−1)/2 pairs; the lane-wise minimum keeps a zero wherever any pair was equal.
    """
    tmp, tmp2 = scratch
    for s in range(1, spec.k // 2 + 1):
        target = acc if s == 1 else tmp
        spec.rotate(words, s, out=target, scratch=tmp2)
        np.bitwise_xor(target, words, out=target)
        if s > 1:
            np.minimum(spec.lanes(acc), spec.lanes(tmp), out=spec.lanes(acc))
    return spec.lanes(acc)


def _first_invalid_chunk(
    routes: npt.NDArray[np.integer[Any]], num_experts: int, moe_mask: npt.NDArray[np.bool_], step: int
) -> int | None:
    """Row of the first chunk holding an out-of-range id or a repeated id in a MoE slot, if any.

    Exact, and fast: one pass over ``routes``, with a range check and (for top_k > 1) a
    distinctness check on each chunk while it is in cache, spans of chunks in parallel threads.
    """
    rows, layers, k = routes.shape
    spec = _Words.of(routes.dtype, k)
    check_repeats = k > 1 and bool(moe_mask.any())
    dense = np.flatnonzero(~moe_mask)

    def chunk_repeats(chunk: npt.NDArray[np.integer[Any]], buffers: tuple[npt.NDArray[Any], ...]) -> bool:
        if spec is None:
            return bool((_repeated_pairs(chunk) & moe_mask).any())
        words = spec.view(chunk)
        acc, *scratch = (buffer[: words.size] for buffer in buffers)
        lanes = _repeat_lanes(spec, words, acc, tuple(scratch))
        if dense.size:  # dense slots may repeat ids (filler): mark them distinct
            acc.reshape(-1, layers)[:, dense] = np.iinfo(spec.word).max
        return bool(lanes.min() == 0)

    def scan(lo: int, hi: int) -> int | None:
        buffers = tuple(np.empty(step * layers, spec.word) for _ in range(3)) if spec else ()
        for r0 in range(lo, hi, step):
            chunk = routes[r0 : min(r0 + step, hi)]
            if not _in_range(chunk, num_experts) or (check_repeats and chunk_repeats(chunk, buffers)):
                return r0
        return None

    found = [r0 for r0 in _map_spans(scan, rows, routes.nbytes) if r0 is not None]
    return found[0] if found else None


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
    An out-of-range id anywhere is reported before any repeated id.
    """
    _check_num_experts(num_experts)
    rows, layers, k = routes.shape
    if not 1 <= k <= num_experts:
        raise TraceError(f"top_k: expected a value in [1, num_experts={num_experts}], got {k}")
    moe_mask = np.zeros(layers, dtype=bool)
    if k > 1 and rows:  # only then do the slots matter (and only then are they looked at)
        moe_mask[list(range(layers)) if moe_slots is None else list(moe_slots)] = True
    step = _chunk_rows(layers * k * routes.dtype.itemsize)
    r0 = _first_invalid_chunk(routes, num_experts, moe_mask, step)
    if r0 is None:
        return
    _check_range(routes, num_experts, start)  # an id out of range anywhere comes first
    chunk = routes[r0 : r0 + step]
    row, layer = (int(i) for i in np.argwhere(_repeated_pairs(chunk) & moe_mask)[0])
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
        self._build(experts, True, num_experts, moe_layers, num_layers, layer_axis, start, provenance)

    @classmethod
    def _adopt(cls, experts: npt.NDArray[np.integer[Any]], **kwargs: Any) -> RoutingTrace:
        """Like the constructor, but keeps ``experts`` itself when it already has the stored dtype.

        Only for arrays nobody else can write to — a view of immutable ``bytes``, or a buffer just
        read from a file — where it saves a copy of the whole trace. Validation is the same.
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
        array = _as_integer_array(experts)
        _check_num_experts(num_experts)
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
        width = _check_size("experts: layer axis width", array.shape[1], MAX_LAYERS)
        moe = None if moe_layers is None else _check_moe_layers(moe_layers)
        if axis is LayerAxis.MOE_ORDINAL and moe == ():
            raise TraceError(
                "moe_layers: expected at least one MoE layer on the moe_ordinal axis (one slot per MoE layer)"
            )
        if num_layers is None:
            num_layers = width if axis is LayerAxis.DECODER or moe is None else moe[-1] + 1
        num_layers = _check_size("num_layers", num_layers, MAX_LAYERS)
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

    # --- storage ------------------------------------------------------------------------------

    def _file_parts(self) -> tuple[bytes, memoryview]:
        """The safetensors file as its header (length + JSON) and the tensor bytes, uncopied."""
        data = _byte_view(self._experts.astype(self._experts.dtype.newbyteorder("<"), copy=False))
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "crc32": _crc32(data),
            "metadata_crc32": _metadata_crc32(self.metadata()),
            **self.metadata(),
        }
        return _safetensors_header(meta, self._experts), data

    def to_bytes(self) -> bytes:
        """The trace as a safetensors file: one tensor ``experts`` and JSON metadata with a CRC32."""
        return b"".join(self._file_parts())

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "<bytes>") -> RoutingTrace:
        """Read a trace written by ``to_bytes``; anything else raises ``TraceFileError``."""
        return cls._decode(data, source, owned=isinstance(data, bytes))

    @classmethod
    def _decode(cls, data: bytes | npt.NDArray[np.uint8], source: str, owned: bool) -> RoutingTrace:
        """Check and read a trace file's bytes; ``owned``: nobody else can write to ``data``.

        The ids are a view of ``data`` (an owned buffer is adopted, not copied); their CRC32 is
        checked and the trace validated like any other.
        """
        meta, experts = _read_trace_file(data, source)
        if _crc32(_byte_view(experts)) != meta.get("crc32"):
            raise TraceFileError(
                f"{source}: crc32 of {_TENSOR_NAME!r} does not match its metadata (corrupted)"
            )
        if _metadata_crc32({k: meta.get(k) for k in _METADATA_FIELDS}) != meta.get("metadata_crc32"):
            raise TraceFileError(f"{source}: metadata_crc32 does not match the metadata (corrupted)")
        try:
            prov = meta["provenance"]
            if not isinstance(prov, dict):
                raise TraceError(
                    f"provenance: expected an object with engine, version, convention, got {prov!r:.80}"
                )
            fields = {
                "num_experts": meta["num_experts"],
                "moe_layers": meta["moe_layers"],
                "num_layers": meta["num_layers"],
                "layer_axis": meta["layer_axis"],
                "start": meta["start"],
                "provenance": Provenance(prov["engine"], prov["version"], prov["convention"]),
            }
            return cls._adopt(experts, **fields) if owned else cls(experts, **fields)
        except (KeyError, TypeError) as err:
            raise TraceFileError(f"{source}: metadata field missing or malformed: {err}") from None
        except TraceError as err:
            raise TraceFileError(f"{source}: stored trace is invalid: {err}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to ``path`` atomically (``harness.atomic``: a temporary file, fsync, rename)."""
        header, data = self._file_parts()

        def write(handle: Any) -> None:
            handle.write(header)
            handle.write(data)

        atomic_write(path, write)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by ``save``."""
        try:
            data = _read_file(Path(path))
        except OSError as err:
            raise TraceFileError(f"{path}: cannot read ({err.strerror})") from None
        return cls._decode(data, str(path), owned=True)


# --- the file format: safetensors with one tensor and JSON metadata ---------------------------

_SAFETENSORS_DTYPES = {
    name: np.dtype(code)
    for name, code in (
        ("U8", "<u1"),
        ("I8", "<i1"),
        ("U16", "<u2"),
        ("I16", "<i2"),
        ("U32", "<u4"),
        ("I32", "<i4"),
        ("U64", "<u8"),
        ("I64", "<i8"),
    )
}
"""safetensors' names of the integer dtypes (the stored ids are U8 or U16; the rest are read too)."""

_CRC32_POLY = 0xEDB88320


def _safetensors_header(meta: dict[str, Any], experts: npt.NDArray[Any]) -> bytes:
    """The bytes before the tensor data, exactly as ``safetensors.numpy.save`` writes them.

    An 8-byte little-endian length, then the compact JSON header padded with spaces to a multiple
    of 8 bytes (so the data is aligned). Writing it ourselves lets ``save`` stream the ids to the
    file without building the whole file in memory first.
    """
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header = {
        "__metadata__": {_METADATA_KEY: json.dumps(meta)},
        _TENSOR_NAME: {
            "dtype": names[experts.dtype.newbyteorder("<")],
            "shape": list(experts.shape),
            "data_offsets": [0, experts.nbytes],
        },
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _read_file(path: Path) -> npt.NDArray[np.uint8]:
    """The bytes of ``path`` in a new numpy buffer: one copy out of the page cache, none after."""
    with open(path, "rb", buffering=0) as handle:
        buffer = np.empty(os.fstat(handle.fileno()).st_size, dtype=np.uint8)
        view, filled = buffer.data, 0
        while filled < buffer.size and (count := handle.readinto(view[filled:])):
            filled += count
    return buffer[:filled]


def _read_trace_file(
    data: bytes | npt.NDArray[np.uint8], source: str
) -> tuple[dict[str, Any], npt.NDArray[np.integer[Any]]]:
    """The routing-trace metadata and a view of the ids in a safetensors file's bytes.

    Parses and checks the header ourselves (one tensor ``experts`` of an integer dtype whose
    offsets and shape account for every byte after the header), so that each failure raises
    ``TraceFileError`` with a precise message and the ids need not be copied.
    """
    size, header, meta = _read_header(data, source)
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    if set(tensors) != {_TENSOR_NAME}:
        raise TraceFileError(f"{source}: expected exactly one tensor {_TENSOR_NAME!r}, got {sorted(tensors)}")
    info = tensors[_TENSOR_NAME]
    info = info if isinstance(info, dict) else {}
    raw_dtype = info.get("dtype")
    dtype = _SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
    shape = info.get("shape")
    if (
        dtype is None
        or not isinstance(shape, list)
        or len(shape) != 3
        or not all(_is_count(n) for n in shape)
        or shape[1] > MAX_LAYERS
        or shape[2] > MAX_EXPERTS
    ):
        raise TraceFileError(
            f"{source}: not a readable safetensors file (tensor {_TENSOR_NAME!r}: expected an integer dtype "
            f"and a shape [rows, layers ≤ {MAX_LAYERS}, top_k ≤ {MAX_EXPERTS}] of non-negative integers, "
            f"got {info!r:.200})"
        )
    count = math.prod(shape)
    available = len(data) - 8 - size
    if info.get("data_offsets") != [0, count * dtype.itemsize] or available != count * dtype.itemsize:
        raise TraceFileError(
            f"{source}: not a readable safetensors file (tensor {_TENSOR_NAME!r} of shape {shape} needs "
            f"{count * dtype.itemsize} bytes at offsets [0, {count * dtype.itemsize}], header says "
            f"{info.get('data_offsets')!r} and {available} bytes follow the header: truncated or corrupted)"
        )
    experts = np.frombuffer(data, dtype=dtype, count=count, offset=8 + size).reshape(shape)
    return meta, experts


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_header(
    data: bytes | npt.NDArray[np.uint8], source: str
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """The header length, the JSON header and the routing-trace metadata of a safetensors file."""
    if len(data) < 8:
        raise TraceFileError(f"{source}: {len(data)} bytes is too short for a safetensors header (truncated)")
    size = int.from_bytes(bytes(data[:8]), "little")
    if size > len(data) - 8:
        raise TraceFileError(
            f"{source}: header length {size} exceeds the {len(data) - 8} bytes that follow "
            "(truncated or foreign)"
        )
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
        meta = json.loads(header["__metadata__"][_METADATA_KEY])
    except RecursionError:
        raise TraceFileError(f"{source}: safetensors header nested too deeply (not a trace file)") from None
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
    return size, header, meta


def _byte_view(array: npt.NDArray[Any]) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (no copy; empty arrays too)."""
    return array.reshape(-1).view(np.uint8).data


_METADATA_FIELDS = ("num_experts", "num_layers", "moe_layers", "layer_axis", "start", "provenance")


def _metadata_crc32(metadata: dict[str, Any]) -> int:
    """CRC-32 of the metadata's canonical JSON: a flipped byte in a stored value cannot go unseen."""
    return zlib.crc32(json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode())


def _crc32(data: memoryview) -> int:
    """zlib's CRC-32 of a flat byte buffer; large ones in parallel spans, combined exactly."""
    parts = _map_spans(lambda lo, hi: (zlib.crc32(data[lo:hi]), hi - lo), len(data), len(data))
    crc = 0
    for part, length in parts:
        crc = _crc32_combine(crc, part, length)
    return crc


def _crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's crc32_combine).

    ``crc(A + B) = crc(A) · x^(8·len(B)) + crc(B)`` over GF(2) modulo the CRC polynomial; the power
    is built by repeated squaring from x^8 (one byte), so this costs ~32 small multiplications.
    """
    power, square = 1 << 31, 1 << 23  # x^0 and x^8, in the reflected bit order of CRC-32
    while length2:
        if length2 & 1:
            power = _gf2_multiply(square, power)
        square = _gf2_multiply(square, square)
        length2 >>= 1
    return _gf2_multiply(power, crc1) ^ crc2


def _gf2_multiply(a: int, b: int) -> int:
    """``a · b`` modulo the CRC-32 polynomial, both in reflected bit order (zlib's multmodp)."""
    product = 0
    for bit in range(31, -1, -1):
        if a >> bit & 1:
            product ^= b
        b = (b >> 1) ^ _CRC32_POLY if b & 1 else b >> 1
    return product


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
        # A count, not ``differs.mean()``: the same float, without converting every flag to float64.
        return np.count_nonzero(self.differs) / self.overlap.size if self.overlap.size else float("nan")

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


def _overlap_pairs(
    a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]], out: npt.NDArray[np.uint8]
) -> None:
    """``out = |A ∩ B|`` per route of two chunks ``[rows, layers, k]``; the general kernel.

    With distinct ids per route, ``|A ∩ B| = Σ_i Σ_j [a_i = b_j]``: k² vector comparisons on the
    chunks transposed to ``[k, rows·layers]``.
    """
    k = a.shape[-1]
    ca = np.ascontiguousarray(a.reshape(-1, k).T)
    cb = np.ascontiguousarray(b.reshape(-1, k).T)
    out.fill(0)
    equal = np.empty(ca.shape[1], dtype=bool)
    for i in range(k):
        for j in range(k):
            np.equal(ca[i], cb[j], out=equal)
            out += equal


def _overlap_lanes(spec: _Words, a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` per route of two word arrays whose routes hold distinct ids (SWAR).

    Lane i of ``a ^ rotate(b, s)`` is 0 iff ``a_i = b_(i+s) mod k``; as b's ids are distinct, lane
    i of the minimum over all k rotations is 0 iff ``a_i ∈ B``, so ``|A ∩ B|`` is the number of
    zero lanes: a popcount of the zero-lane flags (one 0/1 byte per lane, k bytes per route).
    """
    acc = np.bitwise_xor(a, b)
    rotated, scratch = np.empty_like(b), np.empty_like(b)
    for s in range(1, spec.k):
        spec.rotate(b, s, out=rotated, scratch=scratch)
        np.bitwise_xor(rotated, a, out=rotated)
        np.minimum(spec.lanes(acc), spec.lanes(rotated), out=spec.lanes(acc))
    return np.bitwise_count((spec.lanes(acc) == 0).view(f"u{spec.k}"))


class _OverlapScan:
    """``|A ∩ B|`` per route over a span of word chunks: equal words first, sets only where they differ.

    Two recordings of one sample mostly agree word for word, and an identical word is an
    identical set (overlap k) after one comparison. The set kernel ``_overlap_lanes`` runs on the
    other routes only: on the whole chunk when most differ (lanes permuted by another kernel),
    otherwise on differing routes gathered over several chunks, so that each of its vector
    operations still covers a chunk's worth of routes rather than paying numpy's per-call cost.
    """

    def __init__(self, spec: _Words, out: npt.NDArray[np.uint8], batch: int) -> None:
        self.spec, self.out, self.batch = spec, out, batch
        self.pending: list[tuple[npt.NDArray[np.intp], npt.NDArray[Any], npt.NDArray[Any]]] = []
        self.pending_size = 0

    def chunk(self, offset: int, a: npt.NDArray[Any], b: npt.NDArray[Any]) -> None:
        """Fill ``out[offset : offset + len(a)]`` now, or queue the routes whose words differ."""
        target = self.out[offset : offset + a.size]
        differ = a != b
        count = int(np.count_nonzero(differ))
        if count * 4 > a.size:
            target[:] = _overlap_lanes(self.spec, a, b)
            return
        target.fill(self.spec.k)
        if count:
            where = np.flatnonzero(differ)
            self.pending.append((where + offset, a[where], b[where]))
            self.pending_size += count
            if self.pending_size >= self.batch:
                self.flush()

    def flush(self) -> None:
        """Run the set kernel on the queued routes and scatter their overlaps into ``out``."""
        if self.pending:
            where, a, b = (np.concatenate(parts) for parts in zip(*self.pending, strict=True))
            self.out[where] = _overlap_lanes(self.spec, a, b)
            self.pending, self.pending_size = [], 0


def route_overlap(a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` for each (row, layer) of two valid route arrays ``[rows, layers, top_k]``.

    Both arrays must hold distinct ids in every route (as every ``RoutingTrace`` MoE slot does).
    Routes that fit a machine word use the SWAR kernels (``_OverlapScan``), others the general
    one; cache-sized chunks, spans of chunks in parallel threads.
    """
    if a.shape != b.shape:
        raise TraceError(
            f"routes: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}; expected equal shapes"
        )
    rows, layers, k = a.shape
    out = np.empty((rows, layers), dtype=np.uint8)
    flat = out.reshape(-1)
    spec = _Words.of(a.dtype, k) if a.dtype == b.dtype else None
    step = _chunk_rows(layers * k * a.dtype.itemsize)

    def scan(lo: int, hi: int) -> None:
        words = _OverlapScan(spec, flat, step * layers) if spec else None
        for r0 in range(lo, hi, step):
            r1 = min(r0 + step, hi)
            if words is None:
                _overlap_pairs(a[r0:r1], b[r0:r1], flat[r0 * layers : r1 * layers])
            else:
                assert spec is not None  # words exist only for a word-sized route
                words.chunk(r0 * layers, spec.view(a[r0:r1]), spec.view(b[r0:r1]))
        if words is not None:
            words.flush()

    _map_spans(scan, rows, a.nbytes + b.nbytes)
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
