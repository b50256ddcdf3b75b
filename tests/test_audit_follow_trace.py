"""``harness.audit.follow.trace_tail``: megatron-core's router trace read as the trainer appends it.

A rank's records of a step are handed on only once complete (a later step's record on every rank,
the trace quiet for the settle period, or the run over), a line is read only once its newline is
written, each byte once, and what the trace holds past the dump is an input error. The join of a real
verl 0.9.1 dump followed this way equals the one-shot join: ``tests/test_audit_trainer_trace.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from harness.audit import LayoutError
from harness.audit.follow.sources import DumpSource, DumpStep
from harness.audit.follow.trace_tail import TraceTail
from harness.audit.trace.layout import parse_layout

SETTLE = 5.0


class Clock:
    """A clock the test moves (no sleeps)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(step: int, rank: int, layer: int = 0, tokens: int = 3) -> str:
    """One router call as megatron-core's tracer writes it (a JSON line)."""
    rows = [[(t + layer) % 4, (t + layer + 1) % 4] for t in range(tokens)]
    doc = {"step": step, "block": "decoder", "layer": layer, "rank": rank, "topk": 2,
           "num_tokens": tokens, "top_indices": rows}  # fmt: skip
    return json.dumps(doc) + "\n"


def append(trace: Path, rank: int, text: str) -> None:
    trace.mkdir(exist_ok=True)
    with open(trace / f"router_trace_rank{rank}.jsonl", "a") as handle:
        handle.write(text)


def tail(trace: Path, clock: Clock, layout: str = "dp=2,max_token_len=24") -> TraceTail:
    return TraceTail(trace, parse_layout(layout), 4, SETTLE, clock)


def test_a_step_is_handed_on_once_every_rank_has_moved_past_it_and_a_half_line_is_never_read(
    tmp_path: Path,
) -> None:
    clock, trace = Clock(), tmp_path / "trace"
    followed = tail(trace, clock)
    assert not followed.ready(1)  # nothing written yet, however long
    clock.now += 10 * SETTLE
    assert not followed.ready(1)
    for rank in (0, 1):
        append(trace, rank, record(1, rank) + record(1, rank, layer=1))
    append(trace, 0, record(2, 0)[:25])  # rank 0 is writing step 2's first line
    assert not followed.ready(1), "rank 1 has not moved past step 1"
    append(trace, 0, record(2, 0)[25:])
    assert not followed.ready(1), "rank 1 has still not moved past step 1"
    append(trace, 1, record(2, 1))
    assert followed.ready(1) and not followed.ready(2)
    calls = followed.calls_of(1)
    for rank in (0, 1):
        got = calls(rank)
        assert [(c.step, c.layer, c.rank) for c in got] == [(1, 0, rank), (1, 1, rank)]
        assert [c.where for c in got] == [f"{trace}/router_trace_rank{rank}.jsonl:{n}" for n in (1, 2)]
    clock.now += SETTLE  # the last step: complete once the trace has been quiet for the settle period
    assert followed.ready(2)
    assert not followed.ready(3), "a step no rank traced yet is waited for, however quiet the trace"
    append(trace, 0, record(3, 0))
    clock.now += SETTLE
    assert not followed.ready(3), "rank 1 has not traced step 3"
    assert [c.where for c in followed.calls_of(2)(0)] == [f"{trace}/router_trace_rank0.jsonl:3"]


def test_what_cannot_be_joined_is_one_error_naming_rank_record_and_step(tmp_path: Path) -> None:
    clock, trace = Clock(), tmp_path / "trace"
    followed = tail(trace, clock)
    append(trace, 0, record(1, 0) + record(3, 0))
    append(trace, 1, record(2, 1) + record(3, 1))
    assert followed.ready(1)
    calls = followed.calls_of(1)
    assert calls(0)[0].step == 1
    with pytest.raises(LayoutError, match=r"router_trace_rank1.jsonl:1: rank 1 traces step 2 where"):
        calls(1)
    held = tmp_path / "dump"
    assert followed.leftover(held) == [
        f"{trace}/router_trace_rank{r}.jsonl:2: rank {r} traces step 3, which the dump at {held} does not "
        "hold; expected the trace of the same run (its steps)"
        for r in (0, 1)
    ]
    broken = tail(tmp_path / "broken", clock, layout="tp=1,max_token_len=24")
    append(tmp_path / "broken", 0, record(1, 0) + '{"step": 1, "block": "encoder"}\n')
    assert broken.ready(1), "a trace in error is handed on: the step's import names the error"
    with pytest.raises(LayoutError, match=r"router_trace_rank0.jsonl:2: field 'block' is 'encoder'"):
        broken.calls_of(1)


def test_a_dump_step_waits_for_its_trace_records(tmp_path: Path) -> None:
    clock, dump = Clock(), tmp_path / "dump"
    for step in (1, 2):
        (dump / str(step)).mkdir(parents=True)
        (dump / str(step) / "gen_batch.dp").write_bytes(b"")
    trace_ready: dict[int, bool] = {1: False}
    imported: list[int] = []

    def import_step(step: DumpStep, into: Path, errors: list[str]) -> list[Any]:
        imported.append(int(step.entry.parent.name))
        return []

    source = DumpSource("verl", dump, tmp_path / "run", import_step, SETTLE, clock,
                        ready=lambda step, final: final or trace_ready.get(step, False))  # fmt: skip
    source.poll()
    assert imported == [], "step 1's dump is complete (step 2 appeared) but not its trace records"
    trace_ready[1] = True
    source.poll()
    assert imported == [1]
    source.poll(final=True)
    assert imported == [1, 2]


def test_a_trace_already_written_is_read_only_up_to_the_step_asked_for(tmp_path: Path) -> None:
    clock, trace = Clock(), tmp_path / "trace"
    for rank in (0, 1):
        append(trace, rank, "".join(record(step, rank) for step in range(1, 101)))
    followed = tail(trace, clock)
    assert followed.ready(1)
    held = {rank: [step for step, _ in t.chunks] for rank, t in followed._ranks.items()}
    assert held == {0: [1, 2], 1: [1, 2]}, "a step in flight per rank, not the whole trace"
    calls = followed.calls_of(1)
    assert [calls(rank)[0].step for rank in (0, 1)] == [1, 1]
    assert followed.ready(2) and [s for s, _ in followed._ranks[0].chunks] == [2, 3]
