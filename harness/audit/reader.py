"""Reading a run: its files, the units of work they split into, and batches decoded zero-copy.

A **unit** is a run of consecutive row groups of one file, about ``UNIT_BYTES`` of compressed
data: what one executor task reads and folds into an accumulator. Row groups are read one at a
time, so memory is bounded by the row groups in flight, never by a file's or a run's size.

``Batch`` is one row group decoded: scalar columns as numpy arrays, list columns as (offsets,
values) numpy views of the Arrow buffers, route blobs as one ``[rows, layers, top_k]`` view of
the batch's contiguous blob buffer. Every length a file declares (list lengths, blob bytes, row
counts) is checked against the data that is really there before any view is made from it; a
mismatch is a ``LayoutError`` naming the file, the column and the row.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.atomic import TMP_MARK
from harness.audit.layout import (
    FILE_SUFFIX,
    FORWARDS,
    KNOWN,
    METADATA_KEY,
    ROUTE_COLUMNS,
    LayoutError,
    arrow_schema,
    schema_document,
)
from harness.trace import MAX_LAYERS, LayerAxis

UNIT_BYTES = 64 << 20
"""Compressed bytes of row groups per unit of work."""
MAX_GROUP_ROWS = 1 << 22
"""Rows a row group may declare: a row group is decoded whole (about 100 bytes a row at the least),
so one declaring more is refused before it is read. The layout's writer makes row groups of
``writer.ROW_GROUP_BYTES`` (32 MiB), a few hundred thousand rows at most."""
MAX_GROUP_BYTES = 4 << 30
"""Uncompressed bytes a row group or a column chunk may declare, checked before it is read."""
MODEL_COLUMNS = ("num_experts", "top_k", "num_layers", "layer_axis", "moe_layers")
"""The columns that describe the model: one model per run."""

Model = tuple[int, int, int, str, tuple[int, ...]]
"""``(num_experts, top_k, num_layers, layer_axis, moe_layers)`` of a row."""

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Unit:
    """Consecutive row groups of one layout file: one task of an executor."""

    path: str
    row_groups: tuple[int, ...]
    nbytes: int
    first_row: int
    """Index in the file of the unit's first row (errors name rows by their index in the file)."""
    model: Model | None = None
    """The run's model (its first file's); a row group of another model is an input error."""


def run_files(run: str | os.PathLike[str], errors: list[str] | None = None) -> list[Path]:
    """The layout files of ``run`` (a directory, searched recursively, or one file), sorted.

    Temporary files of a writer that was killed are not part of the run. ``LayoutError`` when
    there is no run there. A subdirectory that cannot be listed (removed while the audit reads it,
    unreadable) is a line in ``errors`` when given (else a ``LayoutError``); an entry named like a
    layout file that is not a regular file (a FIFO, a device) is listed, and refused when opened.
    """
    root = Path(run)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise LayoutError(f"{root}: no such file or directory; expected a run directory")
    problems: list[str] = []

    def unlisted(err: OSError) -> None:
        problems.append(
            f"{err.filename}: cannot be listed ({err.strerror}); expected a readable run directory"
        )

    files: list[Path] = []
    for folder, subfolders, names in os.walk(root, onerror=unlisted):
        subfolders.sort()
        files.extend(Path(folder) / n for n in names if n.endswith(FILE_SUFFIX) and TMP_MARK not in n)
    if problems and errors is None:
        raise LayoutError(problems[0])
    if errors is not None:
        errors.extend(problems)
    if not files and not problems:
        raise LayoutError(f"{root}: no run here (no *{FILE_SUFFIX} file of the run layout)")
    return sorted(files)


def _open(path: str) -> Any:
    import pyarrow.parquet as pq

    from harness.audit.inputs import open_regular

    open_regular(path).close()  # a FIFO or a device named like a layout file is refused, never read
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not Parquet
        first = (str(err).splitlines() or [""])[0][:200]
        raise LayoutError(
            f"{path}: not a readable Parquet file ({type(err).__name__}: {first}); "
            "expected a run-layout Parquet file"
        ) from None


