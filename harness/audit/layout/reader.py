"""Reading a run: its files, the units of work they split into, and their row groups one at a time.

A **unit** is a run of consecutive row groups of one file, about ``UNIT_BYTES`` of compressed
data: what one executor task reads and folds into an accumulator. Row groups are read one at a
time, so memory is bounded by the row groups in flight, never by a file's or a run's size.

A row group read is decoded into a ``Batch`` by ``harness.audit.layout.decode``
(``harness.audit.layout.batch``).
Every size a file's footer declares (rows and bytes of a row group, of a column chunk) is checked
against the file before the row group is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.atomic import TMP_MARK
from harness.audit.layout.batch import Batch
from harness.audit.layout.decode import V2_COLUMNS, V3_COLUMNS
from harness.audit.layout.schema import (
    FILE_SUFFIX,
    KNOWN,
    METADATA_KEY,
    LayoutError,
    arrow_schema,
    schema_document,
)

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

    from harness.audit.layout.footer import check_footer
    from harness.audit.layout.inputs import open_regular

    open_regular(path).close()  # a FIFO or a device named like a layout file is refused, never read
    check_footer(path)  # a footer pyarrow would abort the process on (SIGABRT) is refused first
    try:
        try:
            path.encode()
        except UnicodeEncodeError:  # a name that is not UTF-8: pyarrow takes no such path, a file does
            return pq.ParquetFile(open_regular(path))
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
