"""Decoding one row group of a layout file into a ``Batch``, zero-copy and checked.

Every length a file declares (list lengths, blob bytes, row counts) is checked against the data
that is really there before any view is made from it; a mismatch is a ``LayoutError`` naming the
file, the column and the row. A file of an older layout version gets the newer columns as nulls.

Imports ``harness.audit``'s layout and batch, and ``harness.trace``; pyarrow when it runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout.batch import Batch, IntArray, ListColumn, RouteColumn
from harness.audit.layout.schema import FORWARDS, MAX_SHARDS, ROUTE_COLUMNS, LayoutError, arrow_schema
from harness.trace import MAX_LAYERS, LayerAxis


def arrow_numpy(array: Any) -> npt.NDArray[Any]:
    """A primitive Arrow ``array``'s values as numpy: numbers a view of the buffer, booleans unpacked.

    What ``Array.to_numpy`` gives for an array without nulls (a null slot holds whatever its buffer
    holds), without its first call importing pandas (most of a second, in every worker).
    """
    import pyarrow as pa

    kind, n = array.type, len(array)
    if pa.types.is_boolean(kind):
        bits = array.buffers()[1]
        if bits is None or n == 0:
            return np.zeros(n, dtype=bool)
        unpacked = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")
        return unpacked[array.offset : array.offset + n].astype(bool)
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        code = "f" if pa.types.is_floating(kind) else "i" if pa.types.is_signed_integer(kind) else "u"
        dtype = np.dtype(f"{code}{kind.bit_width // 8}")
        values = array.buffers()[1]
        if values is None or n == 0:
            return np.zeros(n, dtype=dtype)
        return np.frombuffer(values, dtype=dtype, count=n, offset=array.offset * dtype.itemsize)
    return np.asarray(array.to_numpy(zero_copy_only=False))


def _scalar(table: Any, name: str, path: str, file_rows: IntArray) -> npt.NDArray[Any]:
    array = arrow_column(table, name)
    if array.null_count:
        index = int(np.flatnonzero(~_valid(array))[0])
        raise LayoutError(f"{path} row {int(file_rows[index])}: column {name!r} is null; expected a value")
    return arrow_numpy(array)


def _uniform(values: npt.NDArray[Any], name: str, path: str, file_rows: IntArray) -> int:
    """The one value of a per-row model column; a batch mixing models is refused."""
    if values.size and (values != values[0]).any():
        index = int(np.flatnonzero(values != values[0])[0])
        raise LayoutError(
            f"{path} row {int(file_rows[index])}: column {name!r} is {values[index]}, "
            f"row {int(file_rows[0])} has "
            f"{values[0]}; expected one model per run"
        )
    return int(values[0]) if values.size else 0


def arrow_column(table: Any, name: str) -> Any:
    """Column ``name`` of ``table`` as one Arrow array: its only chunk as is, or the chunks joined."""
    import pyarrow as pa

    column = table.column(name)
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks() if column.num_chunks else pa.array([], column.type)


def _list_column(table: Any, name: str, dtype: Any) -> ListColumn:
    array = arrow_column(table, name)
    valid = _valid(array)
    offsets = arrow_numpy(array.offsets).astype(np.int64)
    values = array.values
    if values.null_count:
        raise LayoutError(f"column {name!r}: null inside a list; expected values")
    flat = arrow_numpy(values) if len(values) else np.zeros(0, dtype)
    base = offsets[0]
    return ListColumn(offsets - base, np.asarray(flat[base : offsets[-1]], dtype=dtype), valid)


def list_sums(column: ListColumn) -> IntArray:
    """The sum of each list of ``column`` (0 for an empty or null one).

    Computed from a running total, not ``np.add.reduceat``: that one refuses an offset equal to the
    number of values, which is where every list after the last non-empty one starts (a row whose
    sample had no attempts, at the end of a row group).
    """
    running = np.concatenate([[0], np.cumsum(column.values, dtype=np.int64)])
    return (running[column.offsets[1:]] - running[column.offsets[:-1]]).astype(np.int64)


def _valid(array: Any) -> npt.NDArray[np.bool_]:
    """Which entries of ``array`` are not null (no work for an array without nulls)."""
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    if array.null_count == len(array):
        return np.zeros(len(array), dtype=bool)
    return ~arrow_numpy(array.is_null())


def _check_lengths(
    column: ListColumn, expected: IntArray, name: str, what: str, batch_path: str, file_rows: IntArray
) -> None:
    """Every non-null list of ``column`` has ``expected`` entries.

    Raises ``LayoutError`` on the first that has not.
    """
    bad = column.valid & (column.lengths() != expected)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LayoutError(
            f"{batch_path} row {int(file_rows[i])}: column {name!r} has {int(column.lengths()[i])} entries; "
            f"expected {int(expected[i])} ({what})"
        )


def _route_column(
    table: Any,
    name: str,
    dtype: np.dtype[Any],
    row_shape: tuple[int, int],
    path: str,
    file_rows: IntArray,
    counts: tuple[npt.NDArray[Any], npt.NDArray[np.bool_]] | None = None,
) -> RouteColumn:
    """The blobs of ``<name>_routes`` as one view; every blob's length checked against its row count.

    The row count of each blob is ``<name>_rows``, or ``counts`` (values, valid) where the caller
    computed them (``attempt_routes``: the sum of ``attempt_rows``).
    """
    blobs = arrow_column(table, f"{name}_routes")
    if counts is None:
        count_array = arrow_column(table, f"{name}_rows")
        counts = (arrow_numpy(count_array), _valid(count_array))
    valid = _valid(blobs)
    counted = counts[1]
    rows = np.where(valid & counted, counts[0], np.where(valid, -1, 0)).astype(np.int64)
    missing = valid & (rows < 0)
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column {name}_rows is {int(rows[i]) if counted[i] else None}; "
            f"expected the row count of {name}_routes (a non-negative integer)"
        )
    buffers = blobs.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64, count=len(blobs) + 1, offset=blobs.offset * 8)
    row_bytes = row_shape[0] * row_shape[1] * dtype.itemsize
    lengths = np.diff(offsets)
    bad = valid & (lengths != rows * row_bytes)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column {name}_routes holds {int(lengths[i])} bytes; expected "
            f"{int(rows[i])} rows × {row_shape[0]} layers × top-{row_shape[1]} × {dtype.itemsize} B = "
            f"{int(rows[i]) * row_bytes} ({name}_rows, num_layers, top_k, {dtype})"
        )
    start, stop = int(offsets[0]), int(offsets[-1])
    data = buffers[2]
    if data is None or stop - start == 0:
        flat = np.zeros(0, dtype=dtype)
    else:
        flat = np.frombuffer(
            data, dtype=dtype.newbyteorder("<"), count=(stop - start) // dtype.itemsize, offset=start
        )
    routes = flat.reshape(-1, *row_shape)
    return RouteColumn(routes, np.concatenate([[0], np.cumsum(rows)]).astype(np.int64), valid)


def _moe_layers(table: Any, path: str, file_rows: IntArray) -> tuple[int, ...]:
    column = _list_column(table, "moe_layers", np.int64)
    first = (
        tuple(int(x) for x in column.values[column.offsets[0] : column.offsets[1]])
        if len(column.valid)
        else ()
    )
    lengths = column.lengths()
    same = (
        (lengths == len(first)).all() and (column.values.reshape(-1, len(first)) == np.asarray(first)).all()
        if len(first)
        else (lengths == 0).all()
    )
    if not same:
        raise LayoutError(
            f"{path} rows {int(file_rows[0])}…: column 'moe_layers' differs between rows; "
            "expected one model per run"
        )
    return first


def decode(table: Any, path: str, first_row: int, rows: IntArray | None = None) -> Batch:
    """Decode and check one row group (a ``pyarrow.Table``) of layout file ``path``.

    Its rows are rows ``first_row, first_row + 1, …`` of the file, or ``rows`` (the file's index of
    each row of ``table``, when rows were filtered out): errors and offenders name them so.
    """
    from harness.trace import storage_dtype

    table = _with_newer_columns(table)
    n = table.num_rows
    file_rows = (
        np.arange(first_row, first_row + n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
    )
    ints = {name: _scalar(table, name, path, file_rows).astype(np.int64) for name in (
        "step", "rank", "prompt_len", "response_len", "num_experts", "top_k", "num_layers", "routes_start"
    )}  # fmt: skip
    for name, low in (("prompt_len", 1), ("response_len", 0), ("routes_start", 0), ("rank", 0)):
        bad = ints[name] < low
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LayoutError(
                f"{path} row {int(file_rows[i])}: column {name!r} is {ints[name][i]}; expected >= {low}"
            )
    last = ints["prompt_len"] + ints["response_len"] - 1
    past = ints["routes_start"] > last
    if past.any():
        i = int(np.flatnonzero(past)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column 'routes_start' is {ints['routes_start'][i]}; "
            f"expected <= prompt_len + response_len − 1 = {last[i]}"
        )
    num_experts = _uniform(ints["num_experts"], "num_experts", path, file_rows)
    top_k = _uniform(ints["top_k"], "top_k", path, file_rows)
    num_layers = _uniform(ints["num_layers"], "num_layers", path, file_rows)
    if n and not 1 <= num_experts <= 65536:
        raise LayoutError(
            f"{path} row {int(file_rows[0])}: column 'num_experts' is {num_experts}; expected 1..65536"
        )
    if n and not 1 <= top_k <= num_experts:
        raise LayoutError(
            f"{path} row {int(file_rows[0])}: column 'top_k' is {top_k}; "
            f"expected 1..num_experts={num_experts}"
        )
    if n and not 1 <= num_layers <= MAX_LAYERS:
        raise LayoutError(
            f"{path} row {int(file_rows[0])}: column 'num_layers' is {num_layers}; expected 1..{MAX_LAYERS}"
        )
    axes = table.column("layer_axis").to_pylist()
    try:
        axis = LayerAxis(axes[0]) if n else LayerAxis.DECODER
    except ValueError:
        raise LayoutError(
            f"{path} row {int(file_rows[0])}: column 'layer_axis' is {axes[0]!r}; expected one of "
            f"{[a.value for a in LayerAxis]}"
        ) from None
    if any(a != axes[0] for a in axes):
        raise LayoutError(
            f"{path} rows {int(file_rows[0])}…: column 'layer_axis' differs between rows; expected one"
        )
    moe = _moe_layers(table, path, file_rows) if n else ()
    width = num_layers if axis is LayerAxis.DECODER else len(moe)
    bound = num_layers if axis is LayerAxis.DECODER else MAX_LAYERS
    if n and (
        not moe or list(moe) != sorted(set(moe)) or moe[0] < 0 or moe[-1] >= bound or width != num_layers
    ):
        raise LayoutError(
            f"{path} row {int(file_rows[0])}: column 'moe_layers' is {list(moe)}; "
            "expected distinct increasing "
            f"decoder indices, within [0, num_layers={num_layers}) on the decoder axis, one per slot on "
            "the moe_ordinal axis"
        )
    lengths = {"tokens": ints["prompt_len"] + ints["response_len"], "response": ints["response_len"]}
    lists = {
        "tokens": _list_column(table, "tokens", np.int64),
        "trainer_tokens": _list_column(table, "trainer_tokens", np.int64),
        "loss_mask": _list_column(table, "loss_mask", bool),
        "engine_logprobs": _list_column(table, "engine_logprobs", np.float32),
        "trainer_logprobs": _list_column(table, "trainer_logprobs", np.float32),
        "engine_captured": _list_column(table, "engine_captured", bool),
        "attempt_ends": _list_column(table, "attempt_ends", np.int64),
    }
    if not lists["tokens"].valid.all():
        i = int(np.flatnonzero(~lists["tokens"].valid)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column 'tokens' is null; expected prompt ⊕ response ids"
        )
    for name, key, what in (
        ("tokens", "tokens", "prompt_len + response_len"),
        ("trainer_tokens", "tokens", "prompt_len + response_len"),
        ("loss_mask", "response", "response_len"),
        ("engine_logprobs", "response", "response_len"),
        ("trainer_logprobs", "response", "response_len"),
    ):
        _check_lengths(lists[name], lengths[key], name, what, path, file_rows)
    dtype = storage_dtype(num_experts) if n else np.dtype(np.uint8)
    routes = {
        name: _route_column(table, name, dtype, (width, top_k), path, file_rows) for name in ROUTE_COLUMNS
    }
    engine_rows = np.diff(routes["engine"].row_offsets)
    _check_lengths(lists["engine_captured"], engine_rows, "engine_captured", "engine_rows", path, file_rows)
    v2 = _v2_fields(table, dtype, (width, top_k), lists["attempt_ends"], routes["trainer"], path, file_rows)
    replay = table.column("replay").to_pylist()
    for i, mode in enumerate(replay):
        if mode not in (None, "none", "R2", "R3"):
            raise LayoutError(
                f"{path} row {int(file_rows[i])}: column 'replay' is {mode!r}; expected none, R2, R3 or null"
            )
    origin = table.column("origin").to_pylist()
    origin_array = arrow_column(table, "origin_column")
    origin_column = np.where(_valid(origin_array), arrow_numpy(origin_array), -1).astype(np.int64)
    return Batch(
        origin=origin,
        origin_column=origin_column,
        path=path,
        first_row=first_row,
        file_rows=file_rows,
        size=n,
        step=ints["step"],
        sample_key=table.column("sample_key").to_pylist(),
        group_key=table.column("group_key").to_pylist(),
        rank=ints["rank"],
        prompt_len=ints["prompt_len"],
        response_len=ints["response_len"],
        num_experts=num_experts,
        top_k=top_k,
        num_layers=num_layers,
        layer_axis=axis,
        moe_layers=moe,
        routes_start=ints["routes_start"],
        replay=replay,
        source=table.column("source").to_pylist(),
        tokens=lists["tokens"],
        trainer_tokens=lists["trainer_tokens"],
        loss_mask=lists["loss_mask"],
        engine_logprobs=lists["engine_logprobs"],
        trainer_logprobs=lists["trainer_logprobs"],
        engine_captured=lists["engine_captured"],
        attempt_ends=lists["attempt_ends"],
        routes=routes,
        **v2,
    )


V2_COLUMNS = ("forward", "attempt_routes", "attempt_rows", "shard", "shards", "positions")
"""The columns layout version 2 added (the tap's)."""
V3_COLUMNS = ("origin", "origin_column")
"""The columns layout version 3 added (where an importer read each sample)."""


def _with_newer_columns(table: Any) -> Any:
    """``table`` with the newer versions' columns it lacks (an older file's) added as nulls."""
    import pyarrow as pa

    schema = arrow_schema()
    for name in (*V2_COLUMNS, *V3_COLUMNS):
        if name not in table.schema.names:
            table = table.append_column(schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
    return table


def _v2_fields(
    table: Any,
    dtype: np.dtype[Any],
    row_shape: tuple[int, int],
    attempt_ends: ListColumn,
    trainer: RouteColumn,
    path: str,
    file_rows: IntArray,
) -> dict[str, Any]:
    """The decoded version-2 columns of ``decode``, their lengths checked against each other."""
    forward = table.column("forward").to_pylist()
    for i, kind in enumerate(forward):
        if kind is not None and kind not in FORWARDS:
            raise LayoutError(
                f"{path} row {int(file_rows[i])}: column 'forward' is {kind!r}; expected one of "
                f"{list(FORWARDS)} or null"
            )
    attempt_rows = _list_column(table, "attempt_rows", np.int64)
    has_payloads = _valid(arrow_column(table, "attempt_routes"))
    bad = has_payloads & (
        ~attempt_rows.valid | ~attempt_ends.valid | (attempt_rows.lengths() != attempt_ends.lengths())
    )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column 'attempt_rows' has "
            f"{int(attempt_rows.lengths()[i]) if attempt_rows.valid[i] else None} entries; expected one per "
            f"attempt of attempt_ends ({int(attempt_ends.lengths()[i]) if attempt_ends.valid[i] else None})"
        )
    if (attempt_rows.values < 0).any():
        i = (
            int(
                np.searchsorted(
                    attempt_rows.offsets, int(np.flatnonzero(attempt_rows.values < 0)[0]), "right"
                )
            )
            - 1
        )
        raise LayoutError(f"{path} row {int(file_rows[i])}: column 'attempt_rows' holds a negative count")
    totals = list_sums(attempt_rows)
    attempts = _route_column(
        table, "attempt", dtype, row_shape, path, file_rows, (totals, attempt_rows.valid)
    )
    shard_array, shards_array = arrow_column(table, "shard"), arrow_column(table, "shards")
    shard = np.where(_valid(shard_array), arrow_numpy(shard_array), -1).astype(np.int64)
    shards = np.where(_valid(shards_array), arrow_numpy(shards_array), 0).astype(np.int64)
    positions = _list_column(table, "positions", np.int64)
    is_shard = shard >= 0
    complete = ~is_shard | (positions.valid & (shard < shards) & trainer.valid)
    if (_valid(shard_array) != is_shard).any() or not complete.all():
        i = int(np.flatnonzero(~complete)[0]) if not complete.all() else 0
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: a shard row needs shard in [0, shards), positions and "
            f"trainer_routes; got shard={int(shard[i])}, shards={int(shards[i])}, "
            f"positions {'present' if positions.valid[i] else 'null'}, "
            f"trainer_routes {'present' if trainer.valid[i] else 'null'}"
        )
    _check_lengths(positions, np.diff(trainer.row_offsets), "positions", "trainer_rows", path, file_rows)
    too_many = is_shard & (shards > MAX_SHARDS)
    if too_many.any():
        i = int(np.flatnonzero(too_many)[0])
        raise LayoutError(
            f"{path} row {int(file_rows[i])}: column 'shards' is {int(shards[i])}; expected at most "
            f"{MAX_SHARDS} (the CP × SP ranks a sample is split into)"
        )
    return {
        "forward": forward,
        "attempts": attempts,
        "attempt_rows": attempt_rows,
        "shard": shard,
        "shards": shards,
        "positions": positions,
    }