def check_schema(path: str, schema: Any) -> int:
    """The layout version of a file's Arrow ``schema``, after checking its columns and their types."""
    metadata = schema.metadata or {}
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        raise LayoutError(
            f"{path}: no {METADATA_KEY.decode()} key in the file's metadata; not a run-layout file"
        )
    try:
        version = int(raw)
    except ValueError:
        raise LayoutError(
            f"{path}: {METADATA_KEY.decode()} is {raw!r}; expected an integer version"
        ) from None
    if version not in KNOWN:
        raise LayoutError(
            f"{path}: {METADATA_KEY.decode()} version {version}; this harness reads versions {list(KNOWN)}"
        )
    expected = arrow_schema(version)
    for want in expected:
        index = schema.get_field_index(want.name)
        if index < 0:
            raise LayoutError(f"{path}: column {want.name!r} missing; expected {want.type}")
        got = schema.field(index).type
        if not got.equals(want.type):
            raise LayoutError(f"{path}: column {want.name!r} has type {got}; expected {want.type}")
    return version


def _metadata_errors(function: Any) -> Any:
    """``function(path, …)`` with a failure of pyarrow on a damaged footer (undecodable names, …) said
    as a ``LayoutError`` naming the file, never raised as pyarrow's own."""

    def checked(path: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(path, *args, **kwargs)
        except LayoutError:
            raise
        except Exception as err:
            text = (str(err).splitlines() or [""])[0][:200]
            raise LayoutError(f"{path}: unreadable metadata ({type(err).__name__}: {text})") from None

    checked.__doc__, checked.__name__ = function.__doc__, function.__name__
    return checked


@_metadata_errors
def plan_units(path: Path, unit_bytes: int = UNIT_BYTES, model: Model | None = None) -> list[Unit]:
    """Split one file into units of about ``unit_bytes``; checks the file's schema and version first,
    and what each row group declares (rows, sizes, where its columns lie) against the file."""
    handle = _open(str(path))
    check_schema(str(path), handle.schema_arrow)
    meta = handle.metadata
    size = _file_size(path)
    units: list[Unit] = []
    groups: list[int] = []
    nbytes = first = row = 0
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        check_row_group(str(path), group, index, size)
        if groups and nbytes + group.total_byte_size > unit_bytes:
            units.append(Unit(str(path), tuple(groups), nbytes, first, model))
            groups, nbytes, first = [], 0, row
        groups.append(index)
        nbytes += group.total_byte_size
        row += group.num_rows
    if groups:
        units.append(Unit(str(path), tuple(groups), nbytes, first, model))
    return units


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as err:
        raise LayoutError(f"{path}: cannot be read ({err.strerror})") from None


def check_row_group(path: str, group: Any, index: int, file_size: int) -> None:
    """What row group ``index`` declares, checked before anything is decoded: its rows (at most
    ``MAX_GROUP_ROWS``, and as many as its ``step`` column holds values), its sizes (at most
    ``MAX_GROUP_BYTES``) and its column chunks inside the file."""
    where = f"{path} row group {index}"
    rows = group.num_rows
    if not 0 <= rows <= MAX_GROUP_ROWS:
        raise LayoutError(
            f"{where}: declares {rows} rows; expected 0..{MAX_GROUP_ROWS} (a row group is decoded whole: "
            "rewrite the run with smaller row groups)"
        )
    if not 0 <= group.total_byte_size <= MAX_GROUP_BYTES:
        raise LayoutError(
            f"{where}: declares {group.total_byte_size} uncompressed bytes; "
            f"expected at most {MAX_GROUP_BYTES}"
        )
    for c in range(group.num_columns):
        chunk = group.column(c)
        name = chunk.path_in_schema
        if name == "step" and chunk.num_values != rows:  # required and flat: one value per row
            raise LayoutError(
                f"{where}: declares {rows} rows, its column 'step' {chunk.num_values} values; "
                "expected as many"
            )
        start = min(x for x in (chunk.dictionary_page_offset, chunk.data_page_offset) if x is not None)
        end = start + chunk.total_compressed_size
        if (
            chunk.num_values < 0
            or not 4 <= start <= end <= file_size
            or not 0 <= chunk.total_uncompressed_size <= MAX_GROUP_BYTES
        ):
            raise LayoutError(
                f"{where}: column {name!r} declares {chunk.total_compressed_size} bytes at offset {start} "
                f"({chunk.total_uncompressed_size} uncompressed, {chunk.num_values} values); expected a "
                f"chunk inside the {file_size}-byte file, at most {MAX_GROUP_BYTES} bytes uncompressed"
            )


@_metadata_errors
def first_model(path: Path) -> Model | None:
    """The model of the first row of layout file ``path`` (``None`` when it has no row)."""
    handle = _open(str(path))
    check_schema(str(path), handle.schema_arrow)
    meta = handle.metadata
    size = _file_size(path)
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        check_row_group(str(path), group, index, size)
        if group.num_rows:
            try:
                table = handle.read_row_group(index, columns=list(MODEL_COLUMNS), use_threads=False)
            except Exception as err:
                raise LayoutError(f"{path} row group {index}: unreadable ({type(err).__name__})") from None
            return model_of(table.slice(0, 1).to_pylist()[0], f"{path} row group {index}")
    return None


def model_of(row: dict[str, Any], where: str) -> Model:
    """The model columns of one row (a dict) as a ``Model``."""
    try:
        return (
            int(row["num_experts"]), int(row["top_k"]), int(row["num_layers"]), str(row["layer_axis"]),
            tuple(int(x) for x in row["moe_layers"]),
        )  # fmt: skip
    except (TypeError, ValueError, KeyError):
        raise LayoutError(f"{where}: a model column ({', '.join(MODEL_COLUMNS)}) is null") from None


def check_model(batch: Batch, model: Model | None) -> None:
    """A decoded row group is of the run's ``model`` (one model per run: the run's first file's)."""
    if model is None or batch.size == 0:
        return
    mine = (batch.num_experts, batch.top_k, batch.num_layers, batch.layer_axis.value, batch.moe_layers)
    if mine != model:
        names = [n for n, a, b in zip(MODEL_COLUMNS, mine, model, strict=True) if a != b]
        raise LayoutError(
            f"{batch.where(0)}: {names[0]} is {mine[MODEL_COLUMNS.index(names[0])]}; expected "
            f"{model[MODEL_COLUMNS.index(names[0])]} like the run's first file (one model per run)"
        )


# --- decoding -------------------------------------------------------------------------------------


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
    """One row group of a layout file, decoded and checked (see the module docstring)."""

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


def _numpy(array: Any) -> npt.NDArray[Any]:
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
    array = _array(table, name)
    if array.null_count:
        index = int(np.flatnonzero(~_valid(array))[0])
        raise LayoutError(f"{path} row {int(file_rows[index])}: column {name!r} is null; expected a value")
    return _numpy(array)


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


def _array(table: Any, name: str) -> Any:
    """Column ``name`` of ``table`` as one Arrow array: its only chunk as is, or the chunks joined."""
    import pyarrow as pa

    column = table.column(name)
    if column.num_chunks == 1:
        return column.chunk(0)
    return column.combine_chunks() if column.num_chunks else pa.array([], column.type)


def _list_column(table: Any, name: str, dtype: Any) -> ListColumn:
    array = _array(table, name)
    valid = _valid(array)
    offsets = _numpy(array.offsets).astype(np.int64)
    values = array.values
    if values.null_count:
        raise LayoutError(f"column {name!r}: null inside a list; expected values")
    flat = _numpy(values) if len(values) else np.zeros(0, dtype)
    base = offsets[0]
    return ListColumn(offsets - base, np.asarray(flat[base : offsets[-1]], dtype=dtype), valid)


def _valid(array: Any) -> npt.NDArray[np.bool_]:
    """Which entries of ``array`` are not null (no work for an array without nulls)."""
    if array.null_count == 0:
        return np.ones(len(array), dtype=bool)
    if array.null_count == len(array):
        return np.zeros(len(array), dtype=bool)
    return ~_numpy(array.is_null())


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
    blobs = _array(table, f"{name}_routes")
    if counts is None:
        count_array = _array(table, f"{name}_rows")
        counts = (_numpy(count_array), _valid(count_array))
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

    table = _with_v2_columns(table)
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
    origin_array = _array(table, "origin_column")
    origin_column = np.where(_valid(origin_array), _numpy(origin_array), -1).astype(np.int64)
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


def _with_v2_columns(table: Any) -> Any:
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
    has_payloads = _valid(_array(table, "attempt_routes"))
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
    sums = (
        np.add.reduceat(attempt_rows.values, attempt_rows.offsets[:-1]) if attempt_rows.values.size else None
    )
    totals = np.zeros(len(forward), dtype=np.int64)
    if sums is not None:
        nonempty = attempt_rows.lengths() > 0
        totals[nonempty] = sums[nonempty]
    attempts = _route_column(
        table, "attempt", dtype, row_shape, path, file_rows, (totals, attempt_rows.valid)
    )
    shard_array, shards_array = _array(table, "shard"), _array(table, "shards")
    shard = np.where(_valid(shard_array), _numpy(shard_array), -1).astype(np.int64)
    shards = np.where(_valid(shards_array), _numpy(shards_array), 0).astype(np.int64)
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
    return {
        "forward": forward,
        "attempts": attempts,
        "attempt_rows": attempt_rows,
        "shard": shard,
        "shards": shards,
        "positions": positions,
    }


AUDIT_COLUMNS = (
    "step", "sample_key", "group_key", "rank", "prompt_len", "response_len", "tokens", "trainer_tokens",
    "loss_mask", "engine_logprobs", "trainer_logprobs", "num_experts", "top_k", "layer_axis", "num_layers",
    "moe_layers", "routes_start", "engine_routes", "engine_rows", "engine_captured", "trainer_routes",
    "trainer_rows", "recorded_routes", "recorded_rows", "replay", "attempt_ends", "source", *V2_COLUMNS,
    *V3_COLUMNS,
)  # fmt: skip
"""The columns ``decode`` reads: what the audit reads of a run (the benchmark's read floor reads the same)."""


def read_unit(
    unit: Unit, columns: Sequence[str] | None = AUDIT_COLUMNS, *, use_threads: bool = True
) -> Iterator[tuple[int, Any]]:
    """``(first row in the file, pyarrow.Table)`` for each row group of ``unit``, one at a time.

    ``columns``: the columns to read (default: those the audit reads; ``None``: every column).
    ``use_threads``: whether pyarrow decodes the columns of a row group in parallel threads (a
    worker of a process pool runs one thread: the pool is the parallelism).
    """
    handle = _open(unit.path)
    try:
        meta = handle.metadata
        present = set(handle.schema_arrow.names)  # a version-1 file has no version-2 column
    except Exception as err:  # a footer pyarrow cannot decode (names that are not UTF-8, …)
        raise LayoutError(f"{unit.path}: unreadable metadata ({type(err).__name__})") from None
    names = None if columns is None else [c for c in columns if c in present]
    first = unit.first_row
    size = _file_size(Path(unit.path))
    for index in unit.row_groups:
        try:
            group = meta.row_group(index)
            check_row_group(unit.path, group, index, size)  # again: the file may have changed since the plan
            table = handle.read_row_group(index, columns=names, use_threads=use_threads)
        except LayoutError:
            raise
        except Exception as err:  # a truncated or corrupt row group: pyarrow's error, said in one line
            text = (str(err).splitlines() or [""])[0][:200]
            raise LayoutError(
                f"{unit.path} row group {index} (rows {first}…): unreadable ({type(err).__name__}: {text})"
            ) from None
        if table.num_rows != group.num_rows:
            raise LayoutError(
                f"{unit.path} row group {index} (rows {first}…): declares {group.num_rows} rows, holds "
                f"{table.num_rows}; expected as many"
            )
        yield first, table
        first += group.num_rows


def layout_columns() -> tuple[str, ...]:
    return tuple(c["name"] for c in schema_document()["columns"])
