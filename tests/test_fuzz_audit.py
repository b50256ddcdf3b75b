"""``rrh audit`` on damaged and hostile dumps of every format it reads (``tests/fuzz_audit.py``).

Each input runs ``rrh audit`` in a child forked from a warm server, under an address-space cap
(the server's size + 2 GiB) and a wall-clock limit, and must end by itself with 0, 1 or 2, print
one line per message, name the damaged file when it exits 2, allocate nothing a file merely
declares (no MemoryError under the cap), stay within its time budget, and still audit the intact
files (every other step in the JSON report with all its samples).

- ``test_hostile_file_*``: the reproducers of issue 32, one by one (a segfault, a FIFO, a symlink
  to ``/dev/zero``, a declared size of terabytes, a zip record of an unknown method …);
- ``test_fuzzed_dumps_of_every_format``: a seeded sample of the fuzz, small in the default run
  (``RRH_FUZZ_INPUTS`` inputs per format, default 2); ``-m slow`` runs 40 per format. The counts of
  a larger run: ``python -m tests.fuzz_audit --count N --seed S``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import fuzz_audit as fz

pytest.importorskip("pyarrow")
pytestmark = [
    pytest.mark.skipif(
        not Path("/proc/self/status").exists() or not hasattr(os, "fork"), reason="forks, reads /proc"
    ),
]


@pytest.fixture(scope="module")
def runner() -> Iterator[fz.Runner]:
    server = fz.Runner()
    yield server
    server.close()


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, fz.Base]:
    root = tmp_path_factory.mktemp("bases")
    return {fmt: build(root / fmt) for fmt, build in fz.BUILDERS.items()}


def _case(
    bases: dict[str, fz.Base], tmp_path: Path, fmt: str, name: str, damage: Callable[[Path], None]
) -> fz.Case:
    base = bases[fmt]
    directory = tmp_path / "dump"
    shutil.copytree(base.root, directory, symlinks=True)
    damage(directory / name)
    report = directory / "report.json"
    argv = ["audit", str(directory / base.target), *base.args, "--executor", "serial", "--no-progress",
            "--json", str(report)]  # fmt: skip
    step = base.files[name]
    intact = {s: n for s, n in base.samples.items() if s != step}
    return fz.Case(0, fmt, directory, argv, name, step, damage.__name__, intact)


def _check(runner: fz.Runner, case: fz.Case, code: int = 2) -> str:
    """Run the case; it must pass the fuzz's judgement and exit ``code``; its messages are returned."""
    outcome = fz.judge(case, runner.run(case), runner.base_rss_kb)
    assert outcome.problems == [], outcome.problems
    assert outcome.code == code, (outcome.code, (case.directory / "stderr.txt").read_text())
    return (case.directory / "stdout.txt").read_text() + (case.directory / "stderr.txt").read_text()


# --- damage, as functions of the file's path ---------------------------------------------------------------


def _write(data: bytes) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        path.unlink()
        path.write_bytes(data)

    return write


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def dangling(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "gone")


