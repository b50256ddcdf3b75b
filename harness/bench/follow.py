"""``rrh bench follow``: the memory of ``rrh audit --follow`` over a short and a long run.

Each run is written while it is followed, in one fresh Python process (``child``): a file per step as
the tap writes it (``RunWriter`` flushed at each step end; a step of the generator's shape), step
k + 2 written as soon as step k is reported, so the follow always has a step in flight, as beside a
training run. The child's peak RSS (``ru_maxrss``) is reported. The follow keeps the mergeable
state, seals each reported step (its expert load folded into the run's) and releases every row
group it read, so the peak over 1,000 steps stays near the peak over 10: the ratio is printed,
never timed.
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.audit.layout.writer import RunWriter
from harness.audit.synthetic.generate import RunShape, step_records

SHAPE = RunShape(prompts=2, group_size=2, prompt_len=16, response_len=16, layers=16, experts=256, top_k=8)
"""A small step (four samples) of a wide router (256 experts, as DeepSeek-V3's): the run's length, not
its width, is what the follow must not grow with; a step's expert load is 16 × 256 counts."""


def write_step(writer: RunWriter, step: int, shape: RunShape = SHAPE) -> None:
    """Generated step ``step`` as one run-layout file."""
    for record in step_records(shape, step).records:
        writer.write(record)
    writer.flush()


def child(run: str, steps: int) -> None:
    """Write and follow a run of ``steps`` steps in this process; print its figures as one JSON line."""
    from harness.audit.follow.sources import LayoutSource
    from harness.audit.follow.watch import Follow, FollowOptions

    reported: list[int] = []
    with RunWriter(run, file_bytes=1 << 62) as writer:
        for step in range(min(2, steps)):
            write_step(writer, step)

        def on_step(row: dict[str, Any], _: Any) -> None:
            reported.append(row["step"])
            if row["step"] + 2 < steps:  # the next step the run would write
                write_step(writer, row["step"] + 2)

        # Without manifests a step is complete once a later one is seen; the last once the run is idle.
        done = Follow(LayoutSource(run), on_step=on_step, on_finding=print,
                      follow=FollowOptions(poll=0.01, until_step=steps - 1, idle=1)).run()  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    gc.collect()
    with open("/proc/self/statm") as statm:  # resident pages now, the state held at the end
        resident = int(statm.read().split()[1]) * resource.getpagesize()
    print(json.dumps({"steps": len(reported), "ended": done.ended, "peak_rss": peak, "end_rss": resident,
                      "samples": len(done.state.samples)}))  # fmt: skip


def bench_follow(lengths: tuple[int, ...] = (10, 1000)) -> dict[str, Any]:
    """Peak RSS of a follow of each run length, and the longest's over the shortest's."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rrh-bench-follow-") as tmp:
        for steps in lengths:
            run = Path(tmp) / f"run-{steps}"
            code = f"from harness.bench.follow import child; child({str(run)!r}, {steps})"
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"runs": rows, "peak_ratio": rows[-1]["peak_rss"] / rows[0]["peak_rss"],
            "end_ratio": rows[-1]["end_rss"] / rows[0]["end_rss"]}  # fmt: skip


def format_bench_follow(result: dict[str, Any]) -> str:
    lines = [f"{r['steps']:>6} steps ({r['samples']} samples): peak RSS {r['peak_rss'] / 2**20:.1f} MiB, "
             f"resident at the end {r['end_rss'] / 2**20:.1f} MiB" for r in result["runs"]]  # fmt: skip
    lines.append(f"longest run over shortest: peak RSS {result['peak_ratio']:.3f}, resident at the end "
                 f"{result['end_ratio']:.3f}")  # fmt: skip
    return "\n".join(lines)
