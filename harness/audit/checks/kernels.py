"""Compiled kernels of the audit that ``harness.trace`` does not already have.

Each walks its input once, with no temporary the size of the input (numpy would build one index
array per id or one boolean array per comparison), and releases the GIL. They are compiled by
numba on first use and cached on disk, like ``harness.trace.swar``.

- ``load_and_digests``: over the engine's routes of a whole batch, the per (step, MoE layer,
  expert) counts of the captured rows' ids and the digest of each prompt row;
- ``agreement``: from ``|A ∩ B|`` per (row, MoE layer), the per-step counts of
  ``harness.trace.AgreementCounts``, whether each row differs in some layer, and each sample's
  differing cells;
- ``expert_load``, ``row_digests``: the two halves of ``load_and_digests`` on their own.

The kernels of ``repeated_rows`` (row hashes and repeated segments) are in
``harness.audit.checks.repeat_kernels``, those of the run-wide detectors in
``harness.audit.checks.shared_kernels``.

A row digest is one 64-bit value of the *sets* of ids of a row's MoE layers (any id order within
a route gives the same digest), so rows of two samples can be compared across files and
processes by exchanging eight bytes per row.
"""

from __future__ import annotations

import itertools
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

SEED = 0x9E3779B97F4A7C15
"""The seed of every hash and digest of the audit (the same in every process and run)."""
FNV = 0x100000001B3
"""The 64-bit FNV prime the hashes multiply by."""


@numba.njit(cache=True, nogil=True)
def _expert_counts(flat, base, captured, row_group, load, stride, bins):  # type: ignore[no-untyped-def]
    """Counts of the captured rows' ids into ``load`` (see ``load_and_digests``).

    ``flat [rows, layers · k]``: each row's ids, layer after layer; ``base[p]``: where the counts
    of the id at position p of a row start within a group's ``stride`` counters (its MoE layer's
    ``bins`` counters, or a last block, dropped, for the other layers). Ids at or past ``bins``
    are not counted.
    """
    rows, width = flat.shape
    for r in range(rows):
        if captured[r]:
            g = row_group[r] * stride
            for p in range(width):
                e = flat[r, p]
                if e < bins:
                    load[g + base[p] + e] += 1


@numba.njit(cache=True, nogil=True)
def _count_rows_u8(flat, layers, k, load):  # type: ignore[no-untyped-def]
    """``load[j · 256 + id] += 1`` for every id of ``flat`` (whole rows of ``layers · k`` uint8 ids)."""
    n = flat.size
    i = 0
    while i < n:
        for j in range(layers):
            base = j * 256
            for _ in range(k):
                load[base + flat[i]] += 1
                i += 1


@numba.njit(cache=True, nogil=True)
def _count_rows_u8_top8(flat, layers, load):  # type: ignore[no-untyped-def]
    """``_count_rows_u8`` for top-8 routes: the lanes of a route unrolled (twice as fast as any k)."""
    n = flat.size
    i = 0
    while i < n:
        for j in range(layers):
            base = j * 256
            for _ in range(8):
                load[base + flat[i]] += 1
                i += 1


@numba.njit(cache=True, nogil=True)
def _digests(flat, k, slots, lo_rows, hi_rows, table, out):  # type: ignore[no-untyped-def]
    """``out[r]`` for each row r of the runs ``[lo_rows[i], hi_rows[i])``: the digest of the id sets of
    layers ``slots``. ``table`` has an entry for every id the dtype can hold, so ids index it directly.
    """
    for i in range(lo_rows.size):
        for r in range(lo_rows[i], hi_rows[i]):
            acc = np.uint64(0)
            for j in range(slots.size):
                first = slots[j] * k
                total = np.uint64(0)
                for x in range(k):
                    total += table[flat[r, first + x]]
                acc = acc * np.uint64(FNV) + total
            out[r] = acc


