"""megatron-core's router trace followed beside a verl dump (``rrh audit DUMP --follow --trainer-trace
DIR``): each rank's ``router_trace_rank{r}.jsonl`` read as it grows, a step's records handed to the
join (``harness.audit.trace.join.join_step``) once they are complete.

The tracer appends whole lines (one JSON record per router call, a step's records together at its
``advance_step`` flush), so a line is read only once its newline is on disk, never half-written, each
whole line once, and a rank only up to its first record past the step asked for. A rank's records of
step N are complete once that rank has written a record of a later step, or has written step N's and
then no trace file changed for ``settle`` seconds (the last step's flush), or when the run is over. A
step no rank has traced yet is waited for, however long the trace is quiet: the trainer traces step N
after the rollout dumped it. What is held is the records not yet joined, a step in flight per rank,
never the whole trace, even when the follow starts on a trace already written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from harness.audit.importers import megatron_lm
from harness.audit.importers import verl as verl_dump
from harness.audit.importers.megatron_calls import RouterCall, parse_call
from harness.audit.importers.model_shape import LayerVote, moe_layers_input, num_experts_input
from harness.audit.layout.inputs import decode_utf8, glob, open_regular
from harness.audit.layout.schema import LayoutError
from harness.audit.layout.writer import RunWriter
from harness.audit.trace import join
from harness.audit.trace.join import next_step, not_in_dump
from harness.audit.trace.layout import TrainerLayout, parse_layout, trace_ranks


class _RankTail:
    """One rank's trace file: the offset read up to, the line count, the steps' records not taken."""

    def __init__(self, rank: int, file: Path) -> None:
        self.rank, self.file = rank, file
        self.offset, self.line = 0, 0
        self.top_k: int | None = None
        self.chunks: list[tuple[int, list[RouterCall]]] = []  # runs of one step's records, in order
        self.latest: int | None = None  # the step of the last record read

    def read(self, final: bool, until: int | None = None) -> None:
        """Read the lines completed since the last read (``final``: an unterminated last line too), line
        by line, stopping once a record of a step after ``until`` is read (``None``: to the end)."""
        with open_regular(self.file) as handle:
            handle.seek(self.offset)
            while until is None or self.latest is None or self.latest <= until:
                raw = handle.readline()
                if not raw or (not raw.endswith(b"\n") and not final):
                    break  # the end, or a line still being written: read it once it is whole
                self.offset += len(raw)
                self.line += 1
                where = f"{self.file}:{self.line}"
                call = parse_call(decode_utf8(raw, where), where)
                if call is None:
                    continue
                self.top_k = call.topk if self.top_k is None else self.top_k
                if self.chunks and self.chunks[-1][0] == call.step:
                    self.chunks[-1][1].append(call)
                else:
                    self.chunks.append((call.step, [call]))
                self.latest = call.step

    def steps(self, num_experts: int | None) -> Iterator[tuple[int, list[RouterCall], list[Any]]]:
        """The runs of records not taken, each taken as it is yielded, as ``megatron_lm.rank_steps``."""
        while self.chunks:
            step, calls = self.chunks.pop(0)
            yield step, calls, megatron_lm.step_violations(calls, self.rank, self.top_k, num_experts)


class TraceTail:
    """The trace directory ``trace`` of a run laid out as ``layout``, being written."""

    def __init__(
        self,
        trace: Path,
        layout: TrainerLayout,
        num_experts: int | None,
        settle: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.trace, self.layout, self.num_experts = trace, layout, num_experts
        self.settle, self.clock = settle, clock
        self._ranks: dict[int, _RankTail] = {}
        self._signature: tuple[Any, ...] = ()
        self._changed = clock()
        self._error: LayoutError | None = None

    def _read(self, final: bool, until: int | None = None) -> None:
        """Read every rank's new lines up to its first record after step ``until`` (``None``: all); a
        trace that cannot be read is kept as the next step's error."""
        if self._error is not None:
            return
        try:
            if not self.trace.is_dir() or not glob(self.trace, "router_trace_rank*.jsonl"):
                return  # not written yet
            for rank, file in megatron_lm.rank_files(self.trace):
                self._ranks.setdefault(rank, _RankTail(rank, file)).read(final, until)
        except LayoutError as err:
            self._error = err
        signature = tuple((r, t.offset) for r, t in sorted(self._ranks.items()))
        if signature != self._signature:
            self._signature, self._changed = signature, self.clock()

    def ready(self, step: int, final: bool = False) -> bool:
        """Whether every rank's records of ``step`` are complete (or the trace is in error: the step's
        import then says so). Each rank is read only up to its first record past ``step``."""
        self._read(final, step)
        if final or self._error is not None:
            return True
        quiet = self.clock() - self._changed >= self.settle

        def done(rank: int) -> bool:  # moved past the step, or wrote it and then nothing for settle s
            tail = self._ranks.get(rank)
            latest = None if tail is None else tail.latest
            return latest is not None and (latest > step or (latest == step and quiet))

        return all(done(r) for r in range(self.layout.world_size))

    def calls_of(self, step: int) -> Callable[[int], list[RouterCall]]:
        """Each rank's records of ``step``, taken (the join's ``calls_of``); a trace in error, a
        missing rank or a rank whose next step is another is one ``LayoutError``."""
        if self._error is not None:
            raise self._error
        files = trace_ranks(self.trace, self.layout)

        def calls(rank: int) -> list[RouterCall]:
            tail = self._ranks.setdefault(rank, _RankTail(rank, files[rank]))
            return next_step(tail.steps(self.num_experts), rank, step, files[rank])

        return calls

    def leftover(self, dump: Path) -> list[str]:
        """The input errors of what the trace holds beyond the dump's steps, at the end of the run (each
        rank read up to its first such record)."""
        for tail in self._ranks.values():
            if not tail.chunks:  # read on to its next record, if any
                tail.read(True, -1 if tail.latest is None else tail.latest)
        return [
            not_in_dump(tail.chunks[0][1][0].where, rank, tail.chunks[0][0], dump)
            for rank, tail in sorted(self._ranks.items())
            if tail.chunks
        ]