def _skyrl(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        step = int(path.name.split("_")[2])
        state = fz._skyrl_state(step)
        state = edit(state) or state
        path.write_bytes(fz.skyrl_pickle(state))

    damage.__name__ = edit.__name__
    return damage


def object_array_short(state: dict[str, Any]) -> None:
    state["metadata"]["uids"] = fz.fake_array((5000,), np.dtype("O"), ["a", "b", "c"])


def declared_terabyte(state: dict[str, Any]) -> None:
    state["metadata"]["blob"] = fz.Raw(b"\x96" + struct.pack("<Q", 2**40))


def uninitialised_array(state: dict[str, Any]) -> None:
    state["metadata"]["x"] = fz._Call(np.ndarray, (2**33,), "u1")


def strided_view(state: dict[str, Any]) -> None:
    state["metadata"]["policy_prompt_boundaries"] = fz._Call(
        np.ndarray, (10**12,), "i8", b"12345678", 0, (0,)
    )


def colliding_keys(state: dict[str, Any]) -> None:
    state["metadata"]["x"] = {k * (2**61 - 1): 0 for k in range(1, 3000)}


def huge_shape(state: dict[str, Any]) -> None:
    state["batch_dict"]["sequences"] = {
        "format": "numpy",
        "data": b"",
        "shape": (2**32, 2**32),
        "dtype": "int64",
    }


def empty_shape_overflowing_int64(state: dict[str, Any]) -> None:
    state["batch_dict"]["sequences"] = {"format": "numpy", "data": b"", "shape": (2**32, 2**32, 0),
                                        "dtype": "int64"}  # fmt: skip


def array_metadata(state: dict[str, Any]) -> None:
    state["metadata"] = fz.fake_array((2,), np.dtype("i8"), b"\0" * 16)


def newline_global(state: dict[str, Any]) -> None:
    state["metadata"]["x"] = fz.Raw(b"\x8c\x06os\nx\nz\x8c\x06system\x93")  # a global named across lines


def planted_call(state: dict[str, Any]) -> None:
    state["metadata"]["x"] = fz._Call(fz._named("os", "system", fz._planted), "touch /tmp/rrh-fuzz-ran")


SKYRL = "dumped_data/global_step_2_training_input.pkl"


@pytest.mark.parametrize(
    "edit",
    [object_array_short, declared_terabyte, uninitialised_array, strided_view, colliding_keys, huge_shape,
     empty_shape_overflowing_int64, array_metadata, planted_call, newline_global],
)  # fmt: skip
def test_hostile_file_skyrl_pickle(runner: fz.Runner, bases: Any, tmp_path: Path, edit: Any) -> None:
    """Each once crashed (SIGSEGV), took gigabytes or minutes, or printed a traceback."""
    text = _check(runner, _case(bases, tmp_path, "skyrl", SKYRL, _skyrl(edit)))
    assert "global_step_2_training_input.pkl" in text


def test_hostile_file_verl_object_array(runner: fz.Runner, bases: Any, tmp_path: Path) -> None:
    def damage(path: Path) -> None:
        batch, non_tensor, meta = fz._verl_state(2, numpy_batch=True)
        non_tensor["uid"] = fz.fake_array((300,), np.dtype("O"), ["u"] * 4)
        path.write_bytes(fz.verl_pickle((batch, non_tensor, meta)))

    _check(runner, _case(bases, tmp_path, "verl", f"{fz.VERL_DIR}/2/gen_batch.dp", damage))


@pytest.mark.parametrize("shape", [(2**32, 2**32, 0), (0, 2**62, 2**62)])
def test_hostile_file_verl_shape_overflowing_int64(
    runner: fz.Runner, bases: Any, tmp_path: Path, shape: tuple[int, ...]
) -> None:
    """An empty batch field whose other sizes multiply past 2**63: numpy's ValueError (a traceback)."""

    def damage(path: Path) -> None:
        batch, non_tensor, meta = fz._verl_state(2, numpy_batch=True)
        batch[2]["attention_mask"] = ("int64", shape, b"")
        path.write_bytes(fz.verl_pickle((batch, non_tensor, meta)))

    text = _check(runner, _case(bases, tmp_path, "verl", f"{fz.VERL_DIR}/2/gen_batch.dp", damage))
    assert "2/gen_batch.dp: field 'attention_mask'" in text and "overflows int64" in text, text  # quoted once


@pytest.mark.parametrize("where", ["batch", "meta-set"])
def test_hostile_file_verl_array_without_contents_is_named_in_user_terms(
    runner: fz.Runner, bases: Any, tmp_path: Path, where: str
) -> None:
    """A numpy array whose BUILD never came, as the batch or in a set: ``field 'batch' is PendingArray``
    and ``builtins.set: item PendingArray refused`` (no file) were printed."""
    unbuilt = fz._Call(fz._reconstruct(), np.ndarray, (0,), b"b")

    def damage(path: Path) -> None:
        batch, non_tensor, meta = fz._verl_state(2, numpy_batch=True)
        if where == "batch":
            batch = unbuilt
        else:
            meta["x"] = fz._Call(set, [unbuilt])
        path.write_bytes(fz.verl_pickle((batch, non_tensor, meta)))

    text = _check(runner, _case(bases, tmp_path, "verl", f"{fz.VERL_DIR}/2/gen_batch.dp", damage))
    said = "field 'batch' is" if where == "batch" else "a set (builtins.set) holds"
    assert f"2/gen_batch.dp: {said} a numpy array without its contents" in text, text
    assert "Pending" not in text, text


def test_hostile_file_verl_meta_json_nested_past_the_recursion_limit(
    runner: fz.Runner, bases: Any, tmp_path: Path
) -> None:
    damage = _write(("[" * 100_000 + "]" * 100_000).encode())
    text = _check(runner, _case(bases, tmp_path, "verl", f"{fz.VERL_DIR}/2/meta.json", damage))
    assert "recursion limit" in text


def _zip_record(
    method: int | None = None, flags: int | None = None, crc: bool = False
) -> Callable[[Path], None]:
    """A slime ``.pt`` whose ``data.pkl`` record has another method, flags or CRC."""

    def damage(path: Path) -> None:
        data = bytearray(path.read_bytes())
        name = next(n for n in fz.zipfile.ZipFile(path).namelist() if n.endswith("data.pkl"))
        info = fz.zipfile.ZipFile(path).getinfo(name)
        central = fz._central_entry(bytes(data), name)
        if method is not None:
            struct.pack_into("<H", data, info.header_offset + 8, method)
            struct.pack_into("<H", data, central + 10, method)
        if flags is not None:
            struct.pack_into("<H", data, info.header_offset + 6, flags)
            struct.pack_into("<H", data, central + 8, flags)
        if crc:
            struct.pack_into("<I", data, central + 16, info.CRC ^ 1)
            struct.pack_into("<I", data, info.header_offset + 14, info.CRC ^ 1)
        path.write_bytes(bytes(data))

    return damage


def _slime_object_array(path: Path) -> None:
    rollout, _ = fz.slime_payloads(1)
    rollout["samples"][1]["tokens"] = fz.fake_array((4000,), np.dtype("O"), [1, 2])
    path.write_bytes(fz.torch_save(rollout))


def _slime_expanded(path: Path) -> None:
    import torch

    rollout, _ = fz.slime_payloads(1)
    rollout["samples"][1]["rollout_routed_experts"] = torch.zeros(1, dtype=torch.int32).expand(10**8, 4, 2)
    path.write_bytes(fz.torch_save(rollout))


def _slime_multi_element_count(path: Path) -> None:
    import torch

    rollout, _ = fz.slime_payloads(1)
    rollout["samples"][1]["response_length"] = torch.tensor([3, 4])
    path.write_bytes(fz.torch_save(rollout))


@pytest.mark.parametrize(
    "damage",
    [fifo, dev_zero, directory, dangling, _zip_record(method=99), _zip_record(method=8), _zip_record(flags=1),
     _zip_record(crc=True), _slime_object_array, _slime_expanded, _slime_multi_element_count],
    ids=["fifo", "dev-zero", "directory", "dangling", "method-99", "deflated", "encrypted", "bad-crc",
         "object-array", "expanded-view", "multi-element-count"],
)  # fmt: skip
def test_hostile_file_slime(runner: fz.Runner, bases: Any, tmp_path: Path, damage: Any) -> None:
    text = _check(runner, _case(bases, tmp_path, "slime", "rollout_data/1.pt", damage))
    assert "rollout_data/1.pt" in text


@pytest.mark.parametrize(
    "damage",
    [fifo, dev_zero, directory, dangling, _write(b'{"idx": 1, "token_ids": [[\xff\xfe]]}\n'),
     _write(b"[" * 100_000 + b"]" * 100_000 + b"\n"), _write(b'{"input_lengths": [' + b"9" * 5000 + b"]}\n")],
    ids=["fifo", "dev-zero", "directory", "dangling", "not-utf8", "deep", "huge-integer"],
)  # fmt: skip
def test_hostile_file_nemo_rl(runner: fz.Runner, bases: Any, tmp_path: Path, damage: Any) -> None:
    text = _check(runner, _case(bases, tmp_path, "nemo_rl", "train_data_step2.jsonl", damage))
    assert "train_data_step2.jsonl" in text


def _footer(rows: int) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        from tests.parquet_footer import (
            FILE_NUM_ROWS,
            GROUP_NUM_ROWS,
            I64,
            read_footer,
            row_groups,
            write_footer,
        )

        body, meta = read_footer(path.read_bytes())
        row_groups(meta)[0][GROUP_NUM_ROWS] = (I64, rows)
        meta[FILE_NUM_ROWS] = (I64, rows)
        path.write_bytes(write_footer(body, meta))

    return damage


def _column(name: str, value: Any) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from harness.audit.layout.writer import write_table

        table = pq.read_table(path)
        index = table.schema.get_field_index(name)
        array = pa.array([value] * table.num_rows, type=table.schema.field(name).type)
        write_table(
            path, table.set_column(index, table.schema.field(name), array), 10_000, row_group_bytes=1_500
        )

    return damage


@pytest.mark.parametrize(
    "damage",
    [_footer(2**40), _footer(2**31), _footer(7), _column("num_experts", 32),
     _column("routes_start", 2**31 - 1), fifo, dev_zero],
    ids=["rows-2**40", "rows-2**31", "rows-off-by-one", "expert-count", "routes-start", "fifo", "dev-zero"],
)  # fmt: skip
def test_hostile_file_run_layout(runner: fz.Runner, bases: Any, tmp_path: Path, damage: Any) -> None:
    """A row group declaring 2**31 rows once took 2.5 GiB and exited 0; files disagreeing on the expert
    count, a huge routes_start: tracebacks."""
    name = sorted(bases["layout"].files)[1]
    _check(runner, _case(bases, tmp_path, "layout", name, damage))


def _manifest(**fields: Any) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        doc = json.loads(path.read_text())
        doc.update(fields)
        path.write_text(json.dumps(doc))

    return damage


@pytest.mark.parametrize(
    "damage",
    [_manifest(world_size=10**7), _manifest(files=["../../etc/passwd"]), _manifest(files=[None]),
     _manifest(rank=5), fifo, dev_zero],
    ids=["world-size-10**7", "files-outside", "files-null", "rank-past-world", "fifo", "dev-zero"],
)  # fmt: skip
def test_hostile_file_tap_manifest(runner: fz.Runner, bases: Any, tmp_path: Path, damage: Any) -> None:
    """world_size 10**7 once took 4 GiB; a FIFO blocked forever. The run's files are still audited."""
    _check(runner, _case(bases, tmp_path, "manifest", "_tap/rank-00001.json", damage))


def test_fuzzed_dumps_of_every_format(
    runner: fz.Runner, bases: Any, tmp_path: Path, record_property: Any
) -> None:
    count = int(os.environ.get("RRH_FUZZ_INPUTS", "2"))
    _fuzz(runner, bases, tmp_path, count, seed=0, record_property=record_property)


@pytest.mark.slow
def test_fuzzed_dumps_of_every_format_many(
    runner: fz.Runner, bases: Any, tmp_path: Path, record_property: Any
) -> None:
    _fuzz(runner, bases, tmp_path, 40, seed=1, record_property=record_property)


def _fuzz(runner: fz.Runner, bases: Any, tmp_path: Path, count: int, seed: int, record_property: Any) -> None:
    summary = fz.Summary()
    for index in range(count):
        for fmt in fz.FORMATS:
            case = fz.make_case(index, seed, fmt, bases[fmt], tmp_path)
            summary.add(fz.judge(case, runner.run(case), runner.base_rss_kb), runner.base_rss_kb)
            shutil.rmtree(case.directory, ignore_errors=True)
    for key in ("inputs", "crashes", "timeouts", "memory", "unaudited", "max_seconds", "max_growth_mib"):
        record_property(key, getattr(summary, key))
    print(
        f"\nfuzz rrh audit: {summary.inputs} inputs, exits {summary.exits}, max {summary.max_seconds:.1f} s"
    )
    assert summary.inputs == count * len(fz.FORMATS)
    assert summary.failures == []


# --- issue 42: the robustness residue ---------------------------------------------------------------------


def _audit_case(directory: Path, *args: str, damaged: str = "", intact: dict[int, int] | None = None,
                target: Path | None = None) -> fz.Case:  # fmt: skip
    """A case of ``rrh audit`` on ``target`` (default ``directory``) with ``args``; ``damaged`` is the
    name an exit 2 must print (empty: any), ``intact`` the steps the report must hold in full."""
    report = directory / "report.json"
    argv = ["audit", str(target or directory), *args, "--executor", "serial", "--no-progress", "--json",
            str(report)]  # fmt: skip
    return fz.Case(0, "layout", directory, argv, damaged, 0 if damaged else -1, "", intact or {})


def _attempt_records(count: int) -> list[Any]:
    """``count`` layout-v2 records of one step, every other one (and the last) with no attempt."""
    from harness.audit.layout.schema import SampleRecord

    rng = np.random.default_rng(0)
    records = []
    for i in range(count):
        routes = np.stack([rng.permutation(8)[:2] for _ in range(8)]).reshape(4, 2, 2)
        none = i % 2 == 1 or i == count - 1
        records.append(SampleRecord(
            step=1, sample_key=f"s{i}", prompt_len=3, response_len=2, tokens=[1, 2, 3, 4, 5], num_experts=8,
            top_k=2, num_layers=2, moe_layers=[0, 1], source="test", engine_routes=routes,
            attempt_ends=[] if none else [2], attempt_routes=[] if none else [routes],
        ))  # fmt: skip
    return records


@pytest.mark.parametrize("row_groups", [1, 4])
def test_a_row_group_ending_with_a_sample_without_attempts(
    runner: fz.Runner, tmp_path: Path, row_groups: int
) -> None:
    """A valid run whose row group's last sample has no attempts once failed to decode (IndexError in
    ``np.add.reduceat``): an input error on two records, an undecodable row group in a larger run."""
    import pyarrow.parquet as pq

    from harness.audit.layout.writer import RunWriter, write_table

    count = 2 if row_groups == 1 else 40
    with RunWriter(tmp_path) as writer:
        for record in _attempt_records(count):
            writer.write(record)
    (path,) = writer.files
    if row_groups > 1:  # the same rows in row groups of 10, each ending with a sample without attempts
        table = pq.read_table(path)
        write_table(path, table, 10_000, row_group_bytes=10_000 * 10 // count)
        assert pq.ParquetFile(path).metadata.num_row_groups == row_groups
    _check(runner, _audit_case(tmp_path, intact={1: count}), code=0)


def _shard_records(step: int, shards: int) -> list[Any]:
    """A whole sample and a shard row of it (shard 0 of ``shards``, holding every route row)."""
    from harness.audit.layout.schema import SampleRecord

    routes = np.stack([np.random.default_rng(step).permutation(8)[:2] for _ in range(8)]).reshape(4, 2, 2)
    common = dict(step=step, sample_key="s0", prompt_len=3, response_len=2, tokens=[1, 2, 3, 4, 5],
                  num_experts=8, top_k=2, num_layers=2, moe_layers=[0, 1], source="test")  # fmt: skip
    return [
        SampleRecord(**common, engine_routes=routes),  # type: ignore[arg-type]
        SampleRecord(**common, trainer_routes=routes, shard=0, shards=shards, positions=[0, 1, 2, 3]),  # type: ignore[arg-type]
    ]


def test_a_shard_row_declaring_two_billion_shards_is_an_input_error(
    runner: fz.Runner, tmp_path: Path
) -> None:
    """``shards = 2**31 − 1`` once built a set of that many shards (killed at 4 GiB, nothing printed)."""
    from harness.audit.layout.writer import RunWriter

    with RunWriter(tmp_path) as writer:
        for step, shards in ((1, 1), (2, 2**31 - 1)):
            for record in _shard_records(step, shards):
                writer.write(record)
            writer.flush()
    damaged = writer.files[1].name
    text = _check(runner, _audit_case(tmp_path, damaged=damaged, intact={1: 1}))
    assert "column 'shards' is 2147483647; expected at most 65536" in text, text


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "a-file-per-shard"])
@pytest.mark.parametrize(
    "late", [False, True], ids=["first-shard-routes-start-1", "second-shard-routes-start-1"]
)
def test_shards_of_one_sample_declaring_other_route_rows_are_a_shard_union_violation(
    runner: fz.Runner, tmp_path: Path, split: bool, late: bool
) -> None:
    """A shard row with ``routes_start`` 1 (3 route rows) beside one with 0 (4): the sample's cover was
    sized by whichever came first, and the other's row 3 fell outside it (IndexError, a traceback;
    covers of different files would not add). It is the shards' disagreement, named at both places,
    whichever order or file they come in."""
    import dataclasses

    from harness.audit.layout.writer import RunWriter

    whole, shard = _shard_records(1, 2)
    routes = shard.trainer_routes
    first, second = (0, 1) if late else (1, 0)  # the routes_start of each shard row
    parts = [dataclasses.replace(shard, positions=[0, 1], trainer_routes=routes[:2], routes_start=first),
             dataclasses.replace(shard, shard=1, positions=[2, 3], trainer_routes=routes[2:],
                                 routes_start=second, rank=1)]  # fmt: skip
    with RunWriter(tmp_path) as writer:
        for record in (whole, *parts):
            writer.write(record)
            if split:
                writer.flush()
    text = _check(runner, _audit_case(tmp_path), code=1)
    report = json.loads((tmp_path / "report.json").read_text())
    (union,) = [c for c in report["invariants"] if c["name"] == "shard_union"]
    offenders = {o["actual"].split(" ")[0]: o for o in union["offenders"]}
    assert len(offenders) == 1 + late, offenders  # late: its row 3 lies outside its own 3 rows too
    offender = offenders["3"]
    assert "declaring its 4 route rows (prompt_len + response_len − 1 − routes_start)" in offender["expected"]
    assert offender["actual"].startswith("3 route rows at ") and offender["row"] == 3, offender
    assert "shard_union         VIOLATED in" in text and "declaring its 4 route rows" in text, text
    # One sample, however many ways its shards are wrong (late: "VIOLATED in 2 of 1 samples" before).
    assert union["violated"] == 1 == union["checked"], union


