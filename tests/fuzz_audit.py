"""The fuzz harness of ``rrh audit``: damaged and hostile files of every format it reads.

Each input is a small dump of one format — SkyRL, verl, slime, NeMo-RL, the run layout, a tapped
run's manifests — of three steps in three files, one of which is damaged or hostile (bytes flipped,
cut or inserted; a declared size far beyond the data; an object array shorter than its shape; a
pickle that calls a global; a zip record compressed, encrypted or with a bad CRC; JSON nested past
the recursion limit; a FIFO, a directory, a symlink to ``/dev/zero``; a row group declaring 2**40
rows …). ``rrh audit`` runs on it in a child process forked from a warm server (the harness
imported once), under an address-space cap, with a wall-clock limit, and the harness checks:

- it ended by itself with 0, 1 or 2 (no signal, no traceback, nothing past the limit);
- what it printed on stderr is one line per message, and an exit 2 names the damaged file;
- no MemoryError (the cap turns a bomb into one) and no time budget ran out;
- the intact files were audited: each of their steps is in the JSON report with its samples.

Inputs are seeded: input ``i`` of seed ``s`` is the same on every machine. ``python -m
tests.fuzz_audit --count N --seed S`` runs N of them and prints the counts; the tests run a few
(``RRH_FUZZ_INPUTS`` more, and the ``slow`` test more still).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("skyrl", "verl", "slime", "nemo_rl", "layout", "manifest")
MEMORY_MARGIN = 2 << 30
"""Address space an audit may add to the server's: the done criterion's 2 GB."""
TIME_LIMIT = 60.0
"""Seconds an audit may run before it is killed (and counted)."""
FILE_SECONDS = "20"
"""``RRH_FILE_SECONDS`` in the child: a file still being read after 20 s is an error (counted too)."""

E, K, LAYERS, MOE_SPEC = 16, 2, 4, "1-3"


# --- a pickler that names framework globals and writes raw opcodes ------------------------------------


class Raw:
    """Opcodes written into a pickle as they are (each snippet pushes one object)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Raw):  # outside any frame: what it declares is checked against the file
            self.framer.commit_frame(force=True)
            self.framer.file_write(obj.data)
            return
        super().save(obj, save_persistent_id)

    def save_global(self, obj: Any, name: Any = None) -> None:
        spec = getattr(obj, "rrh_global", None) if isinstance(obj, type) or callable(obj) else None
        if spec is None:
            super().save_global(obj, name)
            return
        self.write(pickle.GLOBAL + f"{spec[0]}\n{spec[1]}\n".encode())
        self.memoize(obj)

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, type) or callable(obj)) and "rrh_global" in getattr(obj, "__dict__", {}):
            return obj.__name__
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=4).dump(obj)
    return buffer.getvalue()


def _named(module: str, name: str, obj: Any) -> Any:
    obj.rrh_global = (module, name)
    return obj


