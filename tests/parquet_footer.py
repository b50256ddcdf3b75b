"""A Parquet file's footer (Thrift compact protocol) read into plain values and written back.

Tests use it to make files that declare what their data does not hold — a row group of 2**40
rows, a column chunk past the end of the file, a page larger than the file — without a Parquet
writer that would refuse to. Only what a footer holds is supported: structs, lists, integers,
doubles, binaries and booleans. A struct is a ``dict`` from field id to ``(type, value)``.
"""

from __future__ import annotations

import struct
from typing import Any

from harness.audit.layout.footer import CompactReader

MAGIC = b"PAR1"
BOOL_TRUE, BOOL_FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(1, 13)

# The fields of parquet.thrift that tests edit (FileMetaData, RowGroup, ColumnChunk, ColumnMetaData).
FILE_NUM_ROWS, FILE_ROW_GROUPS = 3, 4
GROUP_COLUMNS, GROUP_BYTES, GROUP_NUM_ROWS = 1, 2, 3
CHUNK_META = 3
META_NUM_VALUES, META_UNCOMPRESSED, META_COMPRESSED, META_DATA_PAGE_OFFSET = 5, 6, 7, 9


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _zigzag(n: int) -> bytes:
    return _varint((n << 1) ^ (n >> 63))


def _write_value(kind: int, value: Any) -> bytes:
    if kind in (BOOL_TRUE, BOOL_FALSE):
        return b""
    if kind == BYTE:
        return bytes([value & 0xFF])
    if kind in (I16, I32, I64):
        return _zigzag(value)
    if kind == DOUBLE:
        return struct.pack("<d", value)
    if kind == BINARY:
        return _varint(len(value)) + bytes(value)
    if kind in (LIST, SET):
        inner, items = value
        head = (
            bytes([(len(items) << 4) | inner])
            if len(items) < 15
            else bytes([0xF0 | inner]) + _varint(len(items))
        )
        body = b"".join(bytes([1 if x else 2]) if inner in (BOOL_TRUE, BOOL_FALSE) else _write_value(inner, x)
                        for x in items)  # fmt: skip
        return head + body
    if kind == STRUCT:
        return write_struct(value)
    raise ValueError(f"thrift type {kind} not supported")


def write_struct(fields: dict[int, tuple[int, Any]]) -> bytes:
    out = bytearray()
    last = 0
    for field in sorted(fields):
        kind, value = fields[field]
        if kind in (BOOL_TRUE, BOOL_FALSE):
            kind = BOOL_TRUE if value else BOOL_FALSE
        delta = field - last
        out += bytes([(delta << 4) | kind]) if 0 < delta <= 15 else bytes([kind]) + _zigzag(field)
        out += _write_value(kind, value)
        last = field
    out.append(0)
    return bytes(out)


def read_footer(data: bytes) -> tuple[bytes, dict[int, tuple[int, Any]]]:
    """``(everything before the footer, the footer's FileMetaData)`` of a Parquet file's bytes."""
    if data[-4:] != MAGIC:
        raise ValueError("not a Parquet file")
    size = int.from_bytes(data[-8:-4], "little")
    body = data[: len(data) - 8 - size]
    return body, CompactReader(data[len(data) - 8 - size : -8], typed=True).struct()


def write_footer(body: bytes, meta: dict[int, tuple[int, Any]]) -> bytes:
    footer = write_struct(meta)
    return body + footer + len(footer).to_bytes(4, "little") + MAGIC


def row_groups(meta: dict[int, tuple[int, Any]]) -> list[dict[int, tuple[int, Any]]]:
    return list(meta[FILE_ROW_GROUPS][1][1])


def column_meta(group: dict[int, tuple[int, Any]]) -> list[dict[int, tuple[int, Any]]]:
    return [chunk[CHUNK_META][1] for chunk in group[GROUP_COLUMNS][1][1] if CHUNK_META in chunk]
