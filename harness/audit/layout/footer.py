"""A Parquet file's footer checked before pyarrow reads it: what pyarrow would abort the process on.

pyarrow validates some of a footer where it cannot raise a Python exception: a column chunk's size
statistics whose level histograms do not match the column's levels (``Definition level histogram
size mismatch``) end the whole audit with SIGABRT as soon as the chunk's metadata is touched. So the
footer (Thrift compact protocol) is parsed here, in Python, bounded by its bytes (no declared count
allocates more than the footer holds, nesting is capped), and every chunk's size statistics are
checked against the schema; a mismatch, or a footer that does not parse, is one ``LayoutError``
naming the file. Everything else pyarrow checks itself, with exceptions.

Imports ``harness.audit.layout.schema`` and ``harness.audit.layout.inputs``; no pyarrow.
"""

from __future__ import annotations

import os
import struct
from typing import Any

from harness.audit.layout.inputs import file_size, open_regular
from harness.audit.layout.schema import LayoutError

MAGIC = b"PAR1"
MAX_FOOTER_BYTES = 256 << 20
"""The largest footer read: far more than a layout file's (a few KiB a row group)."""
MAX_DEPTH = 16
"""The deepest nesting of Thrift structs and lists a footer may have (Parquet's own is 5)."""
BYTE_ARRAY = 6
REQUIRED, OPTIONAL, REPEATED = 0, 1, 2
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

Struct = dict[int, Any]


class _Damaged(Exception):
    """The footer does not parse: ``str`` says where."""


