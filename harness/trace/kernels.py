"""Chunked, threaded numpy kernels over route arrays ``[rows, layers, top_k]``.

A trace of 256 × 4096 positions × 48 layers × top-8 is 400 MB, and validating or comparing it
must run near memory speed. The kernels walk cache-sized chunks of rows, so that each vector
operation's operands and temporaries stay in the core's L2 cache; large arrays are split into one
contiguous span of chunks per CPU, each scanned by its own thread (numpy releases the GIL inside
every vector operation, so the spans run in parallel).

When a route fits a machine word (``top_k · itemsize`` of 2, 4 or 8 bytes, e.g. top-8 of uint8)
the kernels compare whole words and their lane rotations (SWAR) instead of transposing the chunk;
other routes use the general kernels, which transpose a chunk to ``[top_k, routes]``.

These functions assume what their callers check: arrays of three dimensions, unsigned or signed
integers, and (for the overlap) distinct ids in every route. Errors are the callers' to word.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

CHUNK_BYTES = 1 << 19
"""Bytes of routes per chunk: numpy's per-call cost stays small, the temporaries stay in cache.

Measured on the benchmark's routes (one thread): 64 KiB chunks take 1.6× the time of 512 KiB
ones, 1 MiB chunks 1.1×."""

PARALLEL_MIN_BYTES = 1 << 23
"""Arrays smaller than this are processed on the calling thread only."""

_T = TypeVar("_T")


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk so that a chunk of routes holds about ``CHUNK_BYTES`` bytes."""
    return max(1, CHUNK_BYTES // max(1, row_bytes))


def workers() -> int:
    """CPUs this process may run on (never more threads than that: no oversubscription)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def map_spans(fn: Callable[[int, int], _T], length: int, nbytes: int) -> list[_T]:
    """``fn(lo, hi)`` over contiguous spans covering ``[0, length)``, in order.

    One span per CPU, each in its own thread, when the work is at least ``PARALLEL_MIN_BYTES``;
    otherwise one span on the calling thread (threads would cost more than they save).
    """
    spans = workers() if nbytes >= PARALLEL_MIN_BYTES else 1
    bounds = [length * i // spans for i in range(spans + 1)]
    pairs = [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]
    if len(pairs) <= 1:
        return [fn(lo, hi) for lo, hi in pairs]
    with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        return list(pool.map(lambda span: fn(*span), pairs))


@dataclass(frozen=True)
class Words:
    """A route as one unsigned machine *word* whose *lanes* are its ids (SWAR).

    When ``k`` ids of ``itemsize`` bytes make 2, 4 or 8 bytes, a chunk of routes viewed as words
    is processed with whole-word operations: no transpose, and one vector operation handles every
    lane of every route. Lane ``i`` of ``rotate(w, s)`` is lane ``(i + s) mod k`` of ``w`` (lanes
    are whole ids in any byte order), so comparing ``w`` with its rotations compares id pairs.
    """

    k: int
    lane: np.dtype[Any]
    word: np.dtype[Any]
    # The shift counts of each rotation, as scalars of the word type (made once, not per call).
    _shifts: tuple[tuple[Any, Any], ...] = field(repr=False, compare=False)

    @classmethod
    def of(cls, dtype: np.dtype[Any], k: int) -> Words | None:
        """The word view of routes of ``k`` ids of ``dtype``, or None when no word fits them."""
        width = k * dtype.itemsize
        if width not in (2, 4, 8):
            return None
        word = np.dtype(f"u{width}")
        bits = [8 * dtype.itemsize * s for s in range(k)]
        shifts = tuple((word.type(b), word.type(8 * width - b)) for b in bits)
        return cls(k, np.dtype(f"u{dtype.itemsize}"), word, shifts)

    def view(self, routes: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
        """One word per route of ``routes [rows, layers, k]`` (a view when already contiguous)."""
        return np.ascontiguousarray(routes).reshape(-1).view(self.word)

    def lanes(self, words: npt.NDArray[np.unsignedinteger[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
        return words.view(self.lane)

    def rotate(
        self, words: npt.NDArray[Any], s: int, out: npt.NDArray[Any], scratch: npt.NDArray[Any]
    ) -> None:
        """``out = rotate(words, s)`` for ``0 < s < k``: lanes shifted down by ``s``, the low ones on top."""
        down, up = self._shifts[s]
        np.right_shift(words, down, out=out)
        np.left_shift(words, up, out=scratch)
        np.bitwise_or(out, scratch, out=out)

    def buffers(self, size: int, count: int) -> list[npt.NDArray[Any]]:
        """``count`` word arrays of ``size`` words, reused chunk after chunk (no allocation per chunk)."""
        return [np.empty(size, self.word) for _ in range(count)]


# --- validation ---------------------------------------------------------------------------------


def in_range(chunk: npt.NDArray[np.integer[Any]], num_experts: int) -> bool:
    """All ids of ``chunk`` lie in ``[0, num_experts)``; compared in the chunk's own dtype."""
    if chunk.size == 0:
        return True
    return bool(chunk.max() < num_experts) and (chunk.dtype.kind == "u" or bool(chunk.min() >= 0))


def repeated_pairs(chunk: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.bool_]:
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


def tag_dtype(num_experts: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype whose top bit no id in ``[0, num_experts)`` sets: room for a tag."""
    return next(
        np.dtype(d)
        for d in (np.uint8, np.uint16, np.uint32)
        if num_experts <= 1 << (8 * np.dtype(d).itemsize - 1)
    )


class _RepeatScan:
    """Whether a chunk of routes repeats an id in a route: ``k − 1`` comparisons of shifted bytes.

    The chunk's ids are laid out flat, route after route, and each id is tagged with its route's
    parity in the top bit of ``tag_dtype`` (which no id uses). Comparing the flat array with
    itself shifted by ``s = 1 .. k − 1`` compares every pair of ids of a route once; a pair that
    straddles two neighbouring routes carries two different tags and never compares equal. Each
    comparison is one contiguous vector operation and a count, whatever ``k`` and the dtype are:
    about half the work of comparing lane rotations of machine words, and no transpose.
    """

    def __init__(self, k: int, num_experts: int, size: int) -> None:
        lane = tag_dtype(num_experts)
        parity = np.array([0, 1 << (8 * lane.itemsize - 1)], dtype=lane)
        self.k = k
        self.tags = np.resize(np.repeat(parity, k), size)
        self.tagged = np.empty(size, dtype=lane)
        self.equal = np.empty(size, dtype=bool)

    def repeats(self, chunk: npt.NDArray[np.integer[Any]]) -> bool:
        """``chunk [rows, layers, k]`` (ids in range, checked first) holds a route with a repeated id."""
        flat = chunk.reshape(-1)
        n = flat.size
        tagged = self.tagged[:n]
        np.bitwise_or(flat, self.tags[:n], out=tagged, casting="unsafe")  # exact: ids are in range
        for s in range(1, self.k):
            equal = self.equal[: n - s]
            np.equal(tagged[:-s], tagged[s:], out=equal)
            if equal.view(np.uint8).max():  # a byte reduction: twice as fast as count_nonzero here
                return True
        return False


def first_invalid_chunk(
    routes: npt.NDArray[np.integer[Any]], num_experts: int, moe_mask: npt.NDArray[np.bool_], step: int
) -> int | None:
    """Row of the first chunk of ``step`` rows holding an out-of-range id or a repeated id in a MoE slot.

    Exact, and fast: one pass over ``routes``, with a range check and (for top_k > 1) a
    distinctness check (``_RepeatScan``) on each chunk while it is in cache, spans of chunks in
    parallel threads. ``moe_mask[layer]`` says which layer slots must hold distinct ids (dense
    ones hold filler that may repeat: they are left out of the distinctness check).
    """
    rows, layers, k = routes.shape
    moe = np.flatnonzero(moe_mask)
    check_repeats = k > 1 and moe.size > 0
    every_slot = moe.size == layers

    def scan(lo: int, hi: int) -> int | None:
        repeats = _RepeatScan(k, num_experts, step * moe.size * k) if check_repeats else None
        for r0 in range(lo, hi, step):
            chunk = routes[r0 : min(r0 + step, hi)]
            if not in_range(chunk, num_experts):
                return r0
            if repeats is not None and repeats.repeats(chunk if every_slot else chunk[:, moe]):
                return r0
        return None

    found = [r0 for r0 in map_spans(scan, rows, routes.nbytes) if r0 is not None]
    return found[0] if found else None


# --- set overlap ----------------------------------------------------------------------------------


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


class _OverlapScan:
    """``|A ∩ B|`` per route over a span of word chunks: equal words first, sets only where they differ.

    Two recordings of one sample mostly agree word for word, and an identical word is an
    identical set (overlap k) after one comparison. The set kernel ``lanes`` runs on the other
    routes only: on the whole chunk when most differ (lanes permuted by another kernel),
    otherwise on differing routes gathered over several chunks, so that each of its vector
    operations still covers a chunk's worth of routes rather than paying numpy's per-call cost.
    """

    def __init__(self, spec: Words, out: npt.NDArray[np.uint8], batch: int) -> None:
        self.spec, self.out, self.batch = spec, out, batch
        self.pending: list[tuple[npt.NDArray[np.intp], npt.NDArray[Any], npt.NDArray[Any]]] = []
        self.pending_size = 0
        self.buffers = spec.buffers(batch, 3)
        self.differ = np.empty(batch, dtype=bool)
        self.zero = np.empty(batch * spec.k, dtype=bool)

    def lanes(self, a: npt.NDArray[Any], b: npt.NDArray[Any], out: npt.NDArray[np.uint8]) -> None:
        """``out = |A ∩ B|`` per route of two word arrays whose routes hold distinct ids (SWAR).

        Lane i of ``a ^ rotate(b, s)`` is 0 iff ``a_i = b_(i+s) mod k``; as b's ids are distinct,
        lane i of the minimum over all k rotations is 0 iff ``a_i ∈ B``, so ``|A ∩ B|`` is the
        number of zero lanes: a popcount of the zero-lane flags (one 0/1 byte per lane).
        """
        spec, n = self.spec, a.size
        acc, rotated, scratch = (buffer[:n] for buffer in self.buffers)
        np.bitwise_xor(a, b, out=acc)
        for s in range(1, spec.k):
            spec.rotate(b, s, out=rotated, scratch=scratch)
            np.bitwise_xor(rotated, a, out=rotated)
            np.minimum(spec.lanes(acc), spec.lanes(rotated), out=spec.lanes(acc))
        zero = self.zero[: n * spec.k]
        np.equal(spec.lanes(acc), 0, out=zero)
        np.bitwise_count(zero.view(f"u{spec.k}"), out=out)

    def chunk(self, offset: int, a: npt.NDArray[Any], b: npt.NDArray[Any]) -> None:
        """Fill ``out[offset : offset + len(a)]`` now, or queue the routes whose words differ."""
        target = self.out[offset : offset + a.size]
        differ = self.differ[: a.size]
        np.not_equal(a, b, out=differ)
        count = int(np.count_nonzero(differ))
        if count * 4 > a.size:
            self.lanes(a, b, target)
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
        if not self.pending:
            return
        where, a, b = (np.concatenate(parts) for parts in zip(*self.pending, strict=True))
        self.pending, self.pending_size = [], 0
        overlap = np.empty(where.size, dtype=np.uint8)
        for lo in range(0, where.size, self.batch):  # the buffers hold a batch
            hi = lo + self.batch
            self.lanes(a[lo:hi], b[lo:hi], overlap[lo:hi])
        self.out[where] = overlap


def overlap(a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` for each (row, layer) of two route arrays of one shape with distinct ids per route.

    Routes that fit a machine word use the SWAR kernels (``_OverlapScan``), others the general
    one; cache-sized chunks, spans of chunks in parallel threads.
    """
    rows, layers, k = a.shape
    out = np.empty((rows, layers), dtype=np.uint8)
    flat = out.reshape(-1)
    spec = Words.of(a.dtype, k) if a.dtype == b.dtype else None
    step = chunk_rows(layers * k * a.dtype.itemsize)

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

    map_spans(scan, rows, a.nbytes + b.nbytes)
    return out
