"""The trainer side of a run without a tap: megatron-core's router trace joined with the engine's dump.

megatron-core ≥ 0.19 traces every router call (``router_trace.py``; ``harness.audit.importers.
megatron_lm`` reads it): per rank, one record per call with the top-k of each token in the rank's
packed local order, and no sample id or position. This module places every traced row at its
(sample, position, decoder layer) of the engine's dump, through

- the framework's packing of the step, computed by its own functions (verl 0.9.1:
  ``harness.audit.verl_packing``): which dump rows each DP rank's micro-batches hold, in what order,
  at which offsets of the packed (THD) buffer;
- what megatron-core does per rank (``TrainerLayout``): global rank
  ``tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank))`` (its default order ``tp-cp-ep-dp-pp``);
  under context parallelism CP rank ``c`` holds, of each sample padded to ``tp·cp·2``, the zig-zag
  chunks ``c`` and ``2·cp − 1 − c`` of ``2·cp`` (verl's ``preprocess_thd_engine``, the same for
  tokens and replayed routes; ``reference_impl.layouts.cp_zigzag_indices``), samples in packed order;
  under sequence parallelism TP rank ``t`` routes the contiguous rows ``[t·T/tp, (t+1)·T/tp)`` of
  that rank-local buffer (``reference_impl.layouts.sp_shard``);
  PP rank ``p`` holds the decoder layers ``pp_layer_ranges(num_layers, pp)[p]`` and its trace numbers
  them locally (``decoder.layers.<i>`` of its own module).

Each layer's calls of a step come in call order. verl runs the old-log-prob forward first in a
step (``RayPPOTrainer.fit``: before the reference log-probs and the update), so a layer's first calls
are that pass's micro-batches, in order: those are placed and judged (R3 replays the rollout's routes
there). Later calls of the step (reference log-probs, the update's mini-batches with their own
micro-batching, activation recompute inside the backward) are counted, not placed, and said in a note.
A record that cannot be placed (a token count that disagrees with the packing, a layer the stage
does not hold, a rank or step missing, a cell no rank routed) is one ``LayoutError`` naming the
rank, the record (``file:line``) and what disagreed: never a violation.

The joined records carry the engine's routes and the trainer's dispatched routes on the dump's layer
axis, with the replay mode given (``R3``: the audit's ``replay_fidelity`` then judges dispatched ==
engine route on every captured row and MoE layer). A trace row at a sample's last token has no
engine counterpart and is dropped (DESIGN §3.1). MTP heads are not placed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import megatron_lm
from harness.audit.importers import verl as verl_dump
from harness.audit.importers.model_shape import LayerVote, moe_layers_input, num_experts_input
from harness.audit.inputs import time_budget
from harness.audit.layout import LayoutError, SampleRecord
from harness.audit.verl_packing import MicroBatch, VerlBatching, step_packing
from harness.audit.writer import RunWriter
from harness.errors import MegatronReplayError
from harness.trainers.megatron.packed import check_cu_seqlens, packed_slots
from reference_impl.layouts import cp_zigzag_indices, pp_layer_ranges, sp_shard

SOURCE = "verl RolloutSkip gen_batch.dp + megatron-core router trace (rrh audit --trainer-trace)"
NOTES = (
    "trainer routes read from megatron-core's router trace, placed through verl 0.9.1's own packing "
    "(balance, micro-batches, THD) and megatron-core's CP zig-zag, SP slice and PP stages; each step's "
    "first pass (the old-log-prob forward) is judged",
)


@dataclass(frozen=True)
class TrainerLayout:
    """How the traced run was parallelised and batched: megatron-core's sizes and verl's batching."""

    batching: VerlBatching
    pp: int = 1

    @property
    def tp(self) -> int:
        return self.batching.tp

    @property
    def dp(self) -> int:
        return self.batching.dp

    @property
    def cp(self) -> int:
        return self.batching.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates (megatron-core's default order ``tp-cp-ep-dp-pp``)."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))


def parse_layout(text: str) -> TrainerLayout:
    """``tp=2,cp=2,pp=2,dp=1,max_token_len=512`` (or ``micro_batch=2``), ``balance_batch=0`` to turn
    verl's balancing off: the ``--trainer-layout`` of ``rrh audit``."""
    known = {"tp", "cp", "pp", "dp", "max_token_len", "micro_batch", "balance_batch"}
    values: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in known or not value.strip().isdigit():
            raise LayoutError(
                f"--trainer-layout {text!r}: {part!r}; expected NAME=INTEGER with NAME one of {sorted(known)}"
            )
        values[name] = int(value)
    batching = VerlBatching(
        dp=values.get("dp", 1),
        tp=values.get("tp", 1),
        cp=values.get("cp", 1),
        balance_batch=bool(values.get("balance_batch", 1)),
        max_token_len_per_gpu=values.get("max_token_len"),
        micro_batch_size_per_gpu=values.get("micro_batch"),
    )
    pp = values.get("pp", 1)
    if pp < 1:
        raise LayoutError(f"--trainer-layout {text!r}: pp={pp}; expected an integer >= 1")
    return TrainerLayout(batching, pp)


