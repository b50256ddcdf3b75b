"""``rrh audit`` and ``rrh generate`` from the command line: exit codes, reports, bad input in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")
import pyarrow as pa
import pyarrow.parquet as pq

from harness.audit.layout.schema import SampleRecord
from harness.audit.layout.writer import RunWriter
from harness.audit.synthetic.generate import FAULTS, RunShape, generate_run
from harness.cli import main
from tests.audit_transcript import check, transcript

SMALL = RunShape(
    steps=2, prompts=2, group_size=3, prompt_len=12, response_len=10, layers=6, experts=32, top_k=4
)


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    directory = tmp_path_factory.mktemp("faulty")
    planted = generate_run(directory, SMALL, seed=3, faults=FAULTS)
    return directory, planted


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("clean")
    generate_run(directory, SMALL, seed=3)
    return directory


def _audit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["audit", *map(str, args), "--executor", "serial", "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_clean_run_exits_0_and_names_what_it_could_not_check(
    clean_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _audit(capsys, clean_run)
    assert code == 0, out
    assert "VIOLATED" not in out
    assert "splice_consistency  not checkable from this dump — missing attempt payloads" in out
    assert "replay_fidelity     checked: 12 samples, no violation" in out


def test_every_planted_fault_is_named_at_its_place_in_the_json_report(
    faulty_run: tuple[Path, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    directory, planted = faulty_run
    report = tmp_path / "audit.json"
    code, out, _ = _audit(capsys, directory, "--json", report)
    assert code == 1, out
    doc = json.loads(report.read_text())
    schema = json.loads((Path(__file__).parents[1] / "harness/schemas/audit_report.schema.json").read_text())
    jsonschema.validate(doc, schema)
    offenders = {
        (inv["name"], o["step"], o["sample_key"], o["row"], o["layer"])
        for inv in doc["invariants"]
        for o in inv["offenders"]
    }
    for fault in planted:
        where = (
            fault.invariant,
            fault.step,
            fault.sample_key,
            fault.row,
            None if fault.layer < 0 else fault.layer,
        )
        assert where in offenders, (fault, sorted(offenders))


def test_html_has_plots_and_no_script_and_summary_tables_answer_a_query(
    faulty_run: tuple[Path, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = faulty_run
    page, tables = tmp_path / "audit.html", tmp_path / "summary"
    _audit(capsys, directory, "--html", page, "--summary", tables)
    text = page.read_text()
    assert text.count("<svg") >= 3 and "<script" not in text
    assert "Train–inference gap per step" in text and "Worst samples" in text
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(f"select step, samples from '{tables / 'steps.parquet'}' order by step").fetchall()
    assert rows == [(0, 6), (1, 6)]
    offenders = pq.read_table(tables / "offenders.parquet").to_pylist()
    assert {o["invariant"] for o in offenders} >= {
        "coverage",
        "ids_valid",
        "replay_fidelity",
        "logprobs_valid",
    }


def test_fail_on_a_threshold_exits_1(clean_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _audit(capsys, clean_run, "--fail-on", "mean_abs_diff=1e-9")
    assert code == 1
    assert "over threshold: mean_abs_diff at step 0" in out
    code, out, _ = _audit(capsys, clean_run, "--fail-on", "mean_abs_diff=10")
    assert code == 0


def test_sampling_picks_the_same_samples_every_time(
    clean_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _audit(capsys, clean_run, "--samples", "0.5", "--steps", "1")[1]
    again = _audit(capsys, clean_run, "--samples", "0.5", "--steps", "1")[1]
    assert first.splitlines()[1:] == again.splitlines()[1:]
    counted = int(first.split(" file, " if " file, " in first else " files, ")[1].split(" samples")[0])
    assert 0 < counted < 6


def _write(path: Path, table: pa.Table, metadata: dict[bytes, bytes] | None = None) -> None:
    if metadata is not None:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)


def _record(**overrides: object) -> SampleRecord:
    base: dict[str, object] = dict(
        step=0, sample_key="a", prompt_len=3, response_len=2, tokens=[1, 2, 3, 4, 5], num_experts=8, top_k=2,
        num_layers=2, moe_layers=[0, 1], source="test", engine_routes=np.array([[[0, 1], [2, 3]]] * 4),
        engine_logprobs=[-0.5, -1.0],
    )  # fmt: skip
    base.update(overrides)
    return SampleRecord(**base)  # type: ignore[arg-type]


@pytest.fixture()
def one_good_file(tmp_path: Path) -> Path:
    with RunWriter(tmp_path) as writer:
        writer.write(_record())
    return writer.files[0]


def _bad_cases(good: Path) -> dict[str, tuple[pa.Table, dict[bytes, bytes] | None, str]]:
    table = pq.read_table(good)
    meta = table.schema.metadata
    blob = table.column("engine_routes").to_pylist()[0]
    tokens = pa.array([[1, 2, 3]], pa.list_(pa.int32()))
    return {
        "missing column": (table.drop_columns(["top_k"]), meta, "column 'top_k' missing; expected int32"),
        "mistyped column": (
            table.set_column(table.schema.get_field_index("top_k"), "top_k", pa.array(["2"])),
            meta,
            "column 'top_k' has type string; expected int32",
        ),
        "short blob": (
            table.set_column(
                table.schema.get_field_index("engine_routes"),
                "engine_routes",
                pa.array([blob[:-1]], pa.large_binary()),
            ),
            meta,
            "row 0: column engine_routes holds 15 bytes; expected 4 rows",
        ),
        "ragged list": (
            table.set_column(table.schema.get_field_index("tokens"), "tokens", tokens),
            meta,
            "row 0: column 'tokens' has 3 entries; expected 5 (prompt_len + response_len)",
        ),
        "unknown version": (
            table,
            {b"rrh.run_layout": b"99"},
            "rrh.run_layout version 99; this harness reads",
        ),
        "no version": (table, {}, "no rrh.run_layout key"),
    }


@pytest.mark.parametrize(
    "case",
    ["missing column", "mistyped column", "short blob", "ragged list", "unknown version", "no version"],
)
def test_bad_input_is_one_line_naming_file_column_row_and_other_files_are_still_audited(
    case: str, one_good_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table, meta, message = _bad_cases(one_good_file)[case]
    bad = one_good_file.parent / "bad.parquet"
    _write(bad, table, meta)
    code, out, err = _audit(capsys, one_good_file.parent)
    assert code == 2
    # The input error comes first, on stderr, one line; the good file is still audited, on stdout.
    errors = err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("rrh audit: input error: "), errors
    assert str(bad) in errors[0] and message in errors[0], errors
    assert "1 samples" in out.splitlines()[0] or "2 files" in out.splitlines()[0]
    assert "coverage            checked: 1 samples" in out  # the good file was audited
    assert out.splitlines()[-1].startswith("incomplete: 1 input error(s), printed first on stderr")
    assert "Traceback" not in out + err


def test_truncated_file_and_directory_without_a_run(one_good_file: Path, tmp_path: Path, capsys) -> None:
    data = one_good_file.read_bytes()
    (one_good_file.parent / "cut.parquet").write_bytes(data[: len(data) // 2])
    code, _, err = _audit(capsys, one_good_file.parent)
    assert code == 2 and "cut.parquet: not a readable Parquet file" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _audit(capsys, empty)
    assert code == 2 and f"rrh audit: {empty}: no run here: looked in it and up to 3 folder levels" in err
    assert "*.parquet files of the run layout" in err and "gen_batch.dp" in err
    assert len(err.strip().splitlines()) == 1


def test_a_garbage_file_is_one_input_error_first_on_stderr_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(np.random.default_rng(0).bytes(3000))
    code, out, err = _audit(capsys, garbage)
    assert code == 2 and out == "", out
    assert err.splitlines() == [
        f"rrh audit: input error: {garbage}: not a readable Parquet file (ArrowInvalid: Parquet magic bytes "
        "not found in footer. Either the file is corrupted or this is not a parquet file.); expected a "
        "run-layout Parquet file"
    ]
    # A Parquet file that is not the run layout: the same, naming the metadata key it lacks.
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "other.parquet")
    code, out, err = _audit(capsys, tmp_path / "other.parquet")
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"rrh audit: input error: {tmp_path / 'other.parquet'}: no rrh.run_layout key in the file's "
        "metadata; not a run-layout file"
    ]


def test_nan_and_positive_logprobs_are_named_violations(tmp_path: Path, capsys) -> None:
    with RunWriter(tmp_path) as writer:
        writer.write(_record(engine_logprobs=[float("nan"), -1.0]))
        writer.write(_record(sample_key="b", engine_logprobs=[-1.0, 0.5]))
        writer.write(_record(sample_key="c", engine_logprobs=[-1.0, float("inf")], loss_mask=[True, False]))
    code, out, _ = _audit(capsys, tmp_path)
    assert code == 1
    assert "logprobs_valid      VIOLATED in 2 of 3 samples; first at step 0 sample a row 3" in out


def test_writer_refuses_ids_that_do_not_fit_and_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    from harness.audit.layout.schema import LayoutError

    with pytest.raises(LayoutError, match="engine_routes: ids in \\[0, 300\\] do not fit uint8"):
        _record(engine_routes=np.array([[[0, 300], [2, 3]]] * 4)).as_row()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", broken)
    writer = RunWriter(tmp_path)
    writer.write(_record())
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    assert list(tmp_path.iterdir()) == []


def test_generate_prints_where_each_fault_went(tmp_path: Path, capsys) -> None:
    assert main(["generate", str(tmp_path / "run"), "--faults", "wrapped_id"]) == 0
    out = capsys.readouterr().out
    assert "planted wrapped_id" in out and "→ ids_valid at step 1" in out
    assert main(["generate", str(tmp_path / "other"), "--faults", "nonsense"]) == 2


def test_dense_slots_are_judged_on_captured_rows_only(tmp_path: Path, capsys) -> None:
    """A dense-layer slot must be empty where a route was captured; a filler row is never judged."""
    routes = np.array([[[0, 0], [2, 3]]] * 4)
    filler = routes.copy()
    filler[3, 0] = [1, 2]  # e.g. SkyRL's arange(K) padding, in the dense slot of an uncaptured row
    captured_bad = routes.copy()
    captured_bad[1, 0] = [5, 0]
    with RunWriter(tmp_path) as writer:
        writer.write(_record(moe_layers=[1], engine_routes=filler, engine_captured=[True, True, True, False]))
        writer.write(_record(sample_key="b", moe_layers=[1], engine_routes=captured_bad))
    code, out, _ = _audit(capsys, tmp_path)
    assert code == 1
    assert "dense_empty         VIOLATED in 1 of 2 samples; first at step 0 sample b row 1 layer 0" in out


def test_the_run_layout_audit_prints_the_committed_transcript(
    faulty_run: tuple[Path, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, _ = faulty_run
    check("run_layout", transcript(capsys, [str(directory)], directory, tmp_path))