class CompactReader:
    """A reader of the Thrift compact protocol over ``data``, every read bounded by its length.

    ``typed``: each struct field is ``(type, value)`` and each list ``(item type, items)``, what a
    writer needs to put the footer back (``tests/parquet_footer.py``); otherwise the values alone."""

    def __init__(self, data: bytes, *, typed: bool = False) -> None:
        self.data, self.pos, self.typed = data, 0, typed

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Damaged(f"ends inside a value at byte {self.pos}")
        value = self.data[self.pos]
        self.pos += 1
        return value

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 63:
                raise _Damaged(f"an integer longer than 64 bits at byte {self.pos}")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _Damaged(f"a value of {n} bytes at byte {self.pos}, past the footer's end")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def value(self, kind: int, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _Damaged(f"values nested deeper than {MAX_DEPTH} at byte {self.pos}")
        if kind in (_TRUE, _FALSE):
            return kind == _TRUE
        if kind == _BYTE:
            return self.byte()
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _DOUBLE:
            return struct.unpack("<d", self.take(8))[0]
        if kind == _BINARY:
            return self.take(self.varint())
        if kind in (_LIST, _SET):
            head = self.byte()
            size, inner = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            if size > len(self.data) - self.pos:  # every item takes a byte at least
                raise _Damaged(f"a list of {size} items at byte {self.pos}, more than the footer holds")
            if inner in (_TRUE, _FALSE):
                items = [self.byte() == 1 for _ in range(size)]
            else:
                items = [self.value(inner, depth + 1) for _ in range(size)]
            return (inner, items) if self.typed else items
        if kind == _MAP:
            size = self.varint()
            if size > len(self.data) - self.pos:
                raise _Damaged(f"a map of {size} entries at byte {self.pos}, more than the footer holds")
            kinds = self.byte() if size else 0
            return [
                (self.value(kinds >> 4, depth + 1), self.value(kinds & 0x0F, depth + 1)) for _ in range(size)
            ]
        if kind == _STRUCT:
            return self.struct(depth + 1)
        raise _Damaged(f"a value of unknown Thrift type {kind} at byte {self.pos}")

    def struct(self, depth: int = 0) -> Struct:
        fields: Struct = {}
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, kind = head >> 4, head & 0x0F
            field = last + delta if delta else self.zigzag()
            value = self.value(kind, depth)
            fields[field] = (kind, value) if self.typed else value
            last = field


def read_footer(path: str | os.PathLike[str]) -> Struct | None:
    """The footer (``FileMetaData``, as field id → value) of Parquet file ``path``; ``None`` for a file
    that is not Parquet at all (too short, no magic, a footer length past the file), which pyarrow
    refuses with an exception of its own. ``LayoutError`` when the footer does not parse."""
    with open_regular(path) as handle:
        size = file_size(handle)
        if size < 12:
            return None
        handle.seek(size - 8)
        tail = handle.read(8)
        length = int.from_bytes(tail[:4], "little")
        if tail[4:] != MAGIC or not 0 < length <= min(size - 12, MAX_FOOTER_BYTES):
            return None
        handle.seek(size - 8 - length)
        data = handle.read(length)
    try:
        return CompactReader(data).struct()
    except _Damaged as err:
        raise LayoutError(f"{path}: damaged Parquet footer ({err})") from None


def _leaf_levels(schema: list[Any]) -> list[tuple[int, int, int | None]]:
    """``(max definition level, max repetition level, physical type)`` of each leaf column, in order."""
    leaves: list[tuple[int, int, int | None]] = []
    # Elements in depth-first order, each with its number of children: (children left, def, rep).
    stack: list[tuple[int, int, int]] = []
    for index, element in enumerate(schema):
        if not isinstance(element, dict):
            raise _Damaged(f"schema element {index} is not a struct")
        children = element.get(5, 0)
        repetition = element.get(3, REQUIRED) if index else REQUIRED
        if not isinstance(children, int) or not isinstance(repetition, int) or children < 0:
            raise _Damaged(f"schema element {index} is malformed")
        depth_def, depth_rep = (stack[-1][1], stack[-1][2]) if stack else (0, 0)
        level_def = depth_def + (repetition in (OPTIONAL, REPEATED))
        level_rep = depth_rep + (repetition == REPEATED)
        if stack:
            left, d, r = stack.pop()
            if left > 1:
                stack.append((left - 1, d, r))
        if children:
            stack.append((children, level_def, level_rep))
        elif index:
            kind = element.get(1)
            leaves.append((level_def, level_rep, kind if isinstance(kind, int) else None))
    return leaves


def check_footer(path: str | os.PathLike[str]) -> None:
    """``LayoutError`` naming ``path`` for a footer pyarrow would abort on: one that does not parse,
    or a column chunk whose size statistics do not fit its column (level histograms of another
    length than the column's levels + 1, unencoded byte-array bytes on a column of another type)."""
    meta = read_footer(path)
    if meta is None:
        return
    try:
        schema = meta.get(2)
        groups = meta.get(4, [])
        if not isinstance(schema, list) or not isinstance(groups, list):
            raise _Damaged("no schema or row groups")
        leaves = _leaf_levels(schema)
        for g, group in enumerate(groups):
            chunks = group.get(1, []) if isinstance(group, dict) else None
            if not isinstance(chunks, list) or len(chunks) != len(leaves):
                raise _Damaged(f"row group {g} has {_count(chunks)} column chunks for {len(leaves)} columns")
            for c, chunk in enumerate(chunks):
                column = chunk.get(3) if isinstance(chunk, dict) else None
                stats = column.get(16) if isinstance(column, dict) else None
                if stats is not None:
                    _check_size_statistics(stats, leaves[c], f"row group {g} column {c}")
    except _Damaged as err:
        raise LayoutError(f"{path}: damaged Parquet footer ({err})") from None


def _count(value: Any) -> str:
    return str(len(value)) if isinstance(value, list) else "no list of"


def _check_size_statistics(stats: Any, leaf: tuple[int, int, int | None], where: str) -> None:
    if not isinstance(stats, dict):
        raise _Damaged(f"{where}: size statistics that are not a struct")
    max_def, max_rep, kind = leaf
    for field, name, level in ((2, "repetition", max_rep), (3, "definition", max_def)):
        histogram = stats.get(field, [])
        if not isinstance(histogram, list):
            raise _Damaged(f"{where}: a {name} level histogram that is not a list")
        if histogram and len(histogram) != level + 1:
            raise _Damaged(
                f"{where}: a {name} level histogram of {len(histogram)} entries; expected {level + 1}"
            )
    if 1 in stats and kind != BYTE_ARRAY:
        raise _Damaged(f"{where}: unencoded byte-array bytes on a column that is not a byte array")
