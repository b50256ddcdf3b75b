"""Chunked, threaded kernels over route arrays ``[rows, layers, top_k]``.

A trace of 256 × 4096 positions × 48 layers × top-8 is 400 MB, and validating or comparing it
must run near memory speed. The kernels walk cache-sized chunks of rows, so that each vector
operation's operands and temporaries stay in the core's L2 cache; large arrays are split into one
contiguous span of chunks per CPU, each scanned by its own thread (numpy releases the GIL inside
every vector operation, so the spans run in parallel).

Routes that fit a machine word (``top_k · itemsize`` of 2, 4 or 8 bytes, e.g. top-8 of uint8)
are compared by the compiled kernels of ``swar``. The others are compared here without
transposing or sorting anything: a chunk's ids are laid out flat, route after route, tagged with
their route's parity in a bit no id uses, and compared with the flat ids shifted by
``1 .. top_k − 1`` places (``_RepeatScan``, ``_SetScan.sets``): each shift is one contiguous
vector operation that compares one pair of every route, and ids of neighbouring routes never
compare equal.

``agreement`` reduces an overlap array to the counts ``AgreementCounts`` holds, in one compiled
pass over the array (numpy needed four: a comparison, two axis reductions and a widening sum,
which together took longer than the overlap itself).

These functions assume what their callers check: arrays of three dimensions, unsigned or signed
integers, and (for the overlap) distinct ids in every route. Errors are the callers' to word.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import numba
import numpy as np
import numpy.typing as npt

from harness.cpus import available_cpus
from harness.trace import swar

CHUNK_BYTES = 1 << 19
"""Bytes of routes per chunk: numpy's per-call cost stays small, the temporaries stay in cache.