@pytest.mark.parametrize(
    "spec",
    ["tp=1000000000", "pp=1000000000", "dp=99999999999999999999", "tp=\u00b2"],
)
def test_a_trainer_layout_no_run_can_have_is_a_usage_error_naming_the_field(
    runner: fz.Runner, bases: Any, tmp_path: Path, spec: str
) -> None:
    """``tp=1000000000`` once allocated 3 GiB in 8 s (a set of the world's ranks), ``tp=²`` (a digit
    ``str.isdigit`` takes and ``int`` refuses) was a traceback."""
    directory = tmp_path / "dump"
    shutil.copytree(bases["verl"].root, directory)
    (directory / "trace").mkdir()
    (directory / "trace" / "router_trace_rank0.jsonl").write_text("")
    trace = ["--trainer-trace", str(directory / "trace"), "--trainer-layout", f"{spec},max_token_len=24"]
    case = _audit_case(directory, *bases["verl"].args, *trace, target=directory / fz.VERL_DIR)
    text = _check(runner, case)
    name = spec.split("=")[0]
    assert text.startswith("rrh audit: --trainer-layout") and text.count("\n") == 1, text
    assert f"{spec}'" in text if "\u00b2" in spec else f"{name}={spec.split('=')[1][:20]}" in text, text


def _histogram(path: Path) -> None:
    """A column chunk's definition level histogram two entries longer than the column's levels + 1."""
    from tests.parquet_footer import column_meta, read_footer, row_groups, write_footer

    body, meta = read_footer(path.read_bytes())
    for chunk in column_meta(row_groups(meta)[0]):
        stats = chunk.get(16)
        if stats is not None and stats[1].get(3, (0, (0, [])))[1][1]:
            kind, (inner, histogram) = stats[1][3]
            stats[1][3] = (kind, (inner, [*histogram, 5, 5]))
            break
    path.write_bytes(write_footer(body, meta))