@numba.njit(cache=True, nogil=True)
def _digests_top8(flat, layers, lo_rows, hi_rows, table, out):  # type: ignore[no-untyped-def]
    """``_digests`` of top-8 rows whose every layer is a MoE layer (``flat``: the rows' ids, flat).

    The same digests (sums of 64-bit words wrap, in any order), the lanes' sum as a tree.
    """
    row_bytes = layers * 8
    for i in range(lo_rows.size):
        for r in range(lo_rows[i], hi_rows[i]):
            p = r * row_bytes
            acc = np.uint64(0)
            for _ in range(layers):
                total = (table[flat[p]] + table[flat[p + 1]]) + (table[flat[p + 2]] + table[flat[p + 3]])
                total += (table[flat[p + 4]] + table[flat[p + 5]]) + (table[flat[p + 6]] + table[flat[p + 7]])
                acc = acc * np.uint64(FNV) + total
                p += 8
            out[r] = acc


@numba.njit(cache=True, nogil=True)
def _agreement(  # type: ignore[no-untyped-def]
    overlap, keep, row_group, row_owner, top_k, differs_per_layer, tokens_differ, positions, overlap_sum,
    row_differs, sample_differs, sample_cells,
):  # fmt: skip
    rows, m = overlap.shape
    for r in range(rows):
        count = 0
        total = 0
        for j in range(m):
            v = overlap[r, j]
            total += v
            if v < top_k:
                count += 1
        row_differs[r] = count > 0
        if keep[r]:
            g = row_group[r]
            positions[g] += 1
            overlap_sum[g] += total
            if count:
                tokens_differ[g] += 1
                for j in range(m):
                    if overlap[r, j] < top_k:
                        differs_per_layer[g, j] += 1
            o = row_owner[r]
            sample_differs[o] += count
            sample_cells[o] += 1


def _digest_table(size: int) -> npt.NDArray[np.uint64]:
    """A fixed pseudo-random 64-bit value per id (the same in every process and run)."""
    return np.random.default_rng(SEED).integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(
        2
    ) + np.uint64(1)


_TABLE = _digest_table(65536)
"""One value per id of the widest stored dtype (uint16): every stored id indexes it directly."""


