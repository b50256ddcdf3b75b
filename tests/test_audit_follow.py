"""``rrh audit --follow`` (``harness.audit.follow``): a run audited while a writer writes it.

- the tap's writer (``BackgroundWriter``, what ``rrh run`` taps through) writes ten generated steps;
  the follow reports each step before the next is written (the tap's manifest says it is complete),
  and its result equals the one-shot audit of the finished run;
- a fault planted at step 3 of 10 stops ``fail_fast`` at step 3 with its place, before step 4
  exists; a fault every sample shares (a detector's suspicion) stops nothing;
- ``rrh audit --follow`` on a SkyRL dump folder that a script fills step by step: a line per step,
  each violation passed to ``--on-violation`` as JSON, the series in ``--summary`` and in TensorBoard
  event files, the HTML page saying the step it is at, and the same JSON report as the one-shot audit.

The writers and the follow hand over with events (no sleep): a writer writes step k + 1 once the
follow has reported step k.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.audit import audit_run
from harness.audit.follow.sources import LayoutSource
from harness.audit.follow.watch import Follow, FollowOptions
from harness.audit.result.audit_result import AuditResult
from harness.audit.synthetic.generate import RunShape, step_records
from harness.audit.tap.trainer import BackgroundWriter
from tests.audit_transcript import check, normalise

SHAPE = RunShape(
    steps=10, prompts=2, group_size=2, prompt_len=8, response_len=8, layers=4, experts=16, top_k=2
)
HANDOVER_SECONDS = 120.0
"""How long a writer waits for the follow to report a step before it calls the follow hung."""
SAME = ("invariants", "steps", "layers", "worst", "drift", "rows", "sources")
"""The parts of a result a followed run and the one-shot audit of the finished run share exactly (the
imported run layout's own file count and bytes differ: one file per step against one for the run)."""


class TapWriter(threading.Thread):
    """Writes ``SHAPE.steps`` generated steps through the tap's writer, step k + 1 only once the follow
    has reported step k (``reported``); ``faults``: what to plant at ``FAULT_STEP``."""

    def __init__(self, run: Path, faults: tuple[str, ...] = ()) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.faults = run, faults
        self.reported: dict[int, threading.Event] = {s: threading.Event() for s in range(SHAPE.steps)}
        self.written = -1
        self.planted: list[Any] = []
        self.stop = threading.Event()
        self.hung = False

    def run(self) -> None:
        with BackgroundWriter(self.run_dir) as tap:
            for step in range(SHAPE.steps):
                records = step_records(SHAPE, step, seed=7, faults=self.faults if step == FAULT_STEP else ())
                self.planted += records.planted
                for record in records.records:
                    tap.put(record)
                tap.end_step(step)
                tap._queue.join()  # the step's file and manifest are on disk
                self.written = step
                if not self.reported[step].wait(HANDOVER_SECONDS) or self.stop.is_set():
                    self.hung = not self.stop.is_set()
                    return


FAULT_STEP = 3
RRH = (sys.executable, "-c", "import sys; from harness.cli import main; sys.exit(main())")
"""``rrh`` in this interpreter (the entry point's own call)."""


def _follow(run: Path, writer: TapWriter, **options: Any) -> tuple[Any, list[tuple[int, int]], list[dict]]:
    """Follow ``run`` while ``writer`` writes it: the follow, (step reported, the writer's last step then)
    and the findings."""
    seen: list[tuple[int, int]] = []
    findings: list[dict[str, Any]] = []

    def on_step(row: dict[str, Any], layers: list[dict[str, Any]]) -> None:
        seen.append((row["step"], writer.written))
        writer.reported[row["step"]].set()

    follow = Follow(LayoutSource(run), on_step=on_step, on_finding=findings.append,
                    follow=FollowOptions(poll=0.02, idle=HANDOVER_SECONDS, **options))  # fmt: skip
    writer.start()
    try:
        done = follow.run()
    finally:
        writer.stop.set()
        for event in writer.reported.values():
            event.set()
        writer.join(HANDOVER_SECONDS)
    assert not writer.hung, "the follow did not report a step the tap had finished"
    return done, seen, findings


def same_result(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert that two audit results (``as_dict``, or the JSON report) agree on every part in ``SAME``."""
    for key in SAME:
        assert a[key] == b[key], key


def test_each_tapped_step_is_reported_before_the_next_and_the_result_equals_the_one_shot_audit(
    tmp_path: Path,
) -> None:
    writer = TapWriter(tmp_path / "run")
    done, seen, findings = _follow(tmp_path / "run", writer, until_step=SHAPE.steps - 1)
    assert done.ended == "until-step"
    assert seen == [(s, s) for s in range(SHAPE.steps)]  # step s reported while s was the last written
    assert not findings
    once = audit_run(tmp_path / "run", executor="serial")
    same_result(AuditResult.of(done.state).as_dict(), once.as_dict())
    assert AuditResult.of(done.state).samples == once.samples
    assert not once.violated and len(once.samples) == SHAPE.steps * SHAPE.prompts * SHAPE.group_size
    sealed = [done.state.steps[s] for s in done.reported]  # each step's expert load folded into the run's
    assert all(f.load is None and f.load_imbalance is not None for f in sealed)
    assert done.state.sealed_load is not None and int(done.state.sealed_load.sum()) > 0


def test_a_fault_at_step_3_stops_fail_fast_at_step_3_with_its_place(tmp_path: Path) -> None:
    writer = TapWriter(tmp_path / "run", faults=("all_zero_layer",))
    done, seen, findings = _follow(tmp_path / "run", writer, fail_fast=True)
    assert done.ended == "fail-fast"
    assert [s for s, _ in seen] == [0, 1, 2] and writer.written == FAULT_STEP  # step 4 never written
    (planted,) = writer.planted
    # An all-zero layer breaks moe_layer_nonzero, and ids_valid too (a row of top-k equal ids).
    assert {(f["step"], f["sample_key"]) for f in findings} == {(FAULT_STEP, planted.sample_key)}
    (found,) = [f for f in findings if f["invariant"] == planted.invariant]
    assert found["layer"] == planted.layer
    assert found["format"] == "rrh-audit-finding/1" and found["violated"] == 1


def test_a_shared_fault_is_a_suspicion_that_stops_nothing(tmp_path: Path) -> None:
    writer = TapWriter(tmp_path / "run", faults=("shared_layer_copy",))
    done, _, findings = _follow(tmp_path / "run", writer, fail_fast=True, until_step=SHAPE.steps - 1)
    assert done.ended == "until-step" and not findings
    result = AuditResult.of(done.state)
    assert [r.name for r in result.suspected] == ["copied_layers"] and not result.violated


# --- rrh audit --follow on a SkyRL dump folder filled step by step ---------------------------------


def _lines(process: subprocess.Popen[str]) -> Iterator[str]:
    assert process.stdout is not None
    for line in process.stdout:
        yield line.rstrip("\n")


def _scalars(folder: Path) -> dict[str, dict[int, float]]:
    """Every scalar in the TensorBoard event files of ``folder``: TFRecords of ``Event`` protos."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_rrh_audit_follows_a_skyrl_dump_copied_step_by_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    from tests.test_audit_import_frameworks import E, _skyrl_synthetic, plant, rollout

    steps = {step: rollout(step) for step in range(8)}
    faults = plant(steps[FAULT_STEP], long_payload=False)
    _skyrl_synthetic(tmp_path / "staged", steps, {})
    staged = sorted((tmp_path / "staged" / "dumped_data").iterdir(), key=lambda p: int(p.name.split("_")[2]))
    export = tmp_path / "export" / "dumped_data"
    export.mkdir(parents=True)
    found = tmp_path / "findings.jsonl"
    hook = f"{sys.executable} -c \"import sys; open({str(found)!r}, 'a').write(sys.stdin.read() + '\\n')\""
    command = [
        *RRH, "audit", str(tmp_path / "export"), "--follow", "--from", "skyrl",
        "--num-experts", str(E), "--until-step", "7", "--settle", "1", "--poll", "0.05", "--idle", "120",
        "--on-violation", hook, "--json", str(tmp_path / "follow.json"),
        "--html", str(tmp_path / "page.html"), "--summary", str(tmp_path / "summary"),
        "--tensorboard", str(tmp_path / "tb"), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines = _lines(process)
    printed: list[str] = []
    try:
        for k, file in enumerate(staged):
            shutil.copy(file, export / f".{file.name}.part")  # the script's own copy, renamed when whole
            os.replace(export / f".{file.name}.part", export / file.name)
            if k == 0:
                continue
            for line in lines:  # step k - 1 is complete now that step k has appeared
                printed.append(line)
                if line.startswith(f"step {k - 1}:"):
                    break
            assert printed[-1].startswith(f"step {k - 1}:"), printed
            if k == 5:  # the page written after the previous step's poll, while the run goes on
                live = (tmp_path / "page.html").read_text()
        printed += list(lines)
    finally:
        process.wait(HANDOVER_SECONDS)
    assert process.returncode == 1, printed  # the planted violations
    shown = f"$ rrh audit experiment --follow --from skyrl --num-experts {E} --until-step 7"
    check(
        "follow_skyrl",
        normalise(
            "\n".join([shown, *printed]) + "\n", {str(tmp_path / "export"): "<DUMP>", str(tmp_path): "<TMP>"}
        ),
    )
    step_lines = [line for line in printed if line.startswith("step ")]
    assert [int(line.split()[1].rstrip(":")) for line in step_lines] == list(range(8))
    assert "1 violating sample" not in step_lines[0] and "violating samples" in step_lines[FAULT_STEP]
    assert any(
        line.startswith("VIOLATED moe_layer_nonzero at step 3 sample 0 row 0 layer 2") for line in printed
    )
    findings = [json.loads(text) for text in found.read_text().split("\n") if text]
    assert {f["invariant"] for f in findings} == {inv for inv, *_ in faults}
    assert all(f["step"] == FAULT_STEP for f in findings)
    series = sorted((tmp_path / "summary" / "series").glob("steps-*.parquet"))
    assert len(series) == 8
    scalars = _scalars(tmp_path / "tb")
    assert sorted(scalars["rrh/violations"]) == list(range(8)) and scalars["rrh/violations"][FAULT_STEP] > 0
    assert any(f"following the run: at step {s} (page written" in live for s in (3, 4)), live
    assert 'http-equiv="refresh"' in live
    page = (tmp_path / "page.html").read_text()
    assert "followed 8 steps; ended: step 7 complete" in page and "refresh" not in page
    once = subprocess.run(
        [*RRH, "audit", str(tmp_path / "export"), "--from", "skyrl",
         "--num-experts", str(E), "--json", str(tmp_path / "once.json"), "--executor", "serial"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert once.returncode == 1, once.stderr
    same_result(
        json.loads((tmp_path / "follow.json").read_text()), json.loads((tmp_path / "once.json").read_text())
    )


def test_follow_only_options_are_refused_without_follow(tmp_path: Path) -> None:
    from harness.cli import main

    assert main(["audit", str(tmp_path), "--fail-fast"]) == 2


@pytest.mark.slow
def test_following_1000_steps_peaks_within_a_tenth_of_following_10() -> None:
    from harness.bench.follow import bench_follow, format_bench_follow

    result = bench_follow((10, 1000))
    print(format_bench_follow(result))  # what is resident at the end too (measured, docs/audit.md)
    assert [r["steps"] for r in result["runs"]] == [10, 1000]
    assert result["peak_ratio"] <= 1.10, result


def test_a_dump_folder_not_written_yet_is_waited_for(tmp_path: Path) -> None:
    from harness.cli import main

    assert main(["audit", str(tmp_path / "later"), "--follow", "--from", "skyrl", "--num-experts", "16",
                 "--idle", "0.2", "--poll", "0.05"]) == 2  # fmt: skip  # nothing came: nothing audited
