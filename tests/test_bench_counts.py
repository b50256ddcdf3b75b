"""``rrh bench counts``: the count-based performance gate fails a 2× slowdown and nothing else.

The comparison is checked on made-up results (quick); the slow tests count for real under
callgrind (``.ci/run`` runs them in the counts step): a kernel planted to do its work twice moves
past the bound, and counting twice gives the same figures.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.bench import counts
from harness.cli import main

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "fixtures" / "bench" / "instruction-counts.json"


def _result(**per_byte: float) -> dict[str, Any]:
    kernels = {n.replace("_", ".", 1): {"instructions_per_byte": v, "bytes": 1} for n, v in per_byte.items()}
    return {"kind": "x86_64/AVX2", "repeats": 3, "kernels": kernels}


def _record() -> dict[str, Any]:
    return counts.recorded(_result(trace_validate=4.0, audit_agreement=13.0), None)


def test_counts_within_the_bound_pass() -> None:
    checks, note = counts.check_counts(_result(trace_validate=4.4, audit_agreement=12.0), _record())
    assert note is None and [moved for _, moved, _ in checks] == [False, False], checks


def test_a_doubled_count_moves_and_a_halved_one_asks_for_a_new_record() -> None:
    checks, _ = counts.check_counts(_result(trace_validate=8.0, audit_agreement=6.0), _record())
    (slow, moved_slow, seen_slow), (fast, moved_fast, seen_fast) = checks
    assert (slow, moved_slow, fast, moved_fast) == ("trace.validate", True, "audit.agreement", True)
    assert "2.0000× the recorded 4.00" in seen_slow, seen_slow
    assert "faster: record again with --record" in seen_fast, seen_fast


def test_another_cpu_kind_is_named_not_compared() -> None:
    result = _result(trace_validate=8.0)
    result["kind"] = "aarch64/ASIMD"
    checks, note = counts.check_counts(result, _record())
    assert checks == [] and note is not None and "aarch64/ASIMD" in note and "x86_64/AVX2" in note


def test_a_kernel_without_a_record_moves() -> None:
    checks, _ = counts.check_counts(_result(trace_save_load=7.0), _record())
    assert checks == [("trace.save_load", True, "no recorded count: record again with --record")]


@pytest.mark.parametrize(
    ("text", "message"),
    [("{", "not a JSON file"), ('{"format": "other"}', "format: expected 'rrh.instruction_counts'")],
)
def test_a_bad_record_is_a_usage_error_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    bad = tmp_path / "counts.json"
    bad.write_text(text)
    assert main(["bench", "counts", "--against", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rrh bench counts: {bad}: ") and message in err, err


def test_the_committed_record_holds_every_kernel() -> None:
    from harness.bench.count_child import kernel_builders

    doc = counts.load_record(RECORD)
    for kind, entry in doc["kinds"].items():
        assert sorted(entry["instructions_per_byte"]) == sorted(kernel_builders()), kind


needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")


@pytest.mark.slow
@needs_valgrind
def test_a_planted_2x_slowdown_fails_the_gate_and_the_rest_passes() -> None:
    """One kernel of each package doubled: exactly those two move, by 2× (±1%)."""
    names = ["trace.validate", "trace.disagreement", "audit.load_and_digests", "audit.agreement"]
    planted = ["trace.disagreement", "audit.load_and_digests"]
    result = counts.count_kernels(names, repeats=2, double=planted)
    checks, note = counts.check_counts(result, counts.load_record(RECORD))
    assert note is None, note
    moved = {name: seen for name, is_moved, seen in checks if is_moved}
    assert sorted(moved) == sorted(planted), checks
    record = counts.load_record(RECORD)["kinds"][result["kind"]]["instructions_per_byte"]
    for name in planted:
        ratio = result["kernels"][name]["instructions_per_byte"] / record[name]
        assert 1.98 <= ratio <= 2.02, (name, ratio)


@pytest.mark.slow
@needs_valgrind
def test_two_counts_of_one_kernel_agree_to_a_tenth_of_a_percent() -> None:
    first = counts.count_kernels(["audit.agreement"], repeats=1)
    second = counts.count_kernels(["audit.agreement"], repeats=1)
    a = first["kernels"]["audit.agreement"]["instructions_per_byte"]
    b = second["kernels"]["audit.agreement"]["instructions_per_byte"]
    assert abs(a - b) <= 1e-3 * a, json.dumps([first, second])