class _Call:
    def __init__(self, func: Any, *args: Any, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _reconstruct() -> Any:
    from numpy._core.multiarray import _reconstruct as reconstruct

    return reconstruct


def fake_array(shape: Any, dtype: Any, data: Any, version: int = 1) -> _Call:
    """What ``numpy.ndarray.__reduce__`` writes, with any state: an array that is not one."""
    return _Call(_reconstruct(), np.ndarray, (0,), b"b", state=(version, shape, dtype, False, data))


def _planted(*args: Any) -> None:
    """Pickled under the name of ``os.system`` and friends: what a hostile pickle would call."""


def hostile_values(rng: random.Random) -> list[Any]:
    """Values a pickle can hold that a reader must refuse (or read) without crashing or allocating."""
    lst = list(range(200))
    return [
        fake_array((rng.choice([200, 5000, 2**20]),), np.dtype("O"), ["a", "b", "c"]),  # the segfault
        fake_array((2**32, 2**32), np.dtype("i8"), b""),
        fake_array((2**40,), np.dtype("u1"), b"\0" * 8),
        fake_array((3,), np.dtype("i8"), b"\0" * 24 + b"x"),
        fake_array((2,), "i8", b"\0" * 16),
        fake_array([2], np.dtype("i8"), b"\0" * 16),
        fake_array((2,), np.dtype([("a", "i4"), ("b", "O")]), b"\0" * 24),
        fake_array((-1,), np.dtype("i8"), b""),
        fake_array((1,) * 40, np.dtype("i8"), b"\0" * 8),
        _Call(np.ndarray, (10**12,), "i8", b"12345678", 0, (0,)),  # a view of 8 bytes, 10**12 long
        _Call(np.ndarray, (2**33,), "u1"),  # an uninitialised 8 GiB
        Raw(b"\x8e" + struct.pack("<Q", 2**40)),  # BINBYTES8 of 1 TiB: the rest of the file
        Raw(b"\x96" + struct.pack("<Q", 2**40)),  # BYTEARRAY8
        Raw(b"\x95" + struct.pack("<Q", 2**40)),  # FRAME
        Raw(b"N" + b"r" + struct.pack("<I", 2**32 - 1)),  # LONG_BINPUT at 2**32 − 1: a memo of 32 GiB
        Raw(b"]" * 100_000 + b"a" * 99_999),  # lists nested 100,000 deep
        {k * (2**61 - 1): 0 for k in range(1, 3000)},  # keys of one hash
        {k * (2**61 - 1) for k in range(1, 3000)},
        [lst] * 100_000,  # one list a hundred thousand times: 8 bytes each in the file
        [(0, 2)] * 100_000,
        np.dtype("O"),
        np.float64("nan"),
        np.arange(6).reshape(2, 3),
        np.zeros((2, 3), dtype=np.int64).T,
        np.array(["x", "y"], dtype=object),
        2**70,
        -1,
        10**4000,
        float("inf"),
        "x" * 100_000,
        b"\xff" * 17,
        None,
        True,
        {"format": "torch", "data": b"PK\x05\x06" + b"\0" * 18},
        {"format": "numpy", "data": b"", "shape": (2**32, 2**32), "dtype": "int64"},
        {"format": "numpy", "data": b"\0" * 16, "shape": (2,), "dtype": "object"},
        {"format": "numpy", "data": b"\0" * 16, "shape": (2,), "dtype": "(2,)i8"},
        {"format": "numpy", "data": b"\0" * 16, "shape": (True, 2), "dtype": "i8"},
        _Call(_named("os", "system", _planted), "touch /tmp/rrh-fuzz-ran"),
        _Call(_named("builtins", "eval", _planted), "1+1"),
    ]


# --- base dumps ------------------------------------------------------------------------------------------


@dataclass
class Base:
    """A valid dump of three steps: its root, the files a mutation may damage (→ their step), the
    samples of each step, and the audit's arguments."""

    root: Path
    target: str
    """The path given to ``rrh audit``, relative to the root."""
    files: dict[str, int]
    samples: dict[int, int]
    args: list[str]
    kind: dict[str, str] = field(default_factory=dict)
    """Each file's kind: ``pickle``, ``torch``, ``json``, ``jsonl``, ``parquet``."""


def _rollout(step: int) -> list[Any]:
    from tests.test_audit_import_frameworks import rollout

    return rollout(step)


def _skyrl_state(step: int) -> dict[str, Any]:
    from tests.test_audit_import_frameworks import _skyrl_fields, _skyrl_metadata

    samples = _rollout(step)
    fields = _skyrl_fields(samples, None)
    return {
        "batch_dict": {
            k: {"format": "numpy", "data": v.tobytes(), "shape": v.shape, "dtype": str(v.dtype)}
            for k, v in fields.items()
        },
        "batch_size": len(samples) + 1,
        "metadata": _skyrl_metadata(samples) | {"response_length": fields["response_mask"].shape[1]},
    }


class _Batch:
    pass


def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
    raise AssertionError("never called")


_named("skyrl.backends.skyrl_train.training_batch", "TrainingInputBatch", _Batch)
_named("skyrl.backends.skyrl_train.training_batch", "_rebuild_tensor_batch", _rebuild_tensor_batch)


def skyrl_pickle(state: Any) -> bytes:
    return dumps(_Call(_rebuild_tensor_batch, _Batch, state))


def build_skyrl(root: Path) -> Base:
    folder = root / "dumped_data"
    folder.mkdir(parents=True)
    files = {}
    for step in (1, 2, 3):
        name = f"dumped_data/global_step_{step}_training_input.pkl"
        (root / name).write_bytes(skyrl_pickle(_skyrl_state(step)))
        files[name] = step
    args = ["--from", "skyrl", "--num-experts", str(E), "--moe-layers", MOE_SPEC]
    return Base(root, ".", files, dict.fromkeys((1, 2, 3), 4), args, dict.fromkeys(files, "pickle"))


class _DataProto:
    def __init__(self, state: Any) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, ...]:
        return (_DataProto, (), self.state)


_named("verl.protocol", "DataProto", _DataProto)


def _verl_state(step: int, numpy_batch: bool) -> tuple[Any, Any, Any]:
    from tests.test_audit_import_frameworks import _consolidated, _verl_fields
    from tests.test_audit_safe_pickle import torch_bytes

    samples = _rollout(step)
    fields = _verl_fields(samples)
    batch: Any
    if numpy_batch:
        batch = (
            (len(samples),),
            None,
            {k: (str(v.dtype), tuple(v.shape), v.tobytes()) for k, v in fields.items()},
        )
    else:
        batch = torch_bytes(_consolidated(fields))
    non_tensor = {"uid": np.array([f"uid-{s.group}" for s in samples], dtype=object)}
    return batch, non_tensor, {"timing": {"t": np.float64(0.5)}}