def test_a_footer_pyarrow_aborts_on_is_an_input_error(runner: fz.Runner, bases: Any, tmp_path: Path) -> None:
    """Size statistics whose level histogram does not fit the column once took the audit down with
    SIGABRT ("Definition level histogram size mismatch", thrown where pyarrow cannot raise)."""
    name = sorted(bases["layout"].files)[1]
    text = _check(runner, _case(bases, tmp_path, "layout", name, _histogram))
    assert "damaged Parquet footer" in text and "definition level histogram" in text, text


def _long_path(directory: Path) -> Path:
    return directory / ("x" * 5000)


def _deep_folder(directory: Path) -> Path:
    deep = directory / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY)
    try:
        for _ in range(1200):  # by descriptor: the path itself grows past PATH_MAX
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    return deep


def _remove_chain(top: Path) -> None:
    """Remove a chain of nested folders by descriptor (``shutil.rmtree`` recurses past the limit)."""
    import stat

    fds, names = [os.open(top, os.O_RDONLY)], []
    while True:
        entries = os.listdir(fds[-1])
        folders = [
            n for n in entries if stat.S_ISDIR(os.stat(n, dir_fd=fds[-1], follow_symlinks=False).st_mode)
        ]
        for name in set(entries) - set(folders):
            os.unlink(name, dir_fd=fds[-1])
        if not folders:
            break
        names.append(folders[0])
        fds.append(os.open(folders[0], os.O_RDONLY, dir_fd=fds[-1]))
    while names:
        os.close(fds.pop())
        os.rmdir(names.pop(), dir_fd=fds[-1])
    os.close(fds[0])


