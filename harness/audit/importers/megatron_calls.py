"""A Megatron-LM router trace file read call by call: each record validated, its ids checked.

One line of ``router_trace_rank{rank}.jsonl`` is one router call (``harness.audit.importers.megatron_lm``
says what Megatron-LM writes); ``read_calls`` yields them as ``RouterCall``, a record that is not of this
format being one ``LayoutError`` naming the file and line, and ``call_ids`` gives a call's
``top_indices`` as integer ids, or names the first one that is not an id.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout.inputs import brief, lines, parse_json
from harness.audit.layout.schema import LayoutError


@dataclass
class RouterCall:
    """One record of a rank's trace: one router call of one layer.

    ``rows`` is its ``top_indices``: an int32 array ``[num_tokens, k]`` as soon as it is one (a step of a
    rank is held this compactly, not as JSON lists), else the list as read, for the rules to name."""

    step: int
    block: str
    layer: int
    rank: int
    topk: int
    num_tokens: int
    rows: npt.NDArray[Any] | list[Any]
    where: str


def _field(record: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = record.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise LayoutError(f"{where}: field {name!r} is {brief(value)}; expected a {kind.__name__}")
    return value


def read_calls(file: Path) -> Iterator[RouterCall]:
    """Each record of ``file``; a line that is not a record of this format is one ``LayoutError``."""
    # A regular UTF-8 file, read line by line; JSON nested too deep or huge integers are one error.
    for line_no, line in lines(file):
        call = parse_call(line, f"{file}:{line_no}")
        if call is not None:
            yield call


def parse_call(line: str, where: str) -> RouterCall | None:
    """One line of a trace file as a ``RouterCall`` (``None``: a blank line); a line that is not a
    record of this format is one ``LayoutError`` naming ``where`` (``file:line``)."""
    if not line.strip():
        return None
    record = parse_json(line, where)
    if not isinstance(record, dict):
        raise LayoutError(f"{where}: a JSON {type(record).__name__}; expected a record object")
    block = _field(record, "block", str, where)
    if block == "mtp":
        block = f"mtp{_field(record, 'mtp_idx', int, where)}"
    elif block != "decoder":
        raise LayoutError(f"{where}: field 'block' is {brief(block)}; expected 'decoder' or 'mtp'")
    return RouterCall(
        step=_field(record, "step", int, where),
        block=block,
        layer=_field(record, "layer", int, where),
        rank=_field(record, "rank", int, where),
        topk=_field(record, "topk", int, where),
        num_tokens=_field(record, "num_tokens", int, where),
        rows=_compact(_field(record, "top_indices", list, where)),
        where=where,
    )


def _compact(rows: list[Any]) -> npt.NDArray[Any] | list[Any]:
    """``rows`` as an array when they are a rectangle of integers (int32 when they fit: what
    megatron-core writes), else as read (ragged rows, non-integers: the rules name the first)."""
    try:
        array = np.asarray(rows)
    except (ValueError, OverflowError):  # ragged rows
        return rows
    if array.dtype.kind == "O" or array.ndim != 2:
        return rows
    if array.dtype.kind in "iu" and (not array.size or (array.min() >= -(2**31) and array.max() < 2**31)):
        return array.astype(np.int32)
    return array


def call_ids(call: RouterCall) -> npt.NDArray[np.integer[Any]]:
    """``top_indices`` as ``[num_tokens, topk]`` integers (rows already of length ``topk``).

    Rows ``_compact`` left as lists (of the right length, yet no integer rectangle) are ragged below
    the row (``[[0, 1], [2, [3]]]``), or hold lists, ``None`` or integers past 64 bits where an id
    belongs: the first such id is one ``LayoutError`` naming the record and the row (numpy's
    ``ValueError``, or a 3-d array passed off as ids, otherwise)."""
    if isinstance(call.rows, list):
        for row, ids in enumerate(call.rows):
            bad = next((i for i in ids if not _is_id(i)), _NO_ID) if isinstance(ids, list) else ids
            if bad is not _NO_ID:
                raise LayoutError(
                    f"{call.where}: field 'top_indices' row {row} holds {brief(bad)} where an id belongs; "
                    f"expected [num_tokens, topk] integer ids (a list of {call.topk}-id lists)"
                )
        array = np.asarray(call.rows, dtype=np.int64)  # [num_tokens, topk]: every row topk ids
    else:
        array = call.rows
    if array.size and array.dtype.kind not in "iu":
        raise LayoutError(
            f"{call.where}: field 'top_indices' holds {array.dtype} values; expected integer ids"
        )
    if not array.size:
        return np.zeros((0, call.topk), dtype=np.int32)
    return array


_NO_ID = object()
"""``call_ids``' marker: every id of a row is one."""


def _is_id(value: Any) -> bool:
    """Whether ``value`` (an item of a ``top_indices`` row) is an expert id numpy holds as int64."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
