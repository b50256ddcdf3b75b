"""``rrh bench trace`` measures what it says, on a small trace (its figures are never asserted: they
are throughputs of this machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.bench import bench_trace
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


def test_a_dir_that_is_not_a_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "trace", "--dir", str(tmp_path / "missing")]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"rrh bench trace: --dir {tmp_path / 'missing'}: expected an existing directory"
    )