@pytest.mark.parametrize("make", [_long_path, _deep_folder], ids=["path-of-5000-characters", "1200-levels"])
def test_a_run_path_the_file_system_refuses_is_one_line(runner: fz.Runner, tmp_path: Path, make: Any) -> None:
    """A path over 4,096 characters (ENAMETOOLONG) and a folder 1,200 levels deep (RecursionError) were
    tracebacks."""
    target = make(tmp_path)
    try:
        text = _check(runner, _audit_case(tmp_path, target=target))
    finally:
        if make is _deep_folder:
            _remove_chain(target)
    assert text.count("\n") == 1 and text.startswith("rrh audit: "), text[:500]
    assert ("File name too long" if make is _long_path else "nested deeper") in text, text[:500]


def test_folder_names_that_are_not_utf8_are_audited(runner: fz.Runner, bases: Any, tmp_path: Path) -> None:
    """Non-UTF-8 bytes in a folder's name: pyarrow's UnicodeEncodeError, an input error on every file of
    the run layout there and a traceback in the verl importer; both are audited now."""
    odd = os.fsdecode(b"\xff\xfe")
    layout, verl = tmp_path / "layout", tmp_path / "verl"
    shutil.copytree(bases["layout"].root, layout / odd)
    shutil.copytree(bases["verl"].root / "exp_proj", verl / odd)
    _check(runner, _audit_case(layout, intact=bases["layout"].samples), code=0)
    _check(runner, _audit_case(verl, *bases["verl"].args, intact=bases["verl"].samples), code=0)


