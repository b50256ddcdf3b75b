"""The run layout (DESIGN §7): one Parquet row per (step, sample), described by a versioned schema.

The schema lives in ``harness/schemas/run_layout.v<N>.json``, shipped in the package, so that any
reader (pyarrow, DuckDB, Polars, Ray Data, Spark) can learn the columns without the harness. Every
file the writer makes carries the version in its key-value metadata (``rrh.run_layout``); a
reader refuses a version it does not know.

Routes are binary blobs: the C-order bytes of ``[rows, num_layers, top_k]`` ids in the narrowest
unsigned dtype that holds ``num_experts`` (``harness.trace.storage_dtype``), little-endian, with
their row count in a column beside them. A whole record batch's blobs are one contiguous buffer
in Arrow, so ``route_buffer`` hands the kernels the routes of every sample of a batch without a
copy.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import HarnessError
from harness.trace import LayerAxis, storage_dtype

FORMAT = "rrh-run-layout"
VERSION = 3
"""The newest layout version this harness writes; it reads every version listed in ``KNOWN``.

Version 2 (the tap, ``harness.audit.tap.trainer``) adds the trainer ``forward``, each attempt's own
engine payload (``attempt_routes``/``attempt_rows``) and shard rows (``shard``, ``shards``,
``positions``); version 3 adds where an importer read each sample (``origin``, ``origin_column``).
A file of an older version reads as a newest one with the columns it lacks null."""
KNOWN = (1, 2, 3)
METADATA_KEY = b"rrh.run_layout"
FILE_SUFFIX = ".parquet"

ROUTE_COLUMNS = ("engine", "trainer", "recorded")
"""The three route blobs a row may carry: ``<name>_routes`` with ``<name>_rows`` beside it."""

REPLAY_MODES = ("none", "R2", "R3")
FORWARDS = ("old_logprob", "reference", "update", "recompute")
"""The trainer forwards a tap records: old log-probs, reference log-probs, the update, activation
recompute."""
ATTEMPT_KINDS = ("start", "resume", "turn")
MAX_SHARDS = 1 << 16
"""The most shards (CP × SP ranks) one sample may be split into: larger than any real parallel group,
small enough that a count a damaged file declares bounds the work of checking its shards."""


def shown(text: str | os.PathLike[str]) -> str:
    """``text`` (a path, a message quoting one) safe to print on one line of a terminal: control
    characters (a newline, a carriage return, an escape sequence) shown as ``\\n``, ``\\r``,
    ``\\x1b``, and bytes of a name that are not UTF-8 (``os.fsdecode``'s surrogates) as ``\\xff``."""
    value = os.fspath(text)
    out = []
    for ch in value:
        code = ord(ch)
        if ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, as surrogateescape keeps it
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


class LayoutError(HarnessError, ValueError):
    """A run-layout file or record is malformed; the message names file, column and row.

    The message is one line whatever it quotes from a file (a name holding a newline, say), and safe
    to print: control characters and bytes that are not UTF-8 in it are shown escaped (``shown``)."""

    def __str__(self) -> str:
        return shown(super().__str__())


@cache
def schema_document(version: int = VERSION) -> dict[str, Any]:
    """The JSON schema document of layout ``version`` (``LayoutError`` for a version not shipped)."""
    if version not in KNOWN:
        raise LayoutError(f"rrh.run_layout: version {version}; expected one of {list(KNOWN)}")
    text = resources.files("harness").joinpath("schemas").joinpath(f"run_layout.v{version}.json").read_text()
    doc: dict[str, Any] = json.loads(text)
    return doc


def _arrow_type(name: str) -> Any:
    import pyarrow as pa

    scalars = {
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float32": pa.float32(),
        "bool": pa.bool_(),
        "string": pa.string(),
        "binary": pa.large_binary(),
    }
    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(scalars[name[5:-1]])
    return scalars[name]


@cache
def arrow_schema(version: int = VERSION) -> Any:
    """The ``pyarrow.Schema`` of layout ``version``, its version in the schema metadata."""
    import pyarrow as pa

    doc = schema_document(version)
    fields = [pa.field(c["name"], _arrow_type(c["type"]), nullable=c["nullable"]) for c in doc["columns"]]
    return pa.schema(fields, metadata={METADATA_KEY: str(version).encode()})


def column_names(version: int = VERSION) -> tuple[str, ...]:
    return tuple(c["name"] for c in schema_document(version)["columns"])


def encode_routes(routes: npt.NDArray[np.integer[Any]], num_experts: int, column: str) -> bytes:
    """The blob of ``routes [rows, layers, top_k]``: ids cast to the stored dtype, refused if they do not fit.

    A route id outside ``[0, 2**bits)`` of the stored dtype would wrap: refused here, naming the
    column, because a wrapped id is a different expert (verl #7407), never a representation.
    """
    array = np.asarray(routes)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise LayoutError(
            f"{column}: expected an integer array [rows, layers, top_k], got {array.dtype} {array.shape}"
        )
    dtype = storage_dtype(num_experts)
    if array.size and (int(array.min()) < 0 or int(array.max()) > np.iinfo(dtype).max):
        raise LayoutError(
            f"{column}: ids in [{int(array.min())}, {int(array.max())}] do not fit {dtype} "
            f"(num_experts={num_experts}); expected ids in [0, {np.iinfo(dtype).max}]"
        )
    return np.ascontiguousarray(array, dtype=dtype.newbyteorder("<")).tobytes()


@dataclass
class SampleRecord:
    """One (step, sample) of a run, as the writer takes it; lists are any 1-D array-likes.

    Routes are ``[rows, num_layers, top_k]`` integer arrays on the layer axis ``layer_axis``; the
    writer stores them in the narrowest dtype. ``engine_captured`` marks rows whose route the
    engine really returned (``False`` where the dump held filler); ``None`` means every row.
    """

    step: int
    sample_key: str
    prompt_len: int
    response_len: int
    tokens: Any
    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: Any
    source: str
    group_key: str | None = None
    rank: int = 0
    layer_axis: str = LayerAxis.DECODER.value
    routes_start: int = 0
    trainer_tokens: Any = None
    loss_mask: Any = None
    engine_logprobs: Any = None
    trainer_logprobs: Any = None
    engine_routes: Any = None
    engine_captured: Any = None
    trainer_routes: Any = None
    recorded_routes: Any = None
    replay: str | None = None
    attempt_ends: Any = None
    attempt_kinds: Any = None
    weight_versions: Any = None
    forward: str | None = None
    attempt_routes: Any = None
    """Each attempt's own engine payload, a list of ``[rows_j, num_layers, top_k]`` arrays (layout v2)."""
    shard: int | None = None
    shards: int | None = None
    positions: Any = None
    """A shard row's route row of each row of ``trainer_routes`` (layout v2)."""
    origin: str | None = None
    """Where an importer read the sample: the framework's own file and the sample's index in it
    (layout v3); ``None`` where the layout file itself is the place."""
    origin_column: int | None = None
    """The column of route row 0 on the origin file's padded token axis (layout v3), if it has one."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        """The record as a dict of Arrow-ready values (blobs encoded, lists as Python lists)."""
        if self.replay is not None and self.replay not in REPLAY_MODES:
            raise LayoutError(f"replay: expected one of {list(REPLAY_MODES)} or None, got {self.replay!r}")
        if self.layer_axis not in {a.value for a in LayerAxis}:
            raise LayoutError(
                f"layer_axis: expected one of {[a.value for a in LayerAxis]}, got {self.layer_axis!r}"
            )
        if not 1 <= int(self.num_experts) <= 65536:
            raise LayoutError(f"num_experts: expected an integer in [1, 65536], got {self.num_experts!r}")
        row: dict[str, Any] = {
            "step": int(self.step),
            "sample_key": str(self.sample_key),
            "group_key": None if self.group_key is None else str(self.group_key),
            "rank": int(self.rank),
            "prompt_len": int(self.prompt_len),
            "response_len": int(self.response_len),
            "num_experts": int(self.num_experts),
            "top_k": int(self.top_k),
            "layer_axis": self.layer_axis,
            "num_layers": int(self.num_layers),
            "moe_layers": [int(x) for x in self.moe_layers],
            "routes_start": int(self.routes_start),
            "replay": self.replay,
            "source": self.source,
        }
        for name in ("tokens", "trainer_tokens", "attempt_ends", "weight_versions"):
            value = getattr(self, name)
            row[name] = None if value is None else np.asarray(value).astype(np.int64).tolist()
        for name in ("engine_logprobs", "trainer_logprobs"):
            value = getattr(self, name)
            row[name] = None if value is None else np.asarray(value, dtype=np.float32).tolist()
        for name in ("loss_mask", "engine_captured"):
            value = getattr(self, name)
            row[name] = None if value is None else np.asarray(value, dtype=bool).tolist()
        if self.attempt_kinds is not None:
            kinds = [str(k) for k in self.attempt_kinds]
            bad = [k for k in kinds if k not in ATTEMPT_KINDS]
            if bad:
                raise LayoutError(f"attempt_kinds: expected each of {list(ATTEMPT_KINDS)}, got {bad[0]!r}")
            row["attempt_kinds"] = kinds
        else:
            row["attempt_kinds"] = None
        for name in ROUTE_COLUMNS:
            routes = getattr(self, f"{name}_routes")
            if routes is None:
                row[f"{name}_routes"] = row[f"{name}_rows"] = None
                continue
            array = np.asarray(routes)
            if array.ndim != 3 or array.shape[1:] != (self.num_layers, self.top_k):
                raise LayoutError(
                    f"{name}_routes: shape {array.shape}; expected [rows, num_layers={self.num_layers}, "
                    f"top_k={self.top_k}]"
                )
            row[f"{name}_routes"] = encode_routes(array, int(self.num_experts), f"{name}_routes")
            row[f"{name}_rows"] = int(array.shape[0])
        self._v2_columns(row)
        # A place names a file: one whose name is not UTF-8 is stored with those bytes escaped.
        row["origin"] = None if self.origin is None else shown(str(self.origin))
        row["origin_column"] = None if self.origin_column is None else int(self.origin_column)
        return row

    def _v2_columns(self, row: dict[str, Any]) -> None:
        """The layout-v2 columns of ``row``: forward, attempt payloads, shard."""
        if self.forward is not None and self.forward not in FORWARDS:
            raise LayoutError(f"forward: expected one of {list(FORWARDS)} or None, got {self.forward!r}")
        row["forward"] = self.forward
        if self.attempt_routes is None:
            row["attempt_routes"] = row["attempt_rows"] = None
        else:
            payloads = [np.asarray(a) for a in self.attempt_routes]
            for j, array in enumerate(payloads):
                if array.ndim != 3 or array.shape[1:] != (self.num_layers, self.top_k):
                    raise LayoutError(
                        f"attempt_routes[{j}]: shape {array.shape}; expected [rows, "
                        f"num_layers={self.num_layers}, "
                        f"top_k={self.top_k}]"
                    )
            joined = (
                np.concatenate(payloads) if payloads else np.zeros((0, self.num_layers, self.top_k), np.int64)
            )
            row["attempt_routes"] = encode_routes(joined, int(self.num_experts), "attempt_routes")
            row["attempt_rows"] = [int(a.shape[0]) for a in payloads]
        sharded = (self.shard is not None, self.shards is not None, self.positions is not None)
        if any(sharded) and not all(sharded):
            raise LayoutError(
                "shard, shards, positions: a shard row needs all three (shard index, shard count, the "
                f"positions of its trainer rows); got shard={self.shard!r} shards={self.shards!r} "
                f"positions={'None' if self.positions is None else 'given'}"
            )
        row["shard"] = None if self.shard is None else int(self.shard)
        row["shards"] = None if self.shards is None else int(self.shards)
        row["positions"] = (
            None if self.positions is None else np.asarray(self.positions).astype(np.int64).tolist()
        )
        if all(sharded):
            if not 0 <= int(self.shard) < int(self.shards):  # type: ignore[arg-type]
                raise LayoutError(f"shard: expected an index in [0, shards={self.shards}), got {self.shard}")
            rows = row["trainer_rows"]
            if rows is not None and rows != len(row["positions"]):
                raise LayoutError(
                    f"positions: {len(row['positions'])} entries; expected one per trainer_routes row "
                    f"({rows})"
                )
