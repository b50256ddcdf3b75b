"""Compiled kernels of ``repeated_rows`` (``harness.audit.checks.repeats``): each row's hash, and per
sample the longest segment of rows equal to the rows just before it, over single rows and then over
windows of rows (what low-entropy routing, where single rows repeat, still tells apart).

Compiled by numba on first use and cached on disk, like ``harness.audit.checks.kernels``, whose hash
constants they share.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from harness.audit.checks.kernels import FNV, SEED

HASHED_WORDS = 8
"""Eight-byte words of a row that ``_row_hashes`` reads (spread over the row): wide rows (Qwen3: 48
words) are told apart by a few of their layers, and every repeat found is compared in full after."""


@numba.njit(cache=True, nogil=True)
def _row_hashes(flat, out):  # type: ignore[no-untyped-def]
    """``out[r]``: a 64-bit hash of row r of ``flat [rows, bytes]`` (equal rows, equal hashes): of every
    byte of a narrow row, of ``HASHED_WORDS`` eight-byte words spread over a wide one."""
    rows, width = flat.shape
    words = width // 8
    read = min(words, HASHED_WORDS)
    for r in range(rows):
        h = np.uint64(SEED)
        for k in range(read):
            w = k * words // read
            v = np.uint64(0)
            for b in range(8):
                v |= np.uint64(flat[r, w * 8 + b]) << np.uint64(8 * b)
            h = (h ^ v) * np.uint64(FNV)
            h ^= h >> np.uint64(29)
        if read == words:
            for b in range(words * 8, width):
                h = (h ^ np.uint64(flat[r, b])) * np.uint64(FNV)
        out[r] = h ^ (h >> np.uint64(32))


@numba.njit(cache=True, nogil=True)
def _windows(hashes, captured, lo, hi, width, out, valid):  # type: ignore[no-untyped-def]
    """``out[i]``: a hash of rows ``[i, i + width)`` of i's sample (``valid[i]``: all of them captured
    and inside the sample)."""
    for s in range(lo.size):
        for i in range(lo[s], hi[s]):
            ok = i + width <= hi[s]
            h = np.uint64(SEED)
            if ok:
                for r in range(i, i + width):
                    if not captured[r]:
                        ok = False
                        break
                    h = (h ^ hashes[r]) * np.uint64(FNV)
                    h ^= h >> np.uint64(31)
            out[i] = h
            valid[i] = ok


@numba.njit(cache=True, nogil=True)
def _repeated_runs(keys, valid, lo, hi, width, best_start, best_length, equal_pairs):  # type: ignore[no-untyped-def]
    """Per sample s (positions ``[lo[s], hi[s])``): the longest segment of m ≥ max(2, width) rows equal
    to the m rows just before it (``best_start``: the first row of the earlier copy, local;
    ``best_length``: m, 0 when none), and ``equal_pairs``: pairs of its valid positions with equal keys.

    ``keys[i]`` identifies the ``width`` rows from i (a row's hash for width 1, a window's for more).
    One pass per sample with an open-addressing table (key → last position, count): position i's
    nearest earlier equal key is at distance d_i; a run of positions with the same d = m at least
    ``m − width + 1`` long is a repeated segment. A segment that repeats a row inside itself breaks
    the runs of single rows (low-entropy routing), not those of windows of rows."""
    longest = 0
    for s in range(lo.size):
        longest = max(longest, hi[s] - lo[s])
    size = 2
    while size < 2 * longest:
        size *= 2
    mask = size - 1
    table = np.zeros(size, np.uint64)
    last = np.full(size, -1, np.int64)
    count = np.zeros(size, np.int64)
    used = np.empty(max(longest, 1), np.int64)
    least = max(2, width)
    for s in range(lo.size):
        n_used = 0
        run_d = 0
        run_start = 0
        run_len = 0
        best_m = 0
        best_a = -1
        pairs = 0
        for i in range(lo[s], hi[s]):
            d = 0
            if valid[i]:
                x = keys[i]
                slot = np.int64(x & np.uint64(mask))
                while last[slot] >= 0 and table[slot] != x:
                    slot = (slot + 1) & mask
                if last[slot] >= 0:
                    d = i - last[slot]
                    pairs += count[slot]
                    count[slot] += 1
                else:
                    table[slot] = x
                    count[slot] = 1
                    used[n_used] = slot
                    n_used += 1
                last[slot] = i
            if d > 0 and d == run_d:
                run_len += 1
            else:
                run_d = d
                run_start = i
                run_len = 1 if d > 0 else 0
            if run_d >= least and run_len >= run_d - width + 1 and run_d > best_m:
                best_m = run_d
                best_a = run_start - run_d - lo[s]
        for u in range(n_used):
            last[used[u]] = -1
        best_start[s] = best_a
        best_length[s] = best_m
        equal_pairs[s] = pairs


WINDOW = 8
"""Rows per window of ``repeated_runs``' second pass (what low-entropy routing, where single rows
repeat, still tells apart)."""


def repeated_runs(
    routes: npt.NDArray[np.integer[Any]],
    captured: npt.NDArray[np.bool_],
    lo: npt.NDArray[np.int64],
    hi: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(start, length, equal_pairs)`` per sample of rows ``[lo, hi)`` of ``routes [rows, layers, top_k]``
    (``_repeated_runs`` over single rows, then over windows of ``WINDOW`` rows; the longer segment
    wins; a segment's rows are then compared byte for byte, every layer, by the caller).
    ``equal_pairs``: of single rows (of their hashes: a wide row is hashed from some of its bytes, so
    this may count a pair that differs elsewhere, which only makes ``repeated_rows`` quieter)."""
    n = lo.size
    start, length, pairs = np.full(n, -1, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    rows = routes.shape[0]
    if n and rows:
        lo, hi = lo.astype(np.int64), hi.astype(np.int64)
        flat = np.ascontiguousarray(routes).reshape(rows, -1).view(np.uint8)
        hashes = np.empty(rows, np.uint64)
        _row_hashes(flat, hashes)
        _repeated_runs(hashes, captured, lo, hi, 1, start, length, pairs)
        # Windows only where single rows repeat (low-entropy routing); elsewhere rows already tell.
        repeating = (pairs > 0) & (hi - lo >= 2 * WINDOW)
        if repeating.any():
            hi = np.where(repeating, hi, lo)
            windows, valid = np.empty(rows, np.uint64), np.empty(rows, dtype=bool)
            _windows(hashes, captured, lo, hi, WINDOW, windows, valid)
            wide_start, wide_length, ignored = (
                np.full(n, -1, np.int64),
                np.zeros(n, np.int64),
                np.zeros(n, np.int64),
            )
            _repeated_runs(windows, valid, lo, hi, WINDOW, wide_start, wide_length, ignored)
            longer = wide_length > length
            start[longer], length[longer] = wide_start[longer], wide_length[longer]
    return start, length, pairs