def test_control_characters_in_folder_names_are_printed_escaped(
    runner: fz.Runner, bases: Any, tmp_path: Path
) -> None:
    """An escape sequence and a carriage return in a folder's name were printed raw in error lines."""
    directory = tmp_path / "run\x1b[2J\rHIDDEN"
    shutil.copytree(bases["layout"].root, directory)
    name = sorted(bases["layout"].files)[1]
    (directory / name).write_bytes(b"garbage")
    case = _audit_case(directory, damaged=name, intact={s: n for s, n in bases["layout"].samples.items()
                                                        if s != bases["layout"].files[name]})  # fmt: skip
    text = _check(runner, case)
    assert "\x1b" not in text and "\r" not in text, repr(text[:300])
    assert "run\\x1b[2J\\rHIDDEN" in text, text[:300]


def test_two_trace_files_of_one_rank_are_refused_naming_both(runner: fz.Runner, tmp_path: Path) -> None:
    """``router_trace_rank0`` and ``router_trace_rank00`` are both rank 0: one was silently ignored."""
    record = {"step": 1, "stage": "pre_dispatch", "block": "decoder", "layer": 1, "rank": 0, "num_tokens": 1,
              "topk": 2, "top_indices": [[0, 1]]}  # fmt: skip
    for name in ("router_trace_rank0.jsonl", "router_trace_rank00.jsonl"):
        (tmp_path / name).write_text(json.dumps(record) + "\n")
    text = _check(runner, _audit_case(tmp_path, "--from", "megatron_lm", "--num-experts", "8",
                                      damaged="router_trace_rank00.jsonl"))  # fmt: skip
    assert "router_trace_rank0.jsonl" in text and "both are rank 0" in text, text


