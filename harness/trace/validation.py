"""Validity of routes and of a trace's declared sizes (DESIGN §3.1–3.2), before any trace is built.

``validate_routes`` checks an id array ``[rows, layers, top_k]`` (ids in range, a route's ids distinct,
a skipped capture named as such); the ``check_*`` functions check what a trace declares about itself
(``num_experts``, sizes, MoE layer indices) against their bounds, element by element, without
converting. ``RoutingTrace`` (``harness.trace.routing_trace``) runs them all on construction. Every
rejection raises ``TraceError`` naming the field, the position/layer and the expected value; the
bulk checks run in ``harness.trace.kernels`` at near memory speed.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import TraceError
from harness.trace import kernels

MAX_EXPERTS = 1 << 16
"""The largest ``num_experts`` a trace can store (uint16)."""

MAX_LAYERS = 1 << 16
"""The longest layer axis a trace declares (``num_layers``, MoE layer indices, stored width).

Declared sizes are checked against this bound and against the data before anything is built
from them, so a forged ``num_layers`` in a 400-byte file cannot make the reader allocate."""


def storage_dtype(num_experts: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype that holds every id in ``[0, num_experts)``."""
    check_num_experts(num_experts)
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


def check_num_experts(num_experts: object) -> None:
    """Raise ``TraceError`` unless ``num_experts`` is an integer in ``[1, MAX_EXPERTS]``."""
    if (
        not isinstance(num_experts, (int, np.integer))
        or isinstance(num_experts, bool)
        or not 1 <= num_experts <= MAX_EXPERTS
    ):
        raise TraceError(f"num_experts: expected an integer in [1, {MAX_EXPERTS}], got {num_experts!r}")


def check_size(name: str, value: object, upper: int) -> int:
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


def check_moe_layers(moe_layers: object) -> tuple[int, ...]:
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
    moe = tuple(check_size(f"moe_layers[{n}]", i, MAX_LAYERS - 1) for n, i in enumerate(moe_layers))
    if any(a >= b for a, b in itertools.pairwise(moe)):
        raise TraceError(f"moe_layers: expected distinct increasing decoder indices, got {list(moe)}")
    return moe


def as_integer_array(experts: object) -> npt.NDArray[np.integer[Any]]:
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


def _check_range(routes: npt.NDArray[np.integer[Any]], num_experts: int, start: int) -> None:
    """Every slot holds an id in ``[0, num_experts)``; checked on the input dtype, before any cast."""
    if kernels.in_range(routes, num_experts):
        return
    bad = np.argwhere((routes < 0) | (routes >= num_experts))[0]
    row, layer, slot = (int(i) for i in bad)
    raise TraceError(
        f"experts[{row}, {layer}, {slot}] (position {start + row}, layer {layer}): id "
        f"{int(routes[row, layer, slot])} is outside [0, num_experts={num_experts})"
    )


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
    check_num_experts(num_experts)
    rows, layers, k = routes.shape
    if not 1 <= k <= num_experts:
        raise TraceError(f"top_k: expected a value in [1, num_experts={num_experts}], got {k}")
    moe_mask = np.zeros(layers, dtype=bool)
    if k > 1 and rows:  # only then do the slots matter (and only then are they looked at)
        moe_mask[list(range(layers)) if moe_slots is None else list(moe_slots)] = True
    step = kernels.chunk_rows(layers * k * routes.dtype.itemsize)
    r0 = kernels.first_invalid_chunk(routes, num_experts, moe_mask, step)
    if r0 is None:
        return
    _check_range(routes, num_experts, start)  # an id out of range anywhere comes first
    chunk = routes[r0 : r0 + step]
    row, layer = (int(i) for i in np.argwhere(kernels.repeated_pairs(chunk) & moe_mask)[0])
    route = [int(x) for x in chunk[row, layer]]
    row += r0
    what = "all-zero MoE route (a skipped capture)" if not any(route) else "repeated expert id"
    raise TraceError(
        f"experts[{row}, {layer}] (position {start + row}, layer {layer}): {what} in route "
        f"{route}; expected top_k={k} distinct ids"
    )
