"""``rrh bench follow``: the memory of ``rrh audit --follow`` over a short and a long run.

Each run is written step by step, a file per step as the tap writes it (``RunWriter`` flushed at
each step end, small steps of the generator's shape), and followed to its last step in a fresh
Python process (``child``), whose peak RSS (``ru_maxrss``) is reported. The follow keeps the
mergeable state and releases every row group it read, so the peak over 1,000 steps stays near the
peak over 10: the ratio is printed, never timed.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.audit.layout.writer import RunWriter
from harness.audit.synthetic.generate import RunShape, step_records

SHAPE = RunShape(prompts=2, group_size=2, prompt_len=16, response_len=16, layers=8, experts=32, top_k=4)
"""A small step (four samples): the run's length, not its width, is what the follow must not grow with."""


def write_steps(directory: Path, steps: int, shape: RunShape = SHAPE) -> None:
    """``steps`` generated steps into ``directory``, one run-layout file per step."""
    with RunWriter(directory, file_bytes=1 << 62) as writer:
        for step in range(steps):
            for record in step_records(shape, step).records:
                writer.write(record)
            writer.flush()


def child(run: str, steps: int) -> None:
    """Follow ``run`` to step ``steps - 1`` in this process; print its figures as one JSON line."""
    from harness.audit.follow.sources import LayoutSource
    from harness.audit.follow.watch import Follow, FollowOptions

    reported: list[int] = []
    done = Follow(LayoutSource(run), on_step=lambda row, _: reported.append(row["step"]), on_finding=print,
                  follow=FollowOptions(poll=0.01, until_step=steps - 1, idle=60)).run()  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"steps": len(reported), "ended": done.ended, "peak_rss": peak,
                      "samples": len(done.state.samples)}))  # fmt: skip


def bench_follow(lengths: tuple[int, ...] = (10, 1000)) -> dict[str, Any]:
    """Peak RSS of a follow of each run length, and the longest's over the shortest's."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rrh-bench-follow-") as tmp:
        for steps in lengths:
            run = Path(tmp) / f"run-{steps}"
            write_steps(run, steps)
            code = f"from harness.bench.follow import child; child({str(run)!r}, {steps})"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"runs": rows, "peak_ratio": rows[-1]["peak_rss"] / rows[0]["peak_rss"]}


def format_bench_follow(result: dict[str, Any]) -> str:
    lines = [f"{r['steps']:>6} steps ({r['samples']} samples): peak RSS {r['peak_rss'] / 2**20:.1f} MiB"
             for r in result["runs"]]  # fmt: skip
    lines.append(f"peak RSS, longest run over shortest: {result['peak_ratio']:.3f}")
    return "\n".join(lines)
