"""Compiled kernels of the audit that ``harness.trace`` does not already have.

Both walk routes ``[rows, layers, top_k]`` once, with no temporary the size of the input (numpy
would build one index array per id), and release the GIL. They are compiled by numba on first
use and cached on disk, like ``harness.trace.swar``.

- ``expert_load``: per (MoE layer, expert) counts of the captured rows' ids;
- ``row_digests``: one 64-bit digest per row of the *sets* of ids of its MoE layers (any id
  order within a route gives the same digest), so rows of two samples can be compared across
  files and processes by exchanging eight bytes per row.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

_SEED = 0x9E3779B97F4A7C15


@numba.njit(cache=True, nogil=True)
def _expert_load(routes, slots, captured, out):  # type: ignore[no-untyped-def]
    rows, k = routes.shape[0], routes.shape[2]
    experts = out.shape[1]
    for r in range(rows):
        if not captured[r]:
            continue
        for j in range(slots.size):
            for x in range(k):
                e = routes[r, slots[j], x]
                if e < experts:
                    out[j, e] += 1


@numba.njit(cache=True, nogil=True)
def _row_digests(routes, slots, table, out):  # type: ignore[no-untyped-def]
    rows, k = routes.shape[0], routes.shape[2]
    size = table.size
    for r in range(rows):
        acc = np.uint64(0)
        for j in range(slots.size):
            s = np.uint64(0)
            for x in range(k):
                s += table[routes[r, slots[j], x] % size]
            acc = acc * np.uint64(0x100000001B3) + s
        out[r] = acc


def expert_load(
    routes: npt.NDArray[np.integer[Any]],
    slots: npt.NDArray[np.intp],
    captured: npt.NDArray[np.bool_],
    num_experts: int,
) -> npt.NDArray[np.int64]:
    """``[len(slots), num_experts]`` counts of the ids of captured rows (ids out of range are skipped)."""
    out = np.zeros((slots.size, num_experts), dtype=np.int64)
    if routes.shape[0]:
        _expert_load(routes, slots.astype(np.int64), captured, out)
    return out


def _digest_table(size: int) -> npt.NDArray[np.uint64]:
    """A fixed pseudo-random 64-bit value per id (the same in every process and run)."""
    return np.random.default_rng(_SEED).integers(0, 2**63, size=size, dtype=np.uint64) * np.uint64(
        2
    ) + np.uint64(1)


_TABLE = _digest_table(65536)


def row_digests(routes: npt.NDArray[np.integer[Any]], slots: npt.NDArray[np.intp]) -> npt.NDArray[np.uint64]:
    """One digest per row of the id sets of layers ``slots``: equal rows (as sets) give equal digests."""
    out = np.zeros(routes.shape[0], dtype=np.uint64)
    if routes.shape[0]:
        _row_digests(routes, slots.astype(np.int64), _TABLE, out)
    return out