@pytest.mark.parametrize(
    ("rows", "topk", "bad"),
    [([[0, 1], [2, [3]]], 2, "row 1 holds list of 1"), ([[[0], 1], [2, 3]], 2, "row 0 holds list of 1"),
     ([[[0, 1]], [[2, 3]]], 1, "row 0 holds list of 2"), ([[0, None], [1, 2]], 2, "row 0 holds None")],
    ids=["ragged-below-a-row", "ragged-first-id", "three-dimensional", "null-id"],
)  # fmt: skip
@pytest.mark.parametrize("joined", [False, True], ids=["trace-alone", "trainer-trace"])
def test_top_indices_that_are_not_rows_of_ids_are_an_input_error(
    runner: fz.Runner, bases: Any, tmp_path: Path, rows: list[Any], topk: int, bad: str, joined: bool
) -> None:
    """Rows of the right length holding a list where an id belongs: numpy's ValueError (inhomogeneous
    shape, a traceback), or, at top-k 1, a 3-d array taken for ids (no violation, nothing said)."""
    directory = tmp_path / "dump"
    shutil.copytree(bases["verl"].root, directory)
    (directory / "trace").mkdir()
    record = {"step": 1, "stage": "pre_dispatch", "block": "decoder", "layer": 0, "rank": 0, "num_tokens": 2,
              "topk": topk, "top_indices": rows}  # fmt: skip
    (directory / "trace" / "router_trace_rank0.jsonl").write_text(json.dumps(record) + "\n")
    if joined:
        trace = ["--trainer-trace", str(directory / "trace"), "--trainer-layout", "tp=1,max_token_len=24"]
        case = _audit_case(directory, *bases["verl"].args, *trace, target=directory / fz.VERL_DIR,
                           damaged="router_trace_rank0.jsonl")  # fmt: skip
    else:
        case = _audit_case(directory, "--from", "megatron_lm", "--num-experts", "8",
                           target=directory / "trace", damaged="router_trace_rank0.jsonl")  # fmt: skip
    text = _check(runner, case)
    assert "router_trace_rank0.jsonl:1: field 'top_indices' " + bad in text, text


