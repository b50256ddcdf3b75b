"""The compiled kernel of the run-wide detectors (``harness.audit.checks.shared``): one pass over a
batch's rows, each route's per MoE layer digest (the ids' words of ``harness.audit.checks.kernels``'s
table summed: any id order gives the same) compared with the row before it and with the previous
kept row of its sample, with no temporary the size of the input. Compiled by numba on first use and
cached on disk, like the audit's other kernels.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from harness.audit.checks.kernels import _TABLE


@numba.njit(cache=True, nogil=True)
def _shared_evidence(flat, k, slots, table, owner, kept, repeats_prior, rows, distinct, unequal, shifted):  # type: ignore[no-untyped-def]
    """One pass over a batch's rows for the run-wide detectors (``shared_evidence``): each row's per
    MoE layer digests (its ids' words summed: any id order gives the same), compared with the row
    before it and, over the ``kept`` rows of each sample, with the kept row before it."""
    layers = slots.size
    cur = np.zeros(layers, dtype=np.uint64)
    raw_prev = np.zeros(layers, dtype=np.uint64)
    kept_prev = np.zeros(layers, dtype=np.uint64)
    last_owner = -1
    for r in range(flat.shape[0]):
        for j in range(layers):
            first = slots[j] * k
            total = np.uint64(0)
            for x in range(k):
                total += table[flat[r, first + x]]
            cur[j] = total
        if r > 0:
            same = True
            for j in range(layers):
                if cur[j] != raw_prev[j]:
                    same = False
                    break
            repeats_prior[r] = same
        if kept[r]:
            s = owner[r]
            if s == last_owner:
                differs = False
                for j in range(layers):
                    if cur[j] != kept_prev[j]:
                        differs = True
                    if j > 0 and cur[j] == kept_prev[j - 1]:
                        shifted[j - 1] += 1
                if differs:
                    distinct[s] += 1
                shifted[layers - 1] += 1  # the pair count, in the last slot
            else:
                distinct[s] += 1
            rows[s] += 1
            for j in range(1, layers):
                if cur[j] != cur[j - 1]:
                    unequal[s, j - 1] += 1
            last_owner = s
            for j in range(layers):
                kept_prev[j] = cur[j]
        for j in range(layers):
            raw_prev[j] = cur[j]


def shared_evidence(
    routes: npt.NDArray[np.integer[Any]],
    slots: npt.NDArray[np.intp],
    owner: npt.NDArray[np.int64],
    kept: npt.NDArray[np.bool_],
    samples: int,
) -> tuple[
    npt.NDArray[np.bool_],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    int,
]:
    """What ``harness.audit.checks.shared`` counts of ``routes [rows, layers, top_k]`` in MoE layers
    ``slots`` (rows of samples ``owner``, sorted by sample; ``kept``: captured rows within coverage),
    routes compared as sets (digests that collide with probability ~2⁻⁶⁴):

    ``(repeats_prior [rows]``: row r equals row r − 1 in every MoE layer; ``rows [samples]``: kept
    rows; ``distinct [samples]``: kept rows that differ from the kept row before them (the first
    counts); ``unequal [samples, layers − 1]``: kept rows where layer j + 1 differs from layer j;
    ``coincide [layers − 1]``: consecutive kept rows of one sample where layer j + 1 of the later
    equals layer j of the earlier; and the count of those consecutive pairs)."""
    rows_n, layers, k = routes.shape
    m = len(slots)
    flat = np.ascontiguousarray(routes).reshape(rows_n, layers * k)
    table = _TABLE[:256].copy() if routes.dtype == np.uint8 else _TABLE  # a byte's ids stay in L1
    repeats_prior = np.zeros(rows_n, dtype=np.bool_)
    rows = np.zeros(samples, dtype=np.int64)
    distinct = np.zeros(samples, dtype=np.int64)
    unequal = np.zeros((samples, max(m - 1, 0)), dtype=np.int64)
    shifted = np.zeros(max(m, 1), dtype=np.int64)
    _shared_evidence(flat, k, np.asarray(slots, dtype=np.int64), table, owner.astype(np.int64),
                     kept, repeats_prior, rows, distinct, unequal, shifted)  # fmt: skip
    return repeats_prior, rows, distinct, unequal, shifted[: m - 1], int(shifted[-1]) if m > 1 else 0
