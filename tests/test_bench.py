"""``rrh bench trace``, ``replay`` and ``tap`` measure what they say, on small inputs (their figures are
never asserted: they are throughputs of this machine)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.bench.pairs import ForwardShape
from harness.bench.replay import bench_replay, format_bench_replay
from harness.bench.tap import bench_tap, format_bench_tap
from harness.bench.trace import (
    CHECKED_RATIOS,
    RecordedRatiosError,
    bench_trace,
    check_against,
    not_comparable,
    recorded_ratios,
)
from harness.cli import main


def test_both_orders_of_lanes_measure_the_same_disagreement(tmp_path: Path) -> None:
    result = bench_trace(sequences=8, positions=256, layers=4, repeats=1, directory=tmp_path)
    assert result["disagreement_measured"] == result["disagreement_permuted_measured"]
    assert 0.05 < result["disagreement_measured"] < 0.15  # perturb() changes 10% of the routes
    assert result["directory"] == str(tmp_path)
    assert result["dtype"] == "uint8" and result["stored_bytes_per_position_layer"] == 8.0
    assert not list(tmp_path.iterdir())  # the benchmark's files are gone


def test_cli_prints_every_figure_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "trace", "--json", "--sequences", "2", "--positions", "64", "--layers", "2"]
    assert main([*args, "--repeats", "1", "--dir", str(tmp_path)]) == 0
    figures = json.loads(capsys.readouterr().out)
    for name in ("validate", "disagreement", "disagreement_permuted", "save_load", "file_floor"):
        assert figures[f"{name}_vs_copy"] > 0, name


def _figures(median: float, q1: float, q3: float) -> dict[str, Any]:
    """A result of ``bench_trace`` as ``check_against`` reads it, every checked ratio alike."""
    result: dict[str, Any] = {"shape": [8, 2, 8], "num_experts": 128, "threads": 1, "directory": "/d"}
    result.update(cpu="cpu", vector_isa="avx512bw", repeats=9)
    for name in CHECKED_RATIOS:
        result[name], result[f"{name}_quartiles"] = median, [q1, q3]
    return result


@pytest.mark.parametrize(
    ("now", "dropped"),
    [
        ((1.0, 0.9, 1.1), False),  # the same
        ((0.7, 0.6, 0.8), False),  # lower, but within both runs' spread (0.2 + 0.2)
        ((0.55, 0.5, 0.6), True),  # lower by more than the spread (0.1 + 0.2)
        ((0.55, 0.3, 1.2), False),  # as low, in a run too noisy to tell
        ((3.0, 2.0, 4.0), False),  # faster
    ],
)
def test_a_ratio_dropped_when_its_median_fell_by_more_than_both_runs_spread(
    now: tuple[float, float, float], dropped: bool
) -> None:
    recorded = recorded_ratios(_figures(1.0, 0.9, 1.1))
    checks = check_against(_figures(*now), recorded)
    assert [name for name, _, _ in checks] == list(CHECKED_RATIOS)
    assert {flag for _, flag, _ in checks} == {dropped}


def test_the_spread_between_recorded_machines_widens_the_margin_and_record_adds_runs() -> None:
    """Two recorded hosts of one CPU kind at 1.0 and 1.25 (the same code; a copy's speed follows the
    host's memory): a run may sit below the slower by the factor between them (bound 0.8 less the
    noise), and no further. ``recorded_ratios`` with a record keeps its runs and adds this one."""
    recorded = recorded_ratios(_figures(1.25, 1.2, 1.3), recorded_ratios(_figures(1.0, 0.95, 1.05)))
    assert len(recorded["runs"]) == 2
    # bound: 1.0 / 1.25 less this run's quartile range (0.02) and the slower run's (0.1): 0.68
    assert {flag for _, flag, _ in check_against(_figures(0.75, 0.74, 0.76), recorded)} == {False}
    assert {flag for _, flag, _ in check_against(_figures(0.66, 0.65, 0.67), recorded)} == {True}
    # the slower host alone: 1.0 less the same noise, 0.88
    alone = recorded_ratios(_figures(1.0, 0.95, 1.05))
    assert {flag for _, flag, _ in check_against(_figures(0.75, 0.74, 0.76), alone)} == {True}
    with pytest.raises(RecordedRatiosError, match="avx2"):
        recorded_ratios(dict(_figures(1.0, 0.9, 1.1), vector_isa="avx2"), recorded)
    with pytest.raises(RecordedRatiosError, match="threads: this run 2, recorded 1"):
        recorded_ratios(dict(_figures(1.0, 0.9, 1.1), threads=2), recorded)


def test_ratios_recorded_on_another_vector_width_are_not_a_baseline() -> None:
    """A kernel's ratio to a copy belongs to the CPU kind: a record from a CPU with other vector
    instructions is named and not compared (never a drop); one from the same kind is compared."""
    recorded = recorded_ratios(_figures(1.0, 0.9, 1.1))
    slower_kind = dict(_figures(0.5, 0.45, 0.55), vector_isa="avx2")
    reason = not_comparable(slower_kind, recorded)
    assert reason is not None and "avx512bw" in reason and "avx2" in reason
    assert not_comparable(_figures(0.5, 0.45, 0.55), recorded) is None
    assert {dropped for _, dropped, _ in check_against(_figures(0.5, 0.45, 0.55), recorded)} == {True}


def test_record_then_against_compares_the_same_configuration_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--record writes what --against reads; another shape, or a file that is not a record, is a
    usage error (exit 2, one line), never a pass or a drop."""
    recorded = tmp_path / "ratios.json"
    args = ["bench", "trace", "--sequences", "2", "--positions", "64", "--layers", "2", "--repeats", "3"]
    assert main([*args, "--threads", "1", "--dir", str(tmp_path), "--record", str(recorded)]) == 0
    assert set(json.loads(recorded.read_text())["runs"][0]["ratios"]) == set(CHECKED_RATIOS)
    assert main([*args, "--threads", "1", "--dir", str(tmp_path), "--record", str(recorded)]) == 0
    assert len(json.loads(recorded.read_text())["runs"]) == 2
    capsys.readouterr()
    assert main([*args, "--threads", "1", "--dir", str(tmp_path), "--against", str(recorded)]) in (0, 1)
    out = capsys.readouterr().out
    assert all(f" {name}: " in out for name in CHECKED_RATIOS)
    assert main([*args, "--threads", "1", "--dir", str(tmp_path), "--against", str(recorded), "--json"]) in (
        0,
        1,
    )
    checks = json.loads(capsys.readouterr().out)["against"]
    assert [check["ratio"] for check in checks] == list(CHECKED_RATIOS)
    assert main([*args, "--threads", "2", "--dir", str(tmp_path), "--against", str(recorded)]) == 2
    assert capsys.readouterr().err.strip() == (
        "rrh bench: threads: this run 2, recorded 1; expected equal (run with the recorded options, "
        "or record again with --record)"
    )
    recorded.write_text("{}")
    assert main([*args, "--against", str(recorded)]) == 2
    assert capsys.readouterr().err.startswith(f"rrh bench: {recorded}: not a file of recorded ratios")
    assert main([*args, "--threads", "0"]) == 2


