"""Compiled kernels for routes that fit a machine word: every id of a route compared at once.

A route of ``k`` ids of ``b`` bits each fits a word of ``k·b`` ∈ {16, 32, 64} bits for the common
shapes (top-8 of uint8 — 128 or 256 experts —, top-4 or top-2 of uint8 or uint16): one route is
one integer whose ``k`` lanes are its ids. Rotating a route's word by ``s`` lanes and comparing it
lane by lane with another word compares id ``i`` of one with id ``i + s (mod k)`` of the other, for
every ``i`` at once ("SIMD within a register"), so:

- ``|A ∩ B|`` is the number of lanes of ``A`` equal to some lane of ``B`` rotated by
  ``s = 0 .. k − 1`` (ids are distinct within a route, so each id of A is found at most once);
- a route repeats an id exactly when some lane equals a lane of the same word rotated by
  ``s = 1 .. k/2`` (rotations by ``s`` and ``k − s`` compare the same pairs).

A lane ``v`` is nonzero exactly when ``((v & low) + low) | v`` has its top bit set, where ``low``
sets every lane's bits but the top one: the sum never carries across lanes, so the test is exact
(no false hits from neighbouring lanes), and AND-ing it over the rotations leaves a lane's top bit
clear exactly when some rotation matched it. Numba compiles the kernels (cached on disk after
the first call) and LLVM vectorises the loop over routes; they release the GIL, so spans of a
large array run in parallel threads. The numpy kernels in ``kernels`` stay for routes that fit
no word (top-3, top-8 of uint16, …). Measured on ``rrh bench trace``'s top-8 uint8 routes, two
threads: the overlap runs at 0.4–0.7× a numpy copy of the routes, against 0.13× for the numpy
kernel on permuted routes.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba import uint64

WORD_BITS = (16, 32, 64)
"""Word widths a route may fill: the unsigned integer dtypes of 2, 4 and 8 bytes."""


def word_dtype(top_k: int, dtype: np.dtype[Any]) -> np.dtype[Any] | None:
    """The unsigned dtype one route of ``top_k`` ids of ``dtype`` fills exactly, or None."""
    bits = 8 * top_k * dtype.itemsize
    return np.dtype(f"u{bits // 8}") if top_k > 1 and bits in WORD_BITS else None


@numba.njit(nogil=True, inline="always")
def _lane_matches(words_a, words_b, out, k, lane_bits, first, last):  # type: ignore[no-untyped-def]
    """``out[r]`` = lanes of ``a[r]`` equal to a lane of ``b[r]`` rotated by ``first .. last − 1``.

    Returns whether any lane matched. Inlined into a wrapper per ``(k, lane_bits, first, last)``,
    so LLVM sees constants: the loop over rotations unrolls and the loop over routes vectorises.
    """
    width = k * lane_bits
    one = uint64(0)
    for i in range(k):
        one |= uint64(1) << uint64(i * lane_bits)
    low = one * ((uint64(1) << uint64(lane_bits - 1)) - uint64(1))
    high = one << uint64(lane_bits - 1)
    full = low | high
    seen = uint64(0)
    for r in range(words_a.size):
        x = uint64(words_a[r])
        y = uint64(words_b[r])
        nonzero = full  # a lane's top bit stays set while every compared lane differed
        for s in range(first, last):
            rotated = ((y >> uint64(s * lane_bits)) | (y << uint64((width - s * lane_bits) % width))) & full
            v = x ^ rotated
            nonzero &= ((v & low) + low) | v
        found = ~nonzero & high
        count = found >> uint64(lane_bits - 1)  # one bit per matched lane, at the lane's bottom
        half = width // 2
        while half >= lane_bits:  # the lanes' sum collects in the bottom lane
            count += count >> uint64(half)
            half //= 2
        out[r] = count & uint64((1 << lane_bits) - 1)
        seen |= found
    return seen != 0


# One compiled wrapper per route shape (numba caches module-level functions only, not closures).
# Overlap: rotations 0 .. k−1. Repeats: rotations 1 .. k/2, of a word against itself.
@numba.njit(nogil=True, cache=True)
def _overlap_2x8(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 2, 8, 0, 2)


@numba.njit(nogil=True, cache=True)
def _overlap_4x8(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 4, 8, 0, 4)


@numba.njit(nogil=True, cache=True)
def _overlap_8x8(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 8, 8, 0, 8)


@numba.njit(nogil=True, cache=True)
def _overlap_2x16(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 2, 16, 0, 2)


@numba.njit(nogil=True, cache=True)
def _overlap_4x16(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 4, 16, 0, 4)


@numba.njit(nogil=True, cache=True)
def _overlap_2x32(a, b, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, b, out, 2, 32, 0, 2)


@numba.njit(nogil=True, cache=True)
def _repeats_2x8(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 2, 8, 1, 2)


@numba.njit(nogil=True, cache=True)
def _repeats_4x8(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 4, 8, 1, 3)


@numba.njit(nogil=True, cache=True)
def _repeats_8x8(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 8, 8, 1, 5)


@numba.njit(nogil=True, cache=True)
def _repeats_2x16(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 2, 16, 1, 2)


@numba.njit(nogil=True, cache=True)
def _repeats_4x16(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 4, 16, 1, 3)


@numba.njit(nogil=True, cache=True)
def _repeats_2x32(a, out):  # type: ignore[no-untyped-def]
    return _lane_matches(a, a, out, 2, 32, 1, 2)


_OVERLAP = {(2, 8): _overlap_2x8, (4, 8): _overlap_4x8, (8, 8): _overlap_8x8,
            (2, 16): _overlap_2x16, (4, 16): _overlap_4x16, (2, 32): _overlap_2x32}  # fmt: skip
_REPEATS = {(2, 8): _repeats_2x8, (4, 8): _repeats_4x8, (8, 8): _repeats_8x8,
            (2, 16): _repeats_2x16, (4, 16): _repeats_4x16, (2, 32): _repeats_2x32}  # fmt: skip


def _words(routes: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.unsignedinteger[Any]]:
    """The routes ``[..., k]`` (C-contiguous) as one flat word per route."""
    word = word_dtype(routes.shape[-1], routes.dtype)
    assert word is not None  # callers dispatch on word_dtype
    return np.ascontiguousarray(routes).reshape(-1).view(word)


def overlap(
    a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]], out: npt.NDArray[np.uint8]
) -> None:
    """``out = |A ∩ B|`` per route of ``a, b [..., k]`` (one dtype that fits a word, ids distinct)."""
    k, lane_bits = a.shape[-1], 8 * a.dtype.itemsize
    _OVERLAP[k, lane_bits](_words(a), _words(b), out.reshape(-1))


def repeats(routes: npt.NDArray[np.integer[Any]], scratch: npt.NDArray[np.uint8]) -> bool:
    """Whether a route of ``routes [..., k]`` (a dtype that fits a word) repeats an id.

    ``scratch`` holds at least one byte per route (the count of repeating lanes, discarded).
    """
    words = _words(routes)
    k, lane_bits = routes.shape[-1], 8 * routes.dtype.itemsize
    return bool(_REPEATS[k, lane_bits](words, scratch[: words.size]))