class TracedImport:
    """The follow's import of one verl step joined with its trace records (``DumpSource``'s
    ``import_step``; ``ready`` its gate): the same records, notes and inferences as the one-shot
    ``rrh audit DUMP --trainer-trace DIR``."""

    def __init__(self, args: Any, settle: float) -> None:
        self.layout = parse_layout(args.trainer_layout)
        self.experts = num_experts_input(args.num_experts, "verl")
        self.layers = moe_layers_input(args.moe_layers)
        self.vote = LayerVote() if self.layers is None else None
        self.tail = TraceTail(Path(args.trainer_trace), self.layout, self.experts, settle)
        self.later: dict[int, int] = {}

    def ready(self, step: int, final: bool) -> bool:
        """Whether the trace's records of ``step`` are complete."""
        return self.tail.ready(step, final)

    def __call__(self, step: Any, into: Path, errors: list[str]) -> list[Path]:
        """Join the ``DumpStep`` ``step`` with its trace records into the run layout at ``into``."""
        number = verl_dump.step_of(step.entry)
        joined, self.later[number] = join.join_step(
            number, step.entry, self.tail.calls_of(number), self.layout, self.experts, self.layers, self.vote
        )
        with RunWriter(into) as writer:
            for record in joined:
                writer.write(record)
        return writer.files

    def notes(self) -> list[str]:
        """The one-shot join's notes (``trainer trace: …``)."""
        notes = list(join.NOTES if self.layout.replay == "R3" else join.NOTES_R2)
        if (later := join.later_note(self.later)) is not None:
            notes.append(later)
        return [f"trainer trace: {note}" for note in notes]

    def inferred(self) -> list[str]:
        """What was inferred from the dump (the MoE layers, when not given)."""
        return [] if self.vote is None else self.vote.notes()
