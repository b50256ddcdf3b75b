"""``RunWriter``: buffered, atomic-per-file writing of the run layout (DESIGN §7).

Frameworks, importers and the tap hand it ``SampleRecord``s; it buffers them and writes one
Parquet file (zstd, row groups of about ``ROW_GROUP_BYTES``) each time the buffer holds
``file_bytes`` of rows, and on ``close``. Every file is written under a temporary name and
renamed when complete (``harness.atomic``): a writer killed at any moment leaves whole files and
no half-written one under a final name, so an audit of a run cut short reads every file that was
finished and reports the run as cut short, never as corrupt data.

Files are named ``part-r<rank>-<sequence>.parquet``, so ranks writing into one directory never
collide and a rank's files sort in the order they were written.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.atomic import atomic_write
from harness.audit.layout.schema import FILE_SUFFIX, LayoutError, SampleRecord, arrow_schema

ROW_GROUP_BYTES = 32 << 20
"""Bytes of rows per Parquet row group: large enough for the kernels, small enough to stream."""
FILE_BYTES = 256 << 20
"""Bytes of buffered rows that make one file."""

_BLOBS = ("engine_routes", "trainer_routes", "recorded_routes", "attempt_routes")


def _row_bytes(row: dict[str, Any]) -> int:
    """A cheap estimate of a row's size: its blobs and four bytes per list entry."""
    size = 256
    for value in row.values():
        if isinstance(value, bytes):
            size += len(value)
        elif isinstance(value, list):
            size += 4 * len(value)
    return size


def write_table(path: Path, table: Any, nbytes: int, row_group_bytes: int = ROW_GROUP_BYTES) -> None:
    """Write a layout ``table`` to ``path`` atomically: zstd, row groups of about ``row_group_bytes``.

    ``nbytes`` is the rows' estimated size (``_row_bytes``), from which the rows per group follow.
    Blobs are neither dictionary-encoded nor given statistics (both would cost for nothing).
    """
    import pyarrow.parquet as pq

    group_rows = max(1, row_group_bytes // max(1, nbytes // max(1, table.num_rows)))
    names = table.schema.names

    def write(handle: Any) -> None:
        pq.write_table(
            table,
            handle,
            row_group_size=group_rows,
            compression="zstd",
            compression_level=1,
            use_dictionary=[n for n in names if n not in _BLOBS],
            write_statistics=["step", "rank", "prompt_len", "response_len"],
        )

    atomic_write(path, write)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` (``SampleRecord.as_row`` dicts) to ``path`` as one layout file, atomically."""
    import pyarrow as pa

    table = pa.Table.from_pylist(rows, schema=arrow_schema())
    write_table(path, table, sum(_row_bytes(r) for r in rows))


class RunWriter:
    """Writes the records of one rank into ``directory`` as run-layout Parquet files.

    Use as a context manager, or call ``close``: rows still buffered are written then. Memory is
    bounded by ``file_bytes`` of buffered rows.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, rank: int = 0, file_bytes: int = FILE_BYTES
    ) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise LayoutError(f"rank: expected a non-negative integer, got {rank!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.file_bytes = file_bytes
        self.files: list[Path] = []
        self._rows: list[dict[str, Any]] = []
        self._bytes = 0
        self._sequence = len(list(self.directory.glob(f"part-r{rank:05d}-*{FILE_SUFFIX}")))
        self._closed = False

    def write(self, record: SampleRecord) -> None:
        """Buffer one record (validated and encoded now); flush a file when the buffer is full."""
        if self._closed:
            raise LayoutError("RunWriter: write after close")
        row = record.as_row()
        self._rows.append(row)
        self._bytes += _row_bytes(row)
        if self._bytes >= self.file_bytes:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered rows as one file now; return its path (``None`` with nothing buffered)."""
        if not self._rows:
            return None
        path = self.directory / f"part-r{self.rank:05d}-{self._sequence:06d}{FILE_SUFFIX}"
        write_rows(path, self._rows)
        self._sequence += 1
        self._rows, self._bytes = [], 0
        self.files.append(path)
        return path

    def close(self) -> list[Path]:
        """Flush what is buffered; return every file this writer wrote."""
        if not self._closed:
            self.flush()
            self._closed = True
        return self.files

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        # On an exception the buffered rows are written too: they are whole records.
        self.close()