def _slots(
    mb: MicroBatch, layout: TrainerLayout, tp_rank: int, cp_rank: int, where: str
) -> npt.NDArray[np.int64]:
    """``(sample index in mb, position)`` of each row that TP rank ``tp_rank`` of CP rank ``cp_rank``
    routes (``-1`` on filler): each sample's zig-zag chunks of the CP rank, then its SP slice."""
    import torch

    tp, cp = layout.tp, layout.cp
    try:
        align = check_cu_seqlens(
            mb.lengths, torch.tensor([0, *np.cumsum(mb.lengths)]), torch.tensor(mb.cu_seqlens_padded), tp
        )
    except MegatronReplayError as err:
        raise LayoutError(f"{where}: {err}") from None
    slots = packed_slots(mb.lengths, align)
    if cp > 1:
        if align % (2 * tp * cp):
            raise LayoutError(
                f"{where}: cu_seqlens_q_padded {list(mb.cu_seqlens_padded)}; expected each sample padded "
                f"to a multiple of tp·cp·2 = {2 * tp * cp} (verl's zig-zag CP layout)"
            )
        starts, ends = mb.cu_seqlens_padded[:-1], mb.cu_seqlens_padded[1:]
        held = [
            start + cp_zigzag_indices(end - start, cp, cp_rank)
            for start, end in zip(starts, ends, strict=True)
        ]
        slots = slots[torch.cat(held)]
    return (sp_shard(slots, tp, tp_rank) if tp > 1 else slots).numpy()