Measured on the benchmark's routes (one thread, CPU time): 64 KiB chunks take 1.4–1.9× the time
of 512 KiB ones, 1 MiB chunks 1.0–1.4×."""

PARALLEL_MIN_BYTES = 1 << 23
"""Arrays smaller than this are processed on the calling thread only."""

_T = TypeVar("_T")


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk so that a chunk of routes holds about ``CHUNK_BYTES`` bytes."""
    return max(1, CHUNK_BYTES // max(1, row_bytes))


_thread_limit: int | None = None


@contextmanager
def thread_limit(threads: int) -> Iterator[None]:
    """Inside the block, the kernels run on at most ``threads`` threads.

    For ``rrh bench trace --threads 1``: a per-core figure, which another process on the machine
    slows no more than the numpy copy it is measured against (a threaded kernel loses a share of
    the core that process takes; a single-threaded copy does not).
    """
    global _thread_limit
    before, _thread_limit = _thread_limit, threads
    try:
        yield
    finally:
        _thread_limit = before


def map_spans(fn: Callable[[int, int], _T], length: int, nbytes: int) -> list[_T]:
    """``fn(lo, hi)`` over contiguous spans covering ``[0, length)``, in order.

    One span per CPU (at most ``thread_limit``'s), each in its own thread, when the work is at
    least ``PARALLEL_MIN_BYTES``; otherwise one span on the calling thread (threads would cost
    more than they save).
    """
    spans = min(available_cpus(), _thread_limit or available_cpus()) if nbytes >= PARALLEL_MIN_BYTES else 1
    bounds = [length * i // spans for i in range(spans + 1)]
    pairs = [(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]
    if len(pairs) <= 1:
        return [fn(lo, hi) for lo, hi in pairs]
    with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
        return list(pool.map(lambda span: fn(*span), pairs))


# --- validation ---------------------------------------------------------------------------------


def in_range(chunk: npt.NDArray[np.integer[Any]], num_experts: int) -> bool:
    """All ids of ``chunk`` lie in ``[0, num_experts)``; compared in the chunk's own dtype."""
    if chunk.size == 0:
        return True
    return bool(chunk.max() < num_experts) and (chunk.dtype.kind == "u" or bool(chunk.min() >= 0))


def repeated_pairs(chunk: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.bool_]:
    """For a chunk ``[rows, layers, k]``: which (row, layer) routes repeat an id.

    Locates the bad routes of a chunk that failed the scan (so it runs once, on an error): the
    chunk is transposed to ``[k, rows·layers]`` and each of the k·(k−1)/2 pairwise comparisons is
    one contiguous vector operation.
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


def parity_tags(bound: int, k: int, size: int) -> npt.NDArray[np.unsignedinteger[Any]]:
    """``size`` tags, ``k`` per route: 0 on even routes, the top bit on odd ones.

    In the narrowest unsigned dtype whose top bit no id in ``[0, bound)`` sets, so that a tagged
    id is the id and its route's parity at once.
    """
    lane = next(
        np.dtype(d) for d in (np.uint8, np.uint16, np.uint32) if bound <= 1 << (8 * np.dtype(d).itemsize - 1)
    )
    parity = np.array([0, 1 << (8 * lane.itemsize - 1)], dtype=lane)
    return np.tile(np.repeat(parity, k), size // (2 * k) + 1)[:size]


class _RepeatScan:
    """Whether a chunk of routes repeats an id in a route: ``k − 1`` comparisons of shifted bytes.

    The chunk's ids are laid out flat, route after route, and each id is tagged with its route's
    parity in a top bit no id uses (``parity_tags``). Comparing the flat array with itself
    shifted by ``s = 1 .. k − 1`` compares every pair of ids of a route once; a pair that
    straddles two neighbouring routes carries two different tags and never compares equal. Each
    shift is one contiguous comparison and a byte reduction, whatever ``k`` and the dtype are,
    with no transpose.
    """

    def __init__(self, k: int, num_experts: int, size: int) -> None:
        self.k = k
        self.tags = parity_tags(num_experts, k, size)
        self.tagged = np.empty(size, dtype=self.tags.dtype)
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


def _repeat_check(
    dtype: np.dtype[Any], k: int, num_experts: int, routes: int
) -> Callable[[npt.NDArray[np.integer[Any]]], bool]:
    """Whether a chunk of at most ``routes`` routes repeats an id: compiled on words when a route fits one."""
    if swar.word_dtype(k, dtype) is None:
        return _RepeatScan(k, num_experts, routes * k).repeats
    scratch = np.empty(routes, dtype=np.uint8)
    return lambda chunk: swar.repeats(chunk, scratch)


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
        repeats = _repeat_check(routes.dtype, k, num_experts, step * moe.size) if check_repeats else None
        for r0 in range(lo, hi, step):
            chunk = routes[r0 : min(r0 + step, hi)]
            if not in_range(chunk, num_experts):
                return r0
            if repeats is not None and repeats(chunk if every_slot else chunk[:, moe]):
                return r0
        return None

    found = [r0 for r0 in map_spans(scan, rows, routes.nbytes) if r0 is not None]
    return found[0] if found else None


# --- set overlap ----------------------------------------------------------------------------------


class _SetScan:
    """``|A ∩ B|`` per route for routes that fit no machine word (``swar`` takes the others)."""

    def __init__(self, k: int, bound: int, batch: int) -> None:
        self.k = k
        self.tags = parity_tags(bound, k, batch * k)
        self.tagged = (np.empty_like(self.tags), np.empty_like(self.tags))
        self.found, self.equal = np.empty(batch * k, dtype=bool), np.empty(batch * k, dtype=bool)
        self.count = np.dtype(f"u{k}") if k in (1, 2, 4, 8) else None

    def sets(self, a: npt.NDArray[Any], b: npt.NDArray[Any], out: npt.NDArray[np.uint8]) -> None:
        """``out = |A ∩ B|`` per route of ``a, b [routes, k]``, whose routes hold distinct ids.

        Both are laid out flat and tagged with the route's parity, as in ``_RepeatScan``; id
        ``a[x]`` is compared with ``b[x + s]`` for ``s = −(k − 1) .. k − 1``, which covers every
        pair of a route once (pairs across routes differ in their tags). As a route of b holds
        distinct ids, each id of a is found at most once, so ``|A ∩ B|`` is the number of ids of
        a found: a popcount of one 0/1 byte per id.
        """
        n, k = a.size, self.k
        ta, tb = (t[:n] for t in self.tagged)
        np.bitwise_or(a.reshape(-1), self.tags[:n], out=ta, casting="unsafe")
        np.bitwise_or(b.reshape(-1), self.tags[:n], out=tb, casting="unsafe")
        found = self.found[:n]
        np.equal(ta, tb, out=found)
        for s in range(1, k):
            equal = self.equal[: n - s]
            np.equal(ta[:-s], tb[s:], out=equal)
            np.bitwise_or(found[:-s], equal, out=found[:-s])
            np.equal(ta[s:], tb[:-s], out=equal)
            np.bitwise_or(found[s:], equal, out=found[s:])
        if self.count is not None:
            np.bitwise_count(found.view(self.count), out=out)
        else:
            np.add.reduce(found.reshape(-1, k), axis=1, dtype=np.uint8, out=out)


def overlap(
    a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]], bound: int
) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` for each (row, layer) of two route arrays of one shape, ids distinct in a route.

    ``bound``: every id of both lies in ``[0, bound)``. Routes that fit a machine word go to the
    compiled ``swar.overlap``, one span of rows per thread; the others through ``_SetScan`` on
    cache-sized chunks.
    """
    rows, layers, k = a.shape
    out = np.empty((rows, layers), dtype=np.uint8)
    fits_word = a.dtype == b.dtype and swar.word_dtype(k, a.dtype) is not None
    step = chunk_rows(layers * k * max(a.dtype.itemsize, b.dtype.itemsize))

    def scan(lo: int, hi: int) -> None:
        if fits_word:
            swar.overlap(a[lo:hi], b[lo:hi], out[lo:hi])
            return
        sets = _SetScan(k, bound, step * layers)
        for r0 in range(lo, hi, step):
            r1 = min(r0 + step, hi)
            a_chunk = np.ascontiguousarray(a[r0:r1]).reshape(-1, k)
            b_chunk = np.ascontiguousarray(b[r0:r1]).reshape(-1, k)
            sets.sets(a_chunk, b_chunk, out[r0:r1].reshape(-1))

    map_spans(scan, rows, a.nbytes + b.nbytes)
    return out


# --- agreement counts -----------------------------------------------------------------------------


@numba.njit(nogil=True, cache=True)
def _count_rows(overlap, top_k, differs):  # type: ignore[no-untyped-def]
    """Add to ``differs[l]`` the rows of ``overlap [rows, layers]`` whose layer l is below ``top_k``.

    Returns (rows below ``top_k`` in some layer, the sum of ``overlap``).
    """
    tokens = 0
    total = 0
    for r in range(overlap.shape[0]):
        row_differs = 0
        row_sum = 0
        for layer in range(overlap.shape[1]):
            value = overlap[r, layer]
            below = 1 if value < top_k else 0
            differs[layer] += below
            row_differs |= below
            row_sum += value
        tokens += row_differs
        total += row_sum
    return tokens, total


def agreement(overlap: npt.NDArray[np.uint8], top_k: int) -> tuple[npt.NDArray[np.int64], int, int]:
    """Counts of an overlap array ``[rows, layers]`` (``|A ∩ B|`` per cell) in one compiled pass.

    Returns (rows whose layer l is below ``top_k``, for each l; rows below ``top_k`` in some
    layer; the sum of every cell), spans of rows in parallel threads.
    """
    rows, layers = overlap.shape
    source = np.ascontiguousarray(overlap)

    def scan(lo: int, hi: int) -> tuple[npt.NDArray[np.int64], int, int]:
        differs = np.zeros(layers, dtype=np.int64)
        tokens, total = _count_rows(source[lo:hi], top_k, differs)
        return differs, int(tokens), int(total)

    parts = map_spans(scan, rows, source.nbytes)
    differs = np.zeros(layers, dtype=np.int64)
    for part, _, _ in parts:
        differs += part
    return differs, sum(p[1] for p in parts), sum(p[2] for p in parts)