def load_and_digests(
    routes: npt.NDArray[np.integer[Any]],
    slots: npt.NDArray[np.intp],
    captured: npt.NDArray[np.bool_],
    row_group: npt.NDArray[np.int64],
    groups: int,
    num_experts: int,
    prompt: npt.NDArray[np.bool_],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
    """``(load [groups, len(slots), num_experts], digests [rows])`` of routes ``[rows, layers, top_k]``.

    ``load[g, j, e]``: ids ``e`` in layer slot ``slots[j]`` of the captured rows whose
    ``row_group`` is ``g`` (ids out of range are not counted); ``digests[r]``: the digest of row r
    where ``prompt[r]`` (``row_digests``), 0 elsewhere.
    """
    counts = Counts(routes, slots, captured, row_group, groups, num_experts, prompt)
    return counts.load(), counts.digests


class Counts:
    """The id counts and prompt-row digests of a batch's routes (``load_and_digests``), kept raw.

    ``raw[g, j, b]``: ids ``b`` of the captured rows of group ``g`` in the j-th layer of ``slots``,
    ``j = len(slots)`` counting every other layer; ``bins`` counters each: 256 for uint8 ids (every
    id a byte can hold, so ``out_of_range`` is exact), ``num_experts`` for uint16 ids (ids past it
    are not counted).
    """

    def __init__(
        self,
        routes: npt.NDArray[np.integer[Any]],
        slots: npt.NDArray[np.intp],
        captured: npt.NDArray[np.bool_],
        row_group: npt.NDArray[np.int64],
        groups: int,
        num_experts: int,
        prompt: npt.NDArray[np.bool_],
    ) -> None:
        if routes.dtype.kind != "u" or routes.dtype.itemsize > 2:
            raise ValueError(f"routes: expected uint8 or uint16 ids, got {routes.dtype}")
        rows, layers, k = routes.shape
        m = slots.size
        self.num_experts = num_experts
        self.bins = bins = 256 if routes.dtype.itemsize == 1 else num_experts
        # Where each position of a row counts: its MoE layer's block, or the last block (other layers).
        block = np.full(layers, m, dtype=np.int64)
        block[slots] = np.arange(m)
        base = np.repeat(block * bins, k)
        # Counts of one batch fit 32 bits unless it holds 2**31 ids; narrower counters stay in cache.
        wide = rows * max(1, k) >= 2**31
        load = np.zeros(groups * (m + 1) * bins, dtype=np.int64 if wide else np.int32)
        self.digests = np.zeros(rows, dtype=np.uint64)
        if rows and layers and k:
            flat = np.ascontiguousarray(routes).reshape(rows, layers * k)
            runs = _runs(captured, row_group) if bins == 256 and m == layers else None
            if runs is not None:  # every layer a MoE layer, uint8 ids: whole rows counted run by run
                per_group = (m + 1) * bins
                for lo, hi, g in runs:
                    part, counts = flat[lo:hi].reshape(-1), load[g * per_group : g * per_group + m * bins]
                    if k == 8:
                        _count_rows_u8_top8(part, layers, counts)
                    else:
                        _count_rows_u8(part, layers, k, counts)
            else:
                _expert_counts(flat, base, captured, row_group.astype(np.int64), load, (m + 1) * bins, bins)
            edges = np.flatnonzero(np.diff(prompt.view(np.int8), prepend=0, append=0))
            lo_rows, hi_rows = edges[0::2].astype(np.int64), edges[1::2].astype(np.int64)
            if lo_rows.size and k == 8 and m == layers:
                _digests_top8(flat.reshape(-1), layers, lo_rows, hi_rows, _TABLE, self.digests)
            elif lo_rows.size:
                _digests(flat, k, slots.astype(np.int64), lo_rows, hi_rows, _TABLE, self.digests)
        self.raw = load.reshape(groups, m + 1, bins)

    def load(self) -> npt.NDArray[np.int64]:
        """``[groups, len(slots), num_experts]`` counts (ids out of range not counted)."""
        groups, m = self.raw.shape[0], self.raw.shape[1] - 1
        out = np.zeros((groups, m, self.num_experts), dtype=np.int64)
        common = min(self.num_experts, self.bins)
        out[:, :, :common] = self.raw[:, :m, :common]
        return out

    def out_of_range(self) -> bool | None:
        """Whether a captured row holds an id at or past ``num_experts`` in any layer (``None``: not
        known from the counts, which hold no id past ``num_experts`` for uint16 ids)."""
        if self.bins != 256:
            return None
        return bool(self.raw[:, :, self.num_experts :].any())


_MAX_RUNS = 64
"""More runs of captured rows of one step than this in a batch: the per-row kernel instead."""


def _runs(
    captured: npt.NDArray[np.bool_], row_group: npt.NDArray[np.int64]
) -> list[tuple[int, int, int]] | None:
    """``(first row, end, group)`` of each run of captured rows of one group; ``None`` past ``_MAX_RUNS``."""
    rows = captured.size
    if captured.all():
        if rows == 0 or (row_group[0] == row_group[-1] and not np.any(np.diff(row_group))):
            return [(0, rows, int(row_group[0]))] if rows else []
        edges = np.flatnonzero(np.diff(row_group)) + 1
    else:
        change = np.diff(row_group) != 0
        change |= np.diff(captured.view(np.int8)) != 0
        edges = np.flatnonzero(change) + 1
    if edges.size >= _MAX_RUNS:
        return None
    bounds = [0, *edges.tolist(), rows]
    return [(lo, hi, int(row_group[lo])) for lo, hi in itertools.pairwise(bounds) if captured[lo]]


def expert_load(
    routes: npt.NDArray[np.integer[Any]],
    slots: npt.NDArray[np.intp],
    captured: npt.NDArray[np.bool_],
    num_experts: int,
) -> npt.NDArray[np.int64]:
    """``[len(slots), num_experts]`` counts of the ids of captured rows (ids out of range are skipped)."""
    rows = routes.shape[0]
    load, _ = load_and_digests(
        routes, slots, captured, np.zeros(rows, np.int64), 1, num_experts, np.zeros(rows, dtype=bool)
    )
    return load[0]


def row_digests(routes: npt.NDArray[np.integer[Any]], slots: npt.NDArray[np.intp]) -> npt.NDArray[np.uint64]:
    """One digest per row of the id sets of layers ``slots``: equal rows (as sets) give equal digests."""
    rows = routes.shape[0]
    _, digests = load_and_digests(
        routes, slots, np.zeros(rows, dtype=bool), np.zeros(rows, np.int64), 1, 1, np.ones(rows, dtype=bool)
    )
    return digests


def agreement(
    overlap: npt.NDArray[np.uint8],
    keep: npt.NDArray[np.bool_],
    row_group: npt.NDArray[np.int64],
    groups: int,
    row_owner: npt.NDArray[np.int64],
    samples: int,
    top_k: int,
) -> dict[str, npt.NDArray[Any]]:
    """The agreement figures of ``overlap [rows, moe layers]`` (``|A ∩ B|`` per cell) in one pass.

    Over the rows where ``keep``, per group ``g`` of ``row_group``: ``positions``,
    ``differs_per_layer`` (cells with ``|A ∩ B| < top_k``), ``tokens_differ`` (rows with such a
    cell), ``overlap_sum``; per sample of ``row_owner``: ``sample_differs`` (cells) and
    ``sample_rows``. Over every row: ``row_differs``.
    """
    rows, m = overlap.shape
    out = {
        "positions": np.zeros(groups, np.int64),
        "differs_per_layer": np.zeros((groups, m), np.int64),
        "tokens_differ": np.zeros(groups, np.int64),
        "overlap_sum": np.zeros(groups, np.int64),
        "row_differs": np.zeros(rows, dtype=bool),
        "sample_differs": np.zeros(samples, np.int64),
        "sample_rows": np.zeros(samples, np.int64),
    }
    if rows:
        _agreement(
            np.ascontiguousarray(overlap), keep, row_group.astype(np.int64), row_owner.astype(np.int64),
            top_k, out["differs_per_layer"], out["tokens_differ"], out["positions"], out["overlap_sum"],
            out["row_differs"], out["sample_differs"], out["sample_rows"],
        )  # fmt: skip
    return out


# --- harness.trace's kernels, on the calling thread ---------------------------------------------
# ``harness.trace.kernels`` splits an array of ``PARALLEL_MIN_BYTES`` or more across threads. An
# audit's parallelism is its processes (a pool, Ray): each runs its kernels on its own thread, so
# the spans given to the trace kernels stay under that size.


def _row_spans(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    from harness.trace.kernels import PARALLEL_MIN_BYTES

    step = max(1, (PARALLEL_MIN_BYTES - 1) // max(1, row_bytes))
    return [(lo, min(lo + step, rows)) for lo in range(0, rows, step)]


def ids_invalid(
    routes: npt.NDArray[np.integer[Any]], num_experts: int, moe_mask: npt.NDArray[np.bool_]
) -> bool:
    """Whether a route holds an id out of ``[0, num_experts)`` or repeats an id in a MoE slot.

    ``harness.trace.kernels.first_invalid_chunk`` over spans of rows, on the calling thread.
    """
    from harness.trace import kernels as trace_kernels

    rows, layers, k = routes.shape
    row_bytes = layers * k * routes.dtype.itemsize
    step = trace_kernels.chunk_rows(row_bytes)
    return any(
        trace_kernels.first_invalid_chunk(routes[lo:hi], num_experts, moe_mask, step) is not None
        for lo, hi in _row_spans(rows, row_bytes)
    )


def repeats(routes: npt.NDArray[np.integer[Any]], slots: npt.NDArray[np.intp]) -> bool | None:
    """Whether a route of layers ``slots`` repeats an id, in one compiled pass (``harness.trace.swar``),
    for routes that fit a machine word; ``None`` for the others."""
    from harness.trace import swar

    rows, layers, k = routes.shape
    if swar.word_dtype(k, routes.dtype) is None:
        return None
    if not rows or not slots.size:
        return False
    chosen = routes if slots.size == layers else np.ascontiguousarray(routes[:, slots])
    return swar.repeats(chosen, np.empty(chosen.shape[0] * chosen.shape[1], dtype=np.uint8))


def overlap(
    a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]], bound: int
) -> npt.NDArray[np.uint8]:
    """``harness.trace.kernels.overlap`` (``|A ∩ B|`` per row and layer), on the calling thread."""
    from harness.trace import kernels as trace_kernels

    rows, layers, k = a.shape
    out = np.empty((rows, layers), dtype=np.uint8)
    row_bytes = 2 * layers * k * max(a.dtype.itemsize, b.dtype.itemsize)
    for lo, hi in _row_spans(rows, row_bytes):
        out[lo:hi] = trace_kernels.overlap(a[lo:hi], b[lo:hi], bound)
    return out
