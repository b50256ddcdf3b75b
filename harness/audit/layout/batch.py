"""A decoded row group of a run: ``Batch`` and its list and route columns (DESIGN §7).

``Batch`` is one row group decoded: scalar columns as numpy arrays, list columns as (offsets,
values) numpy views of the Arrow buffers (``ListColumn``), route blobs as one ``[rows, layers,
top_k]`` view of the batch's contiguous blob buffer (``RouteColumn``). ``harness.audit.layout.decode``
makes them; the checks read them.

Imports numpy and ``harness.trace`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.trace import LayerAxis

IntArray = npt.NDArray[np.int64]


@dataclass
class ListColumn:
    """A list column of a batch: ``values[offsets[i]:offsets[i+1]]`` is row i's list.

    ``valid[i]`` says row i is not null.
    """

    offsets: IntArray
    values: npt.NDArray[Any]
    valid: npt.NDArray[np.bool_]

    def lengths(self) -> IntArray:
        return np.diff(self.offsets)


@dataclass
class RouteColumn:
    """A route blob column: ``routes[row_offsets[i]:row_offsets[i+1]]`` are sample i's rows."""

    routes: npt.NDArray[Any]
    """``[total rows, num_layers, top_k]``, a read-only view of the Arrow buffer."""
    row_offsets: IntArray
    valid: npt.NDArray[np.bool_]


@dataclass
class Batch:
    """One row group of a layout file, decoded and checked (``harness.audit.layout.decode``)."""

    path: str
    first_row: int
    size: int
    step: IntArray
    sample_key: list[str]
    group_key: list[str | None]
    rank: IntArray
    prompt_len: IntArray
    response_len: IntArray
    num_experts: int
    top_k: int
    num_layers: int
    layer_axis: LayerAxis
    moe_layers: tuple[int, ...]
    routes_start: IntArray
    replay: list[str | None]
    source: list[str]
    tokens: ListColumn
    trainer_tokens: ListColumn
    loss_mask: ListColumn
    engine_logprobs: ListColumn
    trainer_logprobs: ListColumn
    engine_captured: ListColumn
    attempt_ends: ListColumn
    routes: dict[str, RouteColumn]
    forward: list[str | None]
    """Layout v2: the trainer forward of ``trainer_routes`` (null in version-1 files)."""
    attempts: RouteColumn
    """Layout v2: each sample's attempt payloads, concatenated (``attempt_rows`` splits them)."""
    attempt_rows: ListColumn
    shard: IntArray
    """Layout v2: a shard row's shard index, −1 for a whole sample."""
    shards: IntArray
    positions: ListColumn
    file_rows: IntArray
    """The file's index of each row of the batch (``first_row + i`` unless rows were filtered out)."""

    @property
    def moe_slots(self) -> npt.NDArray[np.intp]:
        """Indices on the layer axis of the MoE layers."""
        if self.layer_axis is LayerAxis.DECODER:
            return np.asarray(self.moe_layers, dtype=np.intp)
        return np.arange(len(self.moe_layers), dtype=np.intp)

    origin: list[str | None]
    """Layout v3: where an importer read each sample (null: the layout file is the place)."""
    origin_column: IntArray
    """Layout v3: the column of route row 0 on the origin file's padded token axis, −1 where none."""

    def where(self, row: int) -> str:
        """Where the user finds batch row ``row``: the framework's own file and the sample's index in
        it when an importer wrote the row (``origin``), else the layout file and the row's index."""
        origin = self.origin[row]
        if origin is not None:
            return origin
        return f"{self.path} row {int(self.file_rows[row])}"

    def place(self, row: int, trace_row: int = -1) -> str:
        """``where(row)``, with the column of route row ``trace_row`` on the origin file's padded token
        axis where it has one (the token at position ``routes_start + trace_row`` is there too)."""
        column = int(self.origin_column[row])
        if trace_row < 0 or column < 0 or self.origin[row] is None:
            return self.where(row)
        return f"{self.where(row)}, token column {column + trace_row}"