class _StepJoin:
    """One step: the trainer's routes of every sample in its first pass, filled from the ranks' calls."""

    def __init__(self, step: int, engine: Sequence[SampleRecord], layout: TrainerLayout) -> None:
        self.step, self.engine, self.layout = step, engine, layout
        first = engine[0]
        self.width, self.top_k = int(first.num_layers), int(first.top_k)
        self.moe = tuple(int(x) for x in first.moe_layers)
        if self.width % layout.pp:
            raise LayoutError(
                f"{first.origin}: {self.width} decoder layers (routed_experts); expected a multiple of pp="
                f"{layout.pp} (megatron-core's even split of the layers over the pipeline stages)"
            )
        self.lengths = np.array([len(r.tokens) for r in engine], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        total = int(self.offsets[-1])
        self.routes = np.zeros((total, self.width, self.top_k), dtype=np.int32)
        self.filled = np.zeros((total, self.width), dtype=bool)
        self.later = 0
        """Calls after the first pass (reference log-probs, the update, activation recompute): not placed."""

    def place(
        self,
        rank: int,
        calls: list[megatron_lm.RouterCall],
        plan: list[MicroBatch],
        tp_rank: int,
        pp_rank: int,
        cp_rank: int,
    ) -> None:
        """Place one rank's decoder calls of the step's first pass (``plan``: its DP rank's micro-batches)."""
        tp, cp = self.layout.tp, self.layout.cp
        stage = pp_layer_ranges(self.width, self.layout.pp)[pp_rank][0]
        by_layer: dict[int, list[megatron_lm.RouterCall]] = defaultdict(list)
        for call in calls:
            if call.block == "decoder":
                by_layer[call.layer].append(call)
        held = [layer for layer in self.moe if layer in stage]
        for local, layer_calls in sorted(by_layer.items()):
            layer = stage.start + local
            if layer not in held:
                raise LayoutError(
                    f"{layer_calls[0].where}: rank {rank} (pp rank {pp_rank}, decoder layers "
                    f"{stage.start}-{stage.stop - 1}) traces local layer {local} = decoder layer {layer}; "
                    f"expected one of the MoE layers {held} of the dump that stage holds"
                )
        missing = [layer for layer in held if layer - stage.start not in by_layer]
        if missing:
            raise LayoutError(
                f"rank {rank}: step {self.step} has no record of decoder layer {missing[0]} (local "
                f"{missing[0] - stage.start}); expected every MoE layer of pp rank {pp_rank}: {held}"
            )
        want = [mb.packed_rows // (tp * cp) for mb in plan]
        for local, layer_calls in sorted(by_layer.items()):
            got = [c.num_tokens for c in layer_calls]
            if got[: len(want)] != want:
                bad = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), len(got))
                where = layer_calls[min(bad, len(got) - 1)].where
                what = f"routes {got[bad]} tokens" if bad < len(got) else "is missing"
                raise LayoutError(
                    f"{where}: rank {rank} step {self.step} local layer {local}: record {bad} {what}; "
                    f"expected {want[bad]} (micro-batch {bad} of {len(want)}: verl's packing of dump rows "
                    f"{list(plan[bad].rows)[:8]}, T/(tp·cp) with tp={tp}, cp={cp}; the old-log-prob "
                    f"forward's calls {want})"
                )
            self.later += len(got) - len(want)
            layer = stage.start + local
            for call, mb in zip(layer_calls, plan, strict=False):  # the first pass; later calls counted
                slots = _slots(mb, self.layout, tp_rank, cp_rank, call.where)
                real = slots[:, 0] >= 0
                rows = np.asarray(mb.rows, dtype=np.int64)[slots[real, 0]]
                flat = self.offsets[rows] + slots[real, 1]
                self.routes[flat, layer] = megatron_lm.call_ids(call)[real]
                self.filled[flat, layer] = True

    def records(self, replay: str) -> Iterator[SampleRecord]:
        """The engine's records with the trainer's routes (every cell checked placed)."""
        moe = list(self.moe)
        for b, record in enumerate(self.engine):
            lo, n = int(self.offsets[b]), int(self.lengths[b])
            holes = ~self.filled[lo : lo + n][:, moe]
            if holes.any():
                pos, slot = (int(x) for x in np.argwhere(holes)[0])
                raise LayoutError(
                    f"step {self.step}: no rank routed {record.origin} position {pos} decoder layer "
                    f"{moe[slot]}; expected the trace of every TP, CP and PP rank of its DP rank"
                )
            yield dataclasses.replace(
                record,
                trainer_routes=self.routes[lo : lo + n - 1],
                replay=replay,
                source=SOURCE,
            )


def _engine_step(
    file: Path, experts: int, layers: tuple[int, ...] | None, vote: LayerVote | None
) -> tuple[list[SampleRecord], Any, Any]:
    """One dump file's records, and its ``attention_mask`` and ``response_mask`` (the packing's input)."""
    tensors, non_tensor = verl_dump.read_batch(file)
    found, _ = verl_dump.batch_records(file, experts, layers, vote, read=(tensors, non_tensor))
    return found, tensors["attention_mask"], tensors["response_mask"]