@pytest.mark.parametrize("bench", ["trace", "audit"])
def test_a_dir_that_is_not_a_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bench: str
) -> None:
    assert main(["bench", bench, "--dir", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"rrh bench {bench}: --dir {tmp_path / 'missing'}: expected an existing directory"
    )


def test_bench_audit_refuses_fewer_than_one_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "audit", "--dir", str(tmp_path), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip() == "rrh bench audit: --repeats 0; expected at least 1"


@pytest.mark.hf
@pytest.mark.parametrize(
    ("bench", "show", "with_key", "labels"),
    [
        (bench_replay, format_bench_replay, "with_replay_ms", ("without", "armed")),
        (bench_tap, format_bench_tap, "with_tap_ms", ("untapped", "tapped")),
    ],
)
def test_replay_and_tap_benches_time_both_copies_and_say_their_verdict(
    bench: Callable[..., dict[str, Any]], show: Callable[[dict[str, Any]], str], with_key: str,
    labels: tuple[str, str],
) -> None:  # fmt: skip
    """Both benches on a one-layer model: each dtype's medians of the bare and the instrumented copy,
    the ratio judged against the bench's target, and the text naming both."""
    shape = ForwardShape(batch=1, seq=8, layers=1, experts=4, top_k=2, hidden=16)
    result = bench(shape=shape, repeats=2, dtypes=("float32",))
    d = result["dtypes"]["float32"]
    assert d["without_ms"] > 0 and d[with_key] > 0 and d["ratio"] > 0
    assert d["within_target"] == (d["ratio"] <= result["target_ratio"])
    assert result["shape"]["experts"] == 4 and result["repeats"] == 2
    text = show(result)
    assert "1 layers × 4 experts top-2" in text and all(label in text for label in labels)


def test_bench_audit_times_the_serial_audit_both_ways_and_finds_the_planted_faults(tmp_path: Path) -> None:
    """``rrh bench audit`` on a tiny run: the serial audit reading ahead and on one thread give the
    same result, the pool is measured against the one-thread audit, and the projection for idle CPUs
    takes the busiest thread (a serial audit that reads ahead runs two)."""
    from harness.audit.synthetic.generate import RunShape
    from harness.bench.audit import bench_audit, format_bench_audit

    shape = RunShape(
        steps=2, prompts=2, group_size=4, prompt_len=8, response_len=8, layers=4, experts=16, top_k=4
    )
    configs = ("read_floor", "serial", "serial_one_thread", "processes")
    result = bench_audit(64 << 10, tmp_path, shape=shape, configs=configs, memory_bytes=1 << 30)
    assert set(result["ratios"]) == {"serial_vs_floor", "processes_vs_serial_one_thread"}
    assert result["identical_results"] is True
    assert result["faults"] and all(f["found"] for f in result["faults"])
    for name in configs:
        figures = result["configs"][name]
        if figures.get("cpu_busiest_thread_s") is not None:  # Linux
            assert figures["cpu_busiest_thread_s"] <= figures["cpu_busiest_s"] + 0.05
    text = format_bench_audit(result)
    assert "serial_one_thread" in text and "processes_vs_serial_one_thread" in text
    assert not list(tmp_path.iterdir())  # the generated run is deleted
