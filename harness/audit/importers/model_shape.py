"""What the SkyRL and verl dumps do not record, taken from the caller; and their payload rows.

Neither dump holds the model's expert count or which decoder layers are MoE: ``num_experts`` comes
from the caller (``rrh audit --num-experts``, or ``$RRH_NUM_EXPERTS``) and is never inferred from
the ids (an id wrapped into ``[E, 256)`` would raise the bound and hide itself); ``moe_layers``
comes from the caller or is inferred from which layers hold a non-zero id. Both dumps keep a
sample's engine rows in a padded, zero-filled row axis: ``payload_rows`` cuts them out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout import LayoutError
from harness.trace import storage_dtype

NUM_EXPERTS_ENV = "RRH_NUM_EXPERTS"
MOE_LAYERS_ENV = "RRH_MOE_LAYERS"


def num_experts_input(num_experts: int | None, framework: str) -> int:
    """``num_experts`` from the argument, else ``$RRH_NUM_EXPERTS``; ``LayoutError`` when neither says.

    Never inferred from the ids: an id wrapped into ``[E, 256)`` would raise the bound and hide itself.
    """
    if num_experts is None:
        text = os.environ.get(NUM_EXPERTS_ENV)
        if text is None:
            raise LayoutError(
                f"num_experts: a {framework} dump does not record it; expected records(path, num_experts=E) "
                f"or {NUM_EXPERTS_ENV}=E (the model config's num_experts / n_routed_experts)"
            )
        try:
            num_experts = int(text)
        except ValueError:
            raise LayoutError(f"{NUM_EXPERTS_ENV}={text!r}: expected an integer number of experts") from None
    if not 1 <= int(num_experts) <= 65536:
        raise LayoutError(f"num_experts: {num_experts}; expected an integer in [1, 65536]")
    return int(num_experts)


def moe_layers_input(moe_layers: Sequence[int] | None) -> tuple[int, ...] | None:
    """Decoder indices of the MoE layers from the argument, else ``$RRH_MOE_LAYERS`` (``"1-47"``,
    ``"0,2,4"``), else ``None`` (inferred from the dump)."""
    if moe_layers is not None:
        return tuple(int(x) for x in moe_layers)
    text = os.environ.get(MOE_LAYERS_ENV)
    if text is None:
        return None
    layers: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise LayoutError(
            f"{MOE_LAYERS_ENV}={text!r}: expected decoder indices like '1-47' or '0,2,4'"
        ) from None
    return tuple(layers)


def infer_moe_layers(
    routes: npt.NDArray[Any], captured: npt.NDArray[np.bool_], source: str
) -> tuple[int, ...]:
    """The layers with a non-zero id in some captured row of ``routes [rows, L, K]`` (dense slots are 0)."""
    layers = np.flatnonzero(routes[captured].any(axis=(0, 2)))
    if layers.size == 0:
        raise LayoutError(
            f"{source}: every captured route is zero, so the MoE layers cannot be inferred; "
            f"expected moe_layers= or {MOE_LAYERS_ENV}"
        )
    return tuple(int(x) for x in layers)


def check_moe_layers(moe_layers: tuple[int, ...], num_layers: int, source: str) -> None:
    if (
        not moe_layers
        or list(moe_layers) != sorted(set(moe_layers))
        or not 0 <= moe_layers[0] <= moe_layers[-1] < num_layers
    ):
        raise LayoutError(
            f"{source}: moe_layers {list(moe_layers)}; expected distinct increasing decoder indices in "
            f"[0, {num_layers}) (the layer axis of the routes)"
        )


def payload_rows(
    rows: npt.NDArray[Any], first: int, length: int, has_route: npt.NDArray[np.bool_] | None = None
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_]]:
    """The engine rows of a sample and which hold a captured route.

    ``rows [S, L, K]`` is the sample's padded row axis; position 0 of its ``length = P+R`` tokens
    is at index ``first``. ``has_route`` marks rows the dump says were captured; without it (zero
    filler) the payload runs from position 0 to the last non-zero row. The result covers positions
    ``[0, P+R−1)``; rows the payload left empty are not captured. A payload the dump placed outside
    the sample (before position 0, or past the last token) is kept, so coverage names its row count:
    never cut to fit. A real row for the last token (truncated response, §3.1) is dropped. Rows not
    captured are returned as zeros, whatever filler the dump held (SkyRL after 0.3.0: ``arange(K)``).
    """
    expected = length - 1
    captured_axis: npt.NDArray[np.bool_] = (
        np.asarray(rows.reshape(rows.shape[0], -1).any(axis=1)) if has_route is None else has_route
    )
    present = np.flatnonzero(captured_axis)
    if present.size == 0:
        return np.zeros_like(rows[first : first + expected]), np.zeros(expected, dtype=bool)
    lo, hi = min(first, int(present[0])), int(present[-1]) + 1
    if has_route is None:
        captured_axis = np.zeros(rows.shape[0], dtype=bool)
        captured_axis[lo:hi] = True
    end = max(first + expected, hi - 1 if hi == first + length else hi)
    payload, captured = rows[lo:end], captured_axis[lo:end]
    if has_route is not None and not captured.all():
        payload = np.where(captured[:, None, None], payload, 0).astype(rows.dtype)
    return payload, captured


def check_ids_fit(routes: npt.NDArray[Any], num_experts: int, source: str, sample: int, step: int) -> None:
    """``LayoutError`` naming the cell when an id cannot be stored in the layout's dtype for ``num_experts``.

    Ids in ``[num_experts, 2**bits)`` are stored and reported by the audit (``ids_valid``); a
    negative id or one past the dtype (an int16 wrap) has no representation there.
    """
    limit = int(np.iinfo(storage_dtype(num_experts)).max)
    bad = (routes < 0) | (routes > limit)
    if bad.any():
        row, layer, slot = (int(x) for x in np.argwhere(bad)[0])
        raise LayoutError(
            f"{source} step {step} sample {sample} row {row} layer {layer}: "
            f"expert id {int(routes[row, layer, slot])}; "
            f"expected an id in [0, {num_experts}) (num_experts={num_experts})"
        )