@pytest.mark.parametrize(
    ("at", "link", "target", "said"),
    [(fz.VERL_DIR, ".", "root", True), (fz.VERL_DIR, ".", "experiment", True),
     (fz.VERL_DIR, ".", "run", True), (f"{fz.VERL_DIR}/1", "..", "run", True),
     (f"{fz.VERL_DIR}/1", "..", "root", False), ("exp_proj", "..", "root", True),
     ("exp_proj", "..", "run", False)],
    ids=["run-to-itself", "run-to-itself-from-the-experiment", "run-to-itself-from-the-run",
         "step-to-its-run", "step-to-its-run-past-the-depth", "experiment-to-the-root",
         "experiment-to-the-root-above-the-run"],
)  # fmt: skip
def test_a_symlink_loop_in_a_verl_dump_is_not_followed_and_said(
    runner: fz.Runner, bases: Any, tmp_path: Path, at: str, link: str, target: str, said: bool
) -> None:
    """A symlink back to a folder above it showed one run under each of its names ("3 verl runs
    found", nothing audited); the loop is not followed, the run is audited once and a note says so
    (a loop above the folder given, or deeper than the three levels looked into, is never met)."""
    directory = tmp_path / "dump"
    shutil.copytree(bases["verl"].root, directory)
    (directory / at / "loop").symlink_to(link)
    path = {"root": directory, "experiment": directory / "exp_proj", "run": directory / fz.VERL_DIR}[target]
    case = _audit_case(directory, *bases["verl"].args, target=path, intact=bases["verl"].samples)
    text = _check(runner, case, code=0)
    note = f"note: verl: symlink loop not followed: {directory / at / 'loop'} leads back to "
    assert (note in text and "1 verl run found, each read once" in text) is said, text


@pytest.mark.parametrize("loop", ["self", "pair", "inside"])
def test_a_run_path_that_is_a_symlink_loop_says_so(runner: fz.Runner, tmp_path: Path, loop: str) -> None:
    """A run path that is a symlink loop (ELOOP) was reported as "no such file or directory"."""
    (tmp_path / "a").symlink_to("b" if loop == "pair" else "a")
    if loop == "pair":
        (tmp_path / "b").symlink_to("a")
    target = tmp_path / "a" / "run" if loop == "inside" else tmp_path / "a"
    text = _check(runner, _audit_case(tmp_path, target=target))
    assert text.startswith(f"rrh audit: {target}: a symlink loop (") and "ELOOP" in text, text
    assert text.count("\n") == 1 and "no such file" not in text, text