def verl_pickle(state: Any) -> bytes:
    return dumps(_DataProto(state))


VERL_DIR = "exp_proj/GBS2_N2_in8_out9"


def build_verl(root: Path) -> Base:
    files, kinds = {}, {}
    for step in (1, 2, 3):
        folder = root / VERL_DIR / str(step)
        folder.mkdir(parents=True)
        (folder / "gen_batch.dp").write_bytes(verl_pickle(_verl_state(step, numpy_batch=step == 2)))
        (folder / "meta.json").write_text(json.dumps({"global_steps": step}))
        files[f"{VERL_DIR}/{step}/gen_batch.dp"] = step
        files[f"{VERL_DIR}/{step}/meta.json"] = step
        kinds[f"{VERL_DIR}/{step}/gen_batch.dp"] = "pickle"
        kinds[f"{VERL_DIR}/{step}/meta.json"] = "json"
    args = ["--from", "verl", "--num-experts", str(E), "--moe-layers", MOE_SPEC]
    return Base(root, VERL_DIR, files, dict.fromkeys((1, 2, 3), 4), args, kinds)


def slime_payloads(step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    from tests.test_audit_import_sources import _slime_sample, _train_payload

    rng = np.random.default_rng(step)
    samples = [
        _slime_sample(rng, i, p, r, step == 2) for i, (p, r) in enumerate(((5, 4), (6, 3), (4, 5), (7, 2)))
    ]
    return {"rollout_id": step, "samples": samples}, _train_payload(step, samples)


def torch_save(obj: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def build_slime(root: Path) -> Base:
    (root / "rollout_data").mkdir(parents=True)
    (root / "train_data").mkdir()
    files = {}
    for step in (0, 1, 2):
        rollout, train = slime_payloads(step)
        (root / f"rollout_data/{step}.pt").write_bytes(torch_save(rollout))
        (root / f"train_data/{step}.pt").write_bytes(torch_save(train))
        files[f"rollout_data/{step}.pt"] = files[f"train_data/{step}.pt"] = step
    args = ["--from", "slime", "--num-experts", "8", "--moe-layers", "1-3"]
    return Base(root, ".", files, dict.fromkeys((0, 1, 2), 4), args, dict.fromkeys(files, "torch"))


def nemo_lines(step: int) -> list[dict[str, Any]]:
    from tests.test_audit_import_sources import _nemo_line

    rng = np.random.default_rng(step)
    lengths = ((5, 4), (6, 3), (4, 5), (7, 2))
    width = max(p + r for p, r in lengths)
    return [_nemo_line(rng, i, p, r, width) for i, (p, r) in enumerate(lengths)]


def build_nemo(root: Path) -> Base:
    root.mkdir(parents=True)
    files = {}
    for step in (1, 2, 3):
        name = f"train_data_step{step}.jsonl"
        (root / name).write_text("".join(json.dumps(x) + "\n" for x in nemo_lines(step)))
        files[name] = step
    return Base(
        root, ".", files, dict.fromkeys((1, 2, 3), 4), ["--from", "nemo_rl"], dict.fromkeys(files, "jsonl")
    )


def build_layout(root: Path) -> Base:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from harness.audit.layout.writer import write_table
    from harness.audit.synthetic.generate import RunShape, generate_run

    shape = RunShape(
        steps=3, prompts=2, group_size=2, prompt_len=5, response_len=6, layers=4, experts=16, top_k=2
    )
    with tempfile.TemporaryDirectory() as generated:
        generate_run(generated, shape, seed=0)
        table = pa.concat_tables(pq.read_table(p) for p in sorted(Path(generated).rglob("*.parquet")))
    root.mkdir(parents=True)
    files: dict[str, int] = {}
    samples: dict[int, int] = {}
    for step in sorted(set(table.column("step").to_pylist())):
        rows = table.filter(pc.equal(table.column("step"), step))
        name = f"part-r00000-{step:06d}.parquet"
        write_table(root / name, rows, 10_000, row_group_bytes=1_500)  # a few rows per row group
        files[name] = step
        samples[step] = rows.num_rows
    return Base(root, ".", files, samples, [], dict.fromkeys(files, "parquet"))


def build_manifest(root: Path) -> Base:
    from harness.audit.tap.manifest import write_manifest

    base = build_layout(root)
    names = sorted(base.files)
    write_manifest(root, rank=0, world_size=2, files=names[:2], last_step=1, closed=True)
    write_manifest(root, rank=1, world_size=2, files=names[2:], last_step=2, closed=True)
    files = {"_tap/rank-00000.json": -1, "_tap/rank-00001.json": -1}
    return Base(root, ".", files, base.samples, [], dict.fromkeys(files, "json"))


BUILDERS: dict[str, Callable[[Path], Base]] = {
    "skyrl": build_skyrl, "verl": build_verl, "slime": build_slime, "nemo_rl": build_nemo,
    "layout": build_layout, "manifest": build_manifest,
}  # fmt: skip


# --- mutations -------------------------------------------------------------------------------------------


def _bytes_mutation(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["flip", "flip", "cut", "insert", "zero", "dup", "random", "empty"])
    raw = bytearray(data)
    if kind == "flip" and raw:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif kind == "cut" and raw:
        del raw[rng.randrange(len(raw)) :]
    elif kind == "insert":
        at = rng.randrange(len(raw) + 1)
        raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "zero" and raw:
        at = rng.randrange(len(raw))
        raw[at : at + rng.randint(1, 256)] = bytes(min(256, len(raw) - at))
    elif kind == "dup" and raw:
        at = rng.randrange(len(raw))
        raw[at:at] = raw[at : at + rng.randint(1, 512)]
    elif kind == "random":
        raw = bytearray(rng.randbytes(rng.randint(1, 2048)))
    elif kind == "empty":
        raw = bytearray()
    return bytes(raw), f"bytes:{kind}"


def _filesystem(rng: random.Random, path: Path) -> str:
    kind = rng.choice(["fifo", "devzero", "directory", "dangling", "urandom"])
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "directory":
        path.mkdir()
        (path / "x").write_text("x")
    else:
        path.symlink_to(path.parent / "no-such-file")
    return f"fs:{kind}"


def _set_path(doc: Any, rng: random.Random, value: Any) -> str:
    """Replace a value at a random path of nested dicts and lists; the path as text."""
    path = []
    node = doc
    while True:
        keys = (
            list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []
        )
        if not keys:
            return "/".join(path)
        key = rng.choice(keys)
        child = node[key]
        if isinstance(child, (dict, list)) and child and rng.random() < 0.6:
            node = child
            path.append(str(key))
            continue
        node[key] = value
        path.append(str(key))
        return "/".join(path)


def _mutate_skyrl(rng: random.Random, step: int) -> tuple[bytes, str]:
    state: Any = _skyrl_state(step)
    value = rng.choice(hostile_values(rng))
    where = rng.choice(["field", "entry", "metadata", "state", "deep"])
    if where == "field":
        name = rng.choice(sorted(state["batch_dict"]))
        state["batch_dict"][name] = value
    elif where == "entry":
        name = rng.choice(sorted(state["batch_dict"]))
        key = rng.choice(["data", "shape", "dtype", "format"])
        state["batch_dict"][name][key] = value
        where = f"entry:{name}.{key}"
    elif where == "metadata":
        state["metadata"][rng.choice(["pad_size", "policy_prompt_boundaries", "other"])] = value
    elif where == "state":
        state = value
    else:
        where = "deep:" + _set_path(state, rng, value)
    return skyrl_pickle(state), f"skyrl:{where}"


def _mutate_verl(rng: random.Random, step: int) -> tuple[bytes, str]:
    batch, non_tensor, meta = _verl_state(step, numpy_batch=rng.random() < 0.5)
    value = rng.choice(hostile_values(rng))
    where = rng.choice(["uid", "non_tensor", "meta", "batch", "leaf", "state"])
    state: Any = (batch, non_tensor, meta)
    if where == "uid":
        non_tensor["uid"] = value
    elif where == "non_tensor":
        state = (batch, value, meta)
    elif where == "meta":
        state = (batch, non_tensor, value)
    elif where == "batch":
        state = (value, non_tensor, meta)
    elif where == "leaf" and isinstance(batch, tuple):
        key = rng.choice(sorted(batch[2]))
        entry = list(batch[2][key])
        entry[rng.randrange(3)] = value
        batch[2][key] = tuple(entry)
    else:
        state = value
    return verl_pickle(state), f"verl:{where}"


SLIME_VALUES: list[Any] = []


def _slime_values(rng: random.Random) -> list[Any]:
    import torch

    return [
        torch.zeros(1, dtype=torch.int64).expand(10**9),  # 8 bytes viewed a billion times
        torch.zeros((0, 10**6, 10**6)),
        torch.empty((3, 4), dtype=torch.float64).t(),
        torch.tensor([1, 2, 3]),
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor(2**40),
        torch.tensor(-5),
        torch.tensor(float("nan")),
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(3, dtype=torch.complex64),
        np.array([1, 2], dtype=object),
        np.array(["a", "b"]),
        [[1, 2], [3]],
        [1, "a", None],
        [2**70],
        "tokens",
        {"a": 1},
        *hostile_values(rng)[:12],
    ]


def _mutate_slime(rng: random.Random, step: int, train: bool) -> tuple[bytes, str]:
    rollout, trained = slime_payloads(step)
    payload = trained if train else rollout
    value = rng.choice(_slime_values(rng))
    where = rng.choice(["sample", "sample", "top", "deep"])
    if where == "sample":
        sample = rng.choice(payload["samples"])
        key = rng.choice([*sorted(sample), "rollout_routed_experts", "tokens", "response_length"])
        sample[key] = value
        where = f"sample.{key}"
    elif where == "top":
        key = rng.choice(["samples", "rollout_id", "format_version"])
        payload[key] = value
        where = f"top.{key}"
    else:
        where = "deep:" + _set_path(payload, rng, value)
    try:
        return torch_save(payload), f"slime:{where}"
    except Exception:  # a value torch.save cannot write: a plain pickle inside the archive instead
        return torch_save({"rollout_id": step, "samples": []}), f"slime:{where}:unsaveable"


def _central_entry(data: bytes, name: str) -> int:
    """The offset of the central directory entry of record ``name``."""
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        size = struct.unpack("<H", data[at + 28 : at + 30])[0]
        if data[at + 46 : at + 46 + size] == name.encode():
            return at
        at = data.find(b"PK\x01\x02", at + 4)
    raise ValueError(f"no central entry for {name}")


def _mutate_zip(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A torch archive with one record damaged at the zip level."""
    info = rng.choice(zipfile.ZipFile(io.BytesIO(data)).infolist())
    local, central = info.header_offset, _central_entry(data, info.filename)
    raw = bytearray(data)
    kind = rng.choice(["method", "encrypted", "crc", "size", "name", "directory", "data"])
    if kind == "method":
        method = rng.choice([8, 12, 14, 99])
        struct.pack_into("<H", raw, local + 8, method)
        struct.pack_into("<H", raw, central + 10, method)
    elif kind == "encrypted":
        struct.pack_into("<H", raw, local + 6, 1)
        struct.pack_into("<H", raw, central + 8, 1)
    elif kind == "crc":
        crc = rng.randrange(2**32)
        struct.pack_into("<I", raw, central + 16, crc)
        struct.pack_into("<I", raw, local + 14, crc)
    elif kind == "size":
        size = rng.choice([2**31, 2**32 - 1, 10**9, info.file_size + 1])
        struct.pack_into("<I", raw, central + 20, size)
        struct.pack_into("<I", raw, central + 24, size)
    elif kind == "name":
        raw[local + 30] ^= 0x20
    elif kind == "directory":
        end = data.rfind(b"PK\x05\x06")
        struct.pack_into("<I", raw, end + 12, rng.choice([2**31, 2**32 - 1, 1]))
    elif info.file_size:
        name_len, extra_len = struct.unpack("<HH", data[local + 26 : local + 30])
        raw[local + 30 + name_len + extra_len + rng.randrange(info.file_size)] ^= 0xFF
    return bytes(raw), f"zip:{kind}:{info.filename.rsplit('/', 1)[-1]}"


JSON_HOSTILE = [
    "[" * 100_000 + "]" * 100_000,
    "9" * 5_000,
    "1" + "0" * 400,
    "1e999",
    "-1",
    "true",
    "null",
    '"x"',
    "[]",
    "{}",
    "[[1, 2], [3]]",
    '{"a": ' * 2000 + "1" + "}" * 2000,
    "NaN",
]


def _mutate_json_doc(rng: random.Random, doc: Any) -> tuple[bytes, str]:
    marker = "@@HOSTILE@@"
    where = _set_path(doc, rng, marker)
    text = json.dumps(doc).replace(json.dumps(marker), rng.choice(JSON_HOSTILE), 1)
    return text.encode(), f"json:{where}"


def _mutate_jsonl(rng: random.Random, step: int) -> tuple[bytes, str]:
    lines = nemo_lines(step)
    kind = rng.choice(["value", "value", "line", "encoding", "giant"])
    texts = [json.dumps(x) for x in lines]
    i = rng.randrange(len(lines))
    if kind == "value":
        data, where = _mutate_json_doc(rng, lines[i])
        texts[i] = data.decode()
    elif kind == "line":
        texts[i] = rng.choice(JSON_HOSTILE)
        where = "line"
    elif kind == "encoding":
        raw = "\n".join(texts).encode()
        at = rng.randrange(len(raw))
        return raw[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\0"]) + raw[at:], "jsonl:encoding"
    else:
        texts[i] = json.dumps({**lines[i], "token_ids": [[1] * 200_000]})
        where = "giant"
    return ("\n".join(texts) + "\n").encode(), f"jsonl:{where}"


def _mutate_parquet(rng: random.Random, path: Path) -> str:
    from tests.parquet_footer import (
        FILE_NUM_ROWS,
        GROUP_BYTES,
        GROUP_NUM_ROWS,
        I64,
        META_COMPRESSED,
        META_DATA_PAGE_OFFSET,
        META_NUM_VALUES,
        META_UNCOMPRESSED,
        column_meta,
        read_footer,
        row_groups,
        write_footer,
    )  # fmt: skip

    kind = rng.choice(["footer", "footer", "column", "column", "data"])
    if kind == "footer":
        body, meta = read_footer(path.read_bytes())
        group = rng.choice(row_groups(meta))
        what = rng.choice(["rows", "file-rows", "values", "offset", "sizes", "bytes"])
        value = rng.choice([0, 1, 7, 2**31, 2**40, 2**62, -1])
        if what == "rows":
            group[GROUP_NUM_ROWS] = (I64, value)
            if rng.random() < 0.5:
                meta[FILE_NUM_ROWS] = (I64, value)
                for chunk in column_meta(group):
                    chunk[META_NUM_VALUES] = (I64, value)
        elif what == "file-rows":
            meta[FILE_NUM_ROWS] = (I64, value)
        elif what == "bytes":
            group[GROUP_BYTES] = (I64, value)
        else:
            chunk = rng.choice(column_meta(group))
            key = {"values": META_NUM_VALUES, "offset": META_DATA_PAGE_OFFSET}.get(
                what, rng.choice([META_COMPRESSED, META_UNCOMPRESSED])
            )
            chunk[key] = (chunk[key][0], value)
        path.write_bytes(write_footer(body, meta))
        return f"parquet:footer:{what}={value}"
    if kind == "data":
        data, what = _bytes_mutation(rng, path.read_bytes())
        path.write_bytes(data)
        return f"parquet:{what}"
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.audit.layout.writer import write_table

    table = pq.read_table(path)
    name = rng.choice(
        ["num_experts", "top_k", "num_layers", "routes_start", "prompt_len", "response_len", "tokens",
         "engine_rows", "moe_layers", "shard", "shards", "positions", "attempt_rows", "attempt_ends",
         "step", "rank", "layer_axis", "replay", "forward", "engine_captured", "trainer_rows"]
    )  # fmt: skip
    kind_of = table.schema.field(name).type
    n = table.num_rows
    if pa.types.is_list(kind_of) and pa.types.is_boolean(kind_of.value_type):
        choices = [None, [], [True], [False] * 50, [True, False] * 3]
    elif pa.types.is_list(kind_of) and pa.types.is_string(kind_of.value_type):
        choices = [None, [], ["x"], ["start", "zzz"]]
    elif pa.types.is_list(kind_of):
        choices = [None, [], [2**31 - 1], [-5, 3], list(range(50)), [0] * 3]
    elif pa.types.is_string(kind_of):
        choices = ["zzz", "", "R3", None]
    else:
        choices = [0, 1, -1, 2**31 - 1, 3, 65537, None]
    value = rng.choice(choices)
    row = rng.randrange(n)
    values = table.column(name).to_pylist()
    values[row] = value
    if rng.random() < 0.3:
        values = [value] * n
    try:
        array = pa.array(values, type=kind_of)
        table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), array)
        write_table(path, table, 10_000, row_group_bytes=1_500)
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):  # a null in a non-null column: written raw
        schema = pa.schema([f.with_nullable(True) for f in table.schema], metadata=table.schema.metadata)
        try:
            pq.write_table(pa.Table.from_pydict({**table.to_pydict(), name: values}, schema=schema), path)
        except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
            return f"parquet:column:{name}:unwritable"
    return f"parquet:column:{name}={str(value)[:20]}@{row}"


def _mutate_manifest(rng: random.Random, path: Path) -> str:
    doc = json.loads(path.read_text())
    kind = rng.choice(["field", "field", "world", "files", "json"])
    if kind == "world":
        doc["world_size"] = rng.choice([10**7, 10**18, 0, -1, 2**70])
    elif kind == "files":
        doc["files"] = rng.choice([["../../etc/passwd"], ["/etc/passwd"], [5], "x", ["\0"], [["a"]], []])
    elif kind == "json":
        data, where = _mutate_json_doc(rng, doc)
        path.write_bytes(data)
        return f"manifest:{where}"
    else:
        doc[rng.choice(["rank", "world_size", "files", "closed", "format", "version", "last_step"])] = (
            rng.choice([None, True, -1, 10**7, "x", [], {}, 2**70, 1.5])
        )
    path.write_text(json.dumps(doc))
    return f"manifest:{kind}"


@dataclass
class Case:
    """One fuzz input: where it is, how ``rrh audit`` is called, what was damaged and what must still
    be audited."""

    index: int
    fmt: str
    directory: Path
    argv: list[str]
    damaged: str
    step: int
    mutation: str
    intact: dict[int, int]


def make_case(index: int, seed: int, fmt: str, base: Base, work: Path) -> Case:
    """Input ``index`` of ``seed``: a copy of ``base`` with one of its files damaged."""
    rng = random.Random(f"{seed}:{fmt}:{index}")
    directory = work / f"{fmt}-{index}"
    shutil.copytree(base.root, directory, symlinks=True)
    name = rng.choice(sorted(base.files))
    path = directory / name
    step = base.files[name]
    kind = base.kind[name]
    roll = rng.random()
    if roll < 0.12:
        mutation = _filesystem(rng, path)
    elif roll < 0.45:
        data, mutation = _bytes_mutation(rng, path.read_bytes())
        path.write_bytes(data)
    elif kind == "pickle" and fmt == "skyrl":
        data, mutation = _mutate_skyrl(rng, step)
        path.write_bytes(data)
    elif kind == "pickle":
        data, mutation = _mutate_verl(rng, step)
        path.write_bytes(data)
    elif kind == "torch":
        if rng.random() < 0.35:
            data, mutation = _mutate_zip(rng, path.read_bytes())
        else:
            data, mutation = _mutate_slime(rng, step, name.startswith("train"))
        path.write_bytes(data)
    elif kind == "jsonl":
        data, mutation = _mutate_jsonl(rng, step)
        path.write_bytes(data)
    elif kind == "parquet":
        mutation = _mutate_parquet(rng, path)
    elif fmt == "manifest":
        mutation = _mutate_manifest(rng, path)
    else:  # verl's meta.json
        data, mutation = _mutate_json_doc(rng, {"global_steps": step})
        path.write_bytes(data)
    intact = {s: n for s, n in base.samples.items() if s != step}
    report = directory / "report.json"
    argv = ["audit", str(directory / base.target), *base.args, "--executor", "serial", "--no-progress",
            "--json", str(report)]  # fmt: skip
    return Case(index, fmt, directory, argv, name, step, mutation, intact)


# --- the runner: a warm server that forks one child per input ----------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(argv: list[str], directory: Path, margin: int) -> None:
    """In the forked child: cap the address space, send output to files, run ``rrh`` and exit."""
    cap = _vm_size() + margin
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    out = os.open(directory / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(directory / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.stdout = os.fdopen(1, "w", closefd=False)
    sys.stderr = os.fdopen(2, "w", closefd=False)
    code = 1
    try:
        from harness.cli import main

        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """Read requests (JSON lines) on stdin; for each, fork a child that runs ``rrh`` and answer with
    its exit status, wall time and peak resident memory."""
    os.environ["RRH_FILE_SECONDS"] = FILE_SECONDS
    import harness.audit.importers.nemo_rl
    import harness.audit.importers.skyrl
    import harness.audit.importers.slime
    import harness.audit.importers.verl
    import harness.cli
    import harness.cli.audit_run
    from harness.audit.synthetic.generate import RunShape, generate_run

    with tempfile.TemporaryDirectory() as warm:  # the kernels compiled once, here, not in every child
        shape = RunShape(
            steps=1, prompts=1, group_size=2, prompt_len=3, response_len=3, layers=2, experts=4, top_k=1
        )
        generate_run(warm, shape, seed=0)
        with open(os.devnull, "w") as null:
            saved, sys.stdout = sys.stdout, null
            harness.cli.main(["audit", warm, "--executor", "serial", "--no-progress"])
            sys.stdout = saved
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"ready": True, "rss_kb": rss}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(request["argv"], Path(request["dir"]), request["margin"])
        status = rusage = None
        killed = False
        while True:
            done, status, rusage = os.wait4(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > request["limit"]:
                os.kill(pid, signal.SIGKILL)
                killed = True
                _, status, rusage = os.wait4(pid, 0)
                break
            time.sleep(0.005)
        seconds = time.monotonic() - start
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": code, "killed": killed, "seconds": seconds, "maxrss_kb": rusage.ru_maxrss}),
              flush=True)  # fmt: skip


class Runner:
    """The client of ``serve``: one warm server process for many inputs."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tests.fuzz_audit import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        )  # fmt: skip
        assert self.process.stdout is not None
        hello = json.loads(self.process.stdout.readline())
        self.base_rss_kb = hello["rss_kb"]

    def run(self, case: Case, limit: float = TIME_LIMIT, margin: int = MEMORY_MARGIN) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"argv": case.argv, "dir": str(case.directory), "limit": limit, "margin": margin}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait(timeout=30)


# --- judging an outcome --------------------------------------------------------------------------------


@dataclass
class Outcome:
    case: Case
    code: int
    seconds: float
    maxrss_kb: int
    problems: list[str]


def judge(case: Case, answer: dict[str, Any], base_rss_kb: int) -> Outcome:
    """What went wrong with one input (nothing, for an input handled as it must be)."""
    code = answer["code"]
    stdout = (case.directory / "stdout.txt").read_text(errors="replace")
    stderr = (case.directory / "stderr.txt").read_text(errors="replace")
    problems = []
    if answer["killed"]:
        problems.append(f"time: still running after {answer['seconds']:.0f} s")
    elif code < 0:
        problems.append(f"crash: killed by {signal.Signals(-code).name}")
    elif "Traceback" in stderr or code not in (0, 1, 2):
        problems.append(
            f"crash: exit {code}: {stderr.strip().splitlines()[-1][:300] if stderr.strip() else ''}"
        )
    text = stdout + stderr
    if "MemoryError" in text or "bad_alloc" in text or "malloc of size" in text:
        problems.append("memory: an allocation failed under the cap")
    if "time budget" in text:
        problems.append("time: a file ran out of its time budget")
    if (answer["maxrss_kb"] - base_rss_kb) * 1024 > MEMORY_MARGIN:
        problems.append(f"memory: {answer['maxrss_kb'] // 1024} MiB resident")
    for line in stderr.splitlines():
        if (
            not (line.startswith("rrh audit: ") or line.startswith("importing "))
            and "Traceback" not in stderr
        ):
            problems.append(f"output: a stderr line that is no message of its own: {line[:120]!r}")
            break
    report = case.directory / "report.json"
    if not problems and code in (0, 1, 2):
        if code == 2 and Path(case.damaged).name not in text and case.step >= 0:
            problems.append(f"message: exit 2 without naming {case.damaged}: {text.strip()[-300:]!r}")
        if not report.exists():
            if case.intact:
                problems.append(f"intact: no report, the intact steps {sorted(case.intact)} went unaudited")
        else:
            doc = json.loads(report.read_text())
            if any("\n" in e for e in doc["input_errors"]):
                problems.append("output: an input error of more than one line")
            found = {s["step"]: s["samples"] for s in doc["steps"]}
            short = {s: n for s, n in case.intact.items() if found.get(s, 0) < n}
            if short:
                problems.append(f"intact: steps {sorted(short)} not audited in full ({found})")
    return Outcome(case, code, answer["seconds"], answer["maxrss_kb"], problems)


@dataclass
class Summary:
    inputs: int = 0
    crashes: int = 0
    timeouts: int = 0
    memory: int = 0
    unaudited: int = 0
    other: int = 0
    exits: dict[int, int] = field(default_factory=dict)
    max_rss_mib: float = 0.0
    max_growth_mib: float = 0.0
    max_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)

    def add(self, outcome: Outcome, base_rss_kb: int) -> None:
        self.inputs += 1
        self.exits[outcome.code] = self.exits.get(outcome.code, 0) + 1
        self.max_rss_mib = max(self.max_rss_mib, outcome.maxrss_kb / 1024)
        self.max_growth_mib = max(self.max_growth_mib, (outcome.maxrss_kb - base_rss_kb) / 1024)
        self.max_seconds = max(self.max_seconds, outcome.seconds)
        for problem in outcome.problems:
            kind = problem.split(":", 1)[0]
            attribute = {"crash": "crashes", "time": "timeouts", "memory": "memory", "intact": "unaudited"}
            name = attribute.get(kind, "other")
            setattr(self, name, getattr(self, name) + 1)
        if outcome.problems:
            c = outcome.case
            self.failures.append(f"{c.fmt}#{c.index} {c.damaged} {c.mutation}: {'; '.join(outcome.problems)}")


def fuzz(count: int, seed: int, formats: tuple[str, ...] = FORMATS, work: Path | None = None,
         log: Callable[[str], None] | None = None, limit: float = TIME_LIMIT) -> Summary:  # fmt: skip
    """Run ``count`` inputs of each format (seeded) and return the counts."""
    owned = work is None
    work = Path(tempfile.mkdtemp(prefix="rrh-fuzz-")) if work is None else work
    summary = Summary()
    runner = Runner()
    try:
        bases = {fmt: BUILDERS[fmt](work / "base" / fmt) for fmt in formats}
        for index in range(count):
            for fmt in formats:
                case = make_case(index, seed, fmt, bases[fmt], work)
                outcome = judge(case, runner.run(case, limit), runner.base_rss_kb)
                summary.add(outcome, runner.base_rss_kb)
                if outcome.problems and log is not None:
                    log(summary.failures[-1])
                _remove(case.directory)
    finally:
        runner.close()
        if owned:
            _remove(work)
    return summary


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description="fuzz rrh audit with damaged and hostile dumps")
    parser.add_argument("--count", type=int, default=20, help="inputs per format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    args = parser.parse_args()
    start = time.monotonic()
    summary = fuzz(args.count, args.seed, tuple(args.formats.split(",")), log=lambda x: print(x, flush=True))
    doc = {**summary.__dict__, "seconds": time.monotonic() - start, "seed": args.seed}
    print(json.dumps({k: v for k, v in doc.items() if k != "failures"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