def records(
    dump: Path,
    trace: Path,
    layout: TrainerLayout,
    *,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    replay: str = "R3",
    inferred: list[str] | None = None,
    notes: list[str] | None = None,
) -> Iterator[SampleRecord]:
    """The verl dump's samples, step by step, each with the trainer's dispatched routes from the trace
    (the old-log-prob forward's); how many later router calls were not placed goes to ``notes``.

    Every rank ``0 … tp·cp·dp·pp − 1`` must have a trace file, and each file the dump's steps in order.
    """
    files = verl_dump.dump_files(Path(dump))
    if not files:
        raise LayoutError(f"{dump}: no verl RolloutSkip dump ({{step}}/{verl_dump.FILE_NAME})")
    experts = num_experts_input(num_experts, "verl")
    layers = moe_layers_input(moe_layers)
    vote = LayerVote() if layers is None else None
    ranks = dict(megatron_lm.rank_files(Path(trace)))
    expected = set(range(layout.world_size))
    if set(ranks) != expected:
        odd = sorted(set(ranks) ^ expected)
        raise LayoutError(
            f"{trace}: trace files of ranks {sorted(ranks)}; expected router_trace_rank{{r}}.jsonl for r "
            f"in 0..{layout.world_size - 1} (tp·cp·dp·pp = {layout.tp}·{layout.cp}·{layout.dp}·{layout.pp}), "
            f"rank {odd[0]} "
            "differs"
        )
    streams = {r: megatron_lm.rank_steps(f, r, experts) for r, f in ranks.items()}
    later: dict[int, int] = {}
    for step, file in sorted((verl_dump.step_of(f), f) for f in files):
        with time_budget(file):
            engine, attention, response = _engine_step(file, experts, layers, vote)
        plans = step_packing(attention, response, layout.batching)
        join = _StepJoin(step, engine, layout)
        for pp_rank in range(layout.pp):
            for dp_rank in range(layout.dp):
                for cp_rank in range(layout.cp):
                    for tp_rank in range(layout.tp):
                        rank = layout.rank(dp_rank, tp_rank, pp_rank, cp_rank)
                        calls = _next_step(streams[rank], rank, step, ranks[rank])
                        join.place(rank, calls, plans[dp_rank], tp_rank, pp_rank, cp_rank)
        yield from join.records(replay)
        later[step] = join.later
    for rank, stream in streams.items():
        extra = next(stream, None)
        if extra is not None:
            raise LayoutError(
                f"{extra[1][0].where}: rank {rank} traces step {extra[0]}, which the dump at {dump} does not "
                "hold; expected the trace of the same run (its steps)"
            )
    if vote is not None and inferred is not None:
        inferred.extend(vote.notes())
    if notes is not None and any(later.values()):
        notes.append(
            f"{sum(later.values())} router calls after each step's old-log-prob forward (reference "
            f"log-probs, the update, activation recompute) in {sum(1 for n in later.values() if n)} of "
            f"{len(later)} steps were not placed: only the old-log-prob forward is judged"
        )


def _next_step(stream: Iterator[Any], rank: int, step: int, file: Path) -> list[megatron_lm.RouterCall]:
    """The calls of ``step`` from one rank's stream (its next step); a violation of the trace's own
    rules, or another step, is one ``LayoutError``."""
    found = next(stream, None)
    if found is None:
        raise LayoutError(
            f"{file}: rank {rank} has no records of step {step}; expected every step of the dump"
        )
    got, calls, violations = found
    if violations:
        raise LayoutError(violations[0].line())
    if got != step:
        raise LayoutError(
            f"{calls[0].where}: rank {rank} traces step {got} where the dump's next step is {step}; expected "
            "the dump's steps in order (advance_step(step) with verl's global step)"
        )
    return calls


def import_joined(
    dump: Path, trace: Path, directory: Path, layout: TrainerLayout, **options: Any
) -> list[Path]:
    """``records`` written as the run layout in ``directory``; the files written."""
    with RunWriter(directory) as writer:
        for record in records(dump, trace, layout, **options):
            writer.write(record)
    return writer.files


def import_for_cli(args: Any, dump: Path, directory: str) -> tuple[list[str], list[str]]:
    """``rrh audit DUMP --trainer-trace DIR``: the joined run written to ``directory``; what was
    inferred and the notes, as ``harness.cli.audit_run`` prints them."""
    import sys

    layout = parse_layout(args.trainer_layout)
    print(
        f"importing {dump} as a verl RolloutSkip dump joined with megatron-core's router trace "
        f"{args.trainer_trace} (tp={layout.tp}, cp={layout.cp}, pp={layout.pp}, dp={layout.dp})",
        file=sys.stderr,
    )
    inferred: list[str] = []
    notes = list(NOTES)
    import_joined(
        Path(dump), Path(args.trainer_trace), Path(directory), layout,
        num_experts=args.num_experts, moe_layers=args.moe_layers, inferred=inferred, notes=notes,
    )  # fmt: skip
    return inferred, [f"trainer trace: {note}" for note in notes]
