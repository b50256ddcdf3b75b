"""The trainer side of a run without a tap: megatron-core's router trace joined with the engine's dump.

megatron-core ≥ 0.19 traces every router call (``router_trace.py``; ``harness.audit.importers.
megatron_lm`` reads it): per rank, one record per call with the top-k of each token in the rank's
packed local order, and no sample id or position. This module places every traced row at its
(sample, position, decoder layer) of the engine's dump, through

- the framework's packing of the step, computed by its own functions (verl 0.9.1:
  ``harness.audit.trace.verl_packing``): which dump rows each DP rank's micro-batches hold, in what order,
  at which offsets of the packed (THD) buffer;
- what megatron-core does per rank (``harness.audit.trace.layout``): global rank
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
are that pass's micro-batches, in order; those are placed. What is judged depends on the run's
replay mode (``TrainerLayout.replay``, ``replay=`` in ``--trainer-layout``):

- **R3** (the default): the old-log-prob forward replays the rollout's routes, so its routes are the
  ``trainer_routes`` and the audit's ``replay_fidelity`` judges dispatched == engine route on every
  captured row and MoE layer. Later calls of the step (reference log-probs, the update's
  mini-batches, activation recompute inside the backward) are counted, not placed, and said in a note.
- **R2**: the old-log-prob forward records (``RouterReplay`` RECORD) and every update forward replays
  that recording, so the old-log-prob forward's routes are the ``recorded_routes`` and the update's
  are the ``trainer_routes``: ``replay_fidelity`` judges update dispatched == recorded, per row and
  MoE layer. After the old-log-prob forward a layer's calls must be exactly the update's forwards, in
  the order verl's own ``update_packing`` gives (mini-batches over the epochs, each micro-batched),
  placed by ``harness.audit.trace.update``; a sample forwarded in several epochs is judged by its first
  update forward that differs from the recording (else its first). A reference pass on the actor's
  model or activation recompute (a router firing again in the backward) adds calls the R2 join does
  not place: refused as an input error, never guessed. A verl R2 run's dump holds no
  ``routed_experts`` (its rollout returns none): its samples are then read with stand-in routes that
  never reach the records (``top_k`` from the trace, the layers from ``--moe-layers``), so the joined
  records carry no engine routes.

A record that cannot be placed (a token count that disagrees with the packing, a layer the stage
does not hold, a rank or step missing, a cell no rank routed) is one ``LayoutError`` naming the
rank, the record (``file:line``) and what disagreed: never a violation.

The joined records carry the engine's routes and the trainer's routes on the dump's layer axis,
with the replay mode. A trace row at a sample's last token has no engine counterpart and is dropped
(DESIGN §3.1). MTP heads are not placed.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import megatron_calls, megatron_lm
from harness.audit.importers import verl as verl_dump
from harness.audit.importers.model_shape import LayerVote, moe_layers_input, num_experts_input
from harness.audit.layout.inputs import time_budget
from harness.audit.layout.schema import LayoutError, SampleRecord, shown
from harness.audit.layout.writer import RunWriter
from harness.audit.trace.layout import TrainerLayout, parse_layout, placed, trace_ranks
from harness.audit.trace.update import UpdatePasses
from harness.audit.trace.verl_packing import MicroBatch, step_packing, update_packing
from reference_impl.layouts import pp_layer_ranges

__all__ = ["TrainerLayout", "import_for_cli", "import_joined", "parse_layout", "records"]

SOURCE = "verl RolloutSkip gen_batch.dp + megatron-core router trace (rrh audit --trainer-trace)"
_PLACED = (
    "trainer routes read from megatron-core's router trace, placed through verl 0.9.1's own packing "
    "(balance, micro-batches, THD{update}) and megatron-core's CP zig-zag, SP slice and PP stages; "
)
NOTES = (_PLACED.format(update="") + "each step's first pass (the old-log-prob forward) is judged",)
NOTES_R2 = (
    _PLACED.format(update="; the update's mini-batches over the epochs")
    + "R2: each step's old-log-prob forward is the recording, every update forward is judged against it "
    "(a sample's first differing update forward is the one shown)",
)
_DROPPED = (
    "; in the update a call may be missing or extra: megatron-core's tracer skips a call whose routing map "
    "gives a token other than top_k experts (a replay target with a repeated id, such as the zero rows "
    "verl 0.9.1's R2 replays on the rows THD pads each sample with under TP or CP), and activation "
    "recompute (a router firing again in the backward) or a reference pass on the actor's model adds "
    "calls the R2 join does not place"
)


class _StepJoin:
    """One step: the trainer's routes of every sample in the old-log-prob forward (and, under R2, in
    each update forward), filled from the ranks' calls."""

    def __init__(
        self,
        step: int,
        engine: Sequence[SampleRecord],
        layout: TrainerLayout,
        update: list[list[MicroBatch]] | None = None,
    ) -> None:
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
        self.update = (
            None
            if update is None
            else UpdatePasses(update, len(engine), self.offsets, (self.width, self.top_k))
        )
        self.later = 0
        """R3: calls after the old-log-prob forward (reference log-probs, update, recompute): not placed."""

    def place(
        self,
        rank: int,
        calls: list[megatron_calls.RouterCall],
        plan: list[MicroBatch],
        coordinates: tuple[int, int, int, int],
    ) -> None:
        """Place one rank's decoder calls of the step (``plan``: its DP rank's old-log-prob
        micro-batches; ``coordinates``: its DP, TP, PP and CP rank)."""
        dp_rank, tp_rank, pp_rank, cp_rank = coordinates
        stage = pp_layer_ranges(self.width, self.layout.pp)[pp_rank][0]
        by_layer: dict[int, list[megatron_calls.RouterCall]] = defaultdict(list)
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
        update = [] if self.update is None else self.update.plans[dp_rank]
        for local, layer_calls in sorted(by_layer.items()):
            self._expect(rank, local, layer_calls, plan, update)
            self.later += len(layer_calls) - len(plan) if self.update is None else 0
            layer = stage.start + local
            for call, mb in zip(layer_calls, plan, strict=False):  # R3: later calls counted
                flat, _, ids = placed(call, mb, self.layout, tp_rank, cp_rank, self.offsets)
                self.routes[flat, layer] = ids
                self.filled[flat, layer] = True
            if self.update is not None:
                self.update.place(layer_calls[len(plan) :], layer, self.layout, (dp_rank, tp_rank, cp_rank))

    def _expect(
        self,
        rank: int,
        local: int,
        layer_calls: list[megatron_calls.RouterCall],
        plan: list[MicroBatch],
        update: Sequence[MicroBatch],
    ) -> None:
        """One layer's calls of a rank against verl's packing: the old-log-prob forward's micro-batches
        first; under R2 then exactly the update's forwards. Otherwise one ``LayoutError`` naming the
        first record that disagrees."""
        tp, cp = self.layout.tp, self.layout.cp
        expected = [*plan, *update]
        want = [mb.packed_rows // (tp * cp) for mb in expected]
        got = [c.num_tokens for c in layer_calls]
        if got[: len(want)] == want and (self.update is None or len(got) == len(want)):
            return
        bad = next(
            (i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), min(len(got), len(want))
        )
        head = f"rank {rank} step {self.step} local layer {local}: record {bad}"
        if bad == len(want):  # R2: calls after the update's last forward
            raise LayoutError(
                f"{layer_calls[bad].where}: {head} routes {got[bad]} tokens after the update's last forward; "
                f"expected {len(plan)} old-log-prob and {len(update)} update calls (verl's packing): a "
                "reference pass on the actor's model or activation recompute (a router firing again in the "
                "backward), which the R2 join does not place"
            )
        where = layer_calls[min(bad, len(got) - 1)].where
        what = f"routes {got[bad]} tokens" if bad < len(got) else "is missing"
        hint = _DROPPED if bad >= len(got) or bad >= len(plan) else ""
        mb = expected[bad]
        if bad < len(plan):
            which = f"micro-batch {bad} of {len(plan)}"
            calls = f"the old-log-prob forward's calls {want[: len(plan)]}"
        else:
            which = f"update mini-batch {mb.mini_batch}, forward {bad - len(plan)} of {len(update)}"
            calls = f"the update's calls {want[len(plan) :]} after the old-log-prob forward's {len(plan)}"
        raise LayoutError(
            f"{where}: {head} {what}; expected {want[bad]} ({which}: verl's packing of dump rows "
            f"{list(mb.rows)[:8]}, T/(tp·cp) with tp={tp}, cp={cp}; {calls}){hint}"
        )

    def _hole(self, b: int, record: SampleRecord, moe: list[int]) -> None:
        """One ``LayoutError`` at the first cell of sample ``b`` no rank routed, in any placed pass."""
        lo, n = int(self.offsets[b]), int(self.lengths[b])
        holes = ~self.filled[lo : lo + n][:, moe]
        found: tuple[str, int, int] | None = None
        if holes.any():
            pos, slot = (int(x) for x in np.argwhere(holes)[0])
            found = ("the old-log-prob forward", pos, slot)
        elif self.update is not None and (hole := self.update.hole(b, moe)) is not None:
            found = (f"update forward {hole[0] + 1} of the sample", hole[1], hole[2])
        if found is not None:
            raise LayoutError(
                f"step {self.step}: no rank routed {record.origin} position {found[1]} decoder layer "
                f"{moe[found[2]]} in {found[0]}; expected the trace of every TP, CP and PP rank of its "
                "DP rank"
            )

    def records(self) -> Iterator[SampleRecord]:
        """The engine's records with the trainer's routes (every cell checked placed): R3 the
        old-log-prob forward's; R2 an update forward's, with the old-log-prob forward's as recorded."""
        moe = list(self.moe)
        for b, record in enumerate(self.engine):
            self._hole(b, record, moe)
            lo, n = int(self.offsets[b]), int(self.lengths[b])
            first = self.routes[lo : lo + n - 1]
            if self.update is None:
                yield dataclasses.replace(record, trainer_routes=first, replay="R3", source=SOURCE)
            else:
                yield dataclasses.replace(
                    record,
                    trainer_routes=self.update.judged(b, first, moe),
                    recorded_routes=first,
                    replay="R2",
                    forward="update",
                    source=SOURCE,
                )


def _engine_step(
    file: Path,
    experts: int,
    layers: tuple[int, ...] | None,
    vote: LayerVote | None,
    r2_calls: list[megatron_calls.RouterCall] | None = None,
) -> tuple[list[SampleRecord], Any, Any]:
    """One dump file's records, and its ``attention_mask`` and ``response_mask`` (the packing's input).

    ``r2_calls`` (R2: rank 0's calls of the step): a dump without ``routed_experts``, as a verl R2 run
    writes it (``enable_rollout_routing_replay=False``: the rollout returns no routes), is read with
    stand-in routes (``top_k`` from the trace, the decoder layers up to the last of ``layers``) that
    are dropped from the records: they carry no engine routes, only the samples' places and tokens."""
    tensors, non_tensor = verl_dump.read_batch(file)
    routeless = r2_calls is not None and tensors.get("routed_experts") is None
    if routeless:
        tensors = {**tensors, "routed_experts": _stand_in(file, tensors["attention_mask"], layers, r2_calls)}
    found, _ = verl_dump.batch_records(file, experts, layers, vote, read=(tensors, non_tensor))
    if routeless:
        found = [dataclasses.replace(r, engine_routes=None, engine_captured=None) for r in found]
    return found, tensors["attention_mask"], tensors["response_mask"]


def _stand_in(
    file: Path, attention: Any, layers: tuple[int, ...] | None, calls: list[megatron_calls.RouterCall] | None
) -> npt.NDArray[np.int16]:
    """Routes ``[B, W, max(layers) + 1, top_k]`` for an R2 dump without any: ``0 … top_k − 1`` on every
    MoE layer of every attended column (never written out)."""
    if layers is None:
        raise LayoutError(
            f"{file}: no routed_experts (a verl R2 run's rollout returns none); expected --moe-layers, "
            "which nothing in the dump allows to infer"
        )
    top_k = next((c.topk for c in calls or () if c.block == "decoder"), None)
    if top_k is None:
        raise LayoutError(f"{file}: no routed_experts, and rank 0 traces no decoder call to read top_k from")
    mask = np.asarray(attention) != 0
    routes = np.zeros((*mask.shape, max(layers) + 1, top_k), dtype=np.int16)
    routes[..., list(layers), :] = np.arange(top_k, dtype=np.int16)
    routes[~mask] = 0
    return routes


def records(
    dump: Path,
    trace: Path,
    layout: TrainerLayout,
    *,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    inferred: list[str] | None = None,
    notes: list[str] | None = None,
) -> Iterator[SampleRecord]:
    """The verl dump's samples, step by step, each with the trainer's dispatched routes from the trace:
    under R3 the old-log-prob forward's (how many later router calls were not placed goes to
    ``notes``), under R2 an update forward's with the old-log-prob forward's as the recorded routes.

    Every rank ``0 … tp·cp·dp·pp − 1`` must have a trace file, and each file the dump's steps in order.
    """
    loops: list[tuple[Path, Path]] = []
    files = verl_dump.dump_files(Path(dump), loops)
    if not files:
        raise LayoutError(f"{dump}: no verl RolloutSkip dump ({{step}}/{verl_dump.FILE_NAME})")
    if loops and notes is not None:
        notes.append(verl_dump.loop_note(loops, len({f.parent.parent for f in files})))
    experts = num_experts_input(num_experts, "verl")
    layers = moe_layers_input(moe_layers)
    vote = LayerVote() if layers is None else None
    ranks = trace_ranks(Path(trace), layout)
    streams = {r: megatron_lm.rank_steps(f, r, experts) for r, f in ranks.items()}
    later: dict[int, int] = {}
    for step, file in sorted((verl_dump.step_of(f), f) for f in files):
        joined, later[step] = join_step(
            step, file, lambda r, s=step: next_step(streams[r], r, s, ranks[r]), layout, experts, layers, vote
        )
        yield from joined
    for rank, stream in streams.items():
        extra = next(stream, None)
        if extra is not None:
            raise LayoutError(not_in_dump(extra[1][0].where, rank, extra[0], dump))
    if vote is not None and inferred is not None:
        inferred.extend(vote.notes())
    if notes is not None and (note := later_note(later)) is not None:
        notes.append(note)


def join_step(
    step: int,
    file: Path,
    calls_of: Callable[[int], list[megatron_calls.RouterCall]],
    layout: TrainerLayout,
    experts: int,
    layers: Sequence[int] | None,
    vote: LayerVote | None,
) -> tuple[list[SampleRecord], int]:
    """One step of the dump (its ``gen_batch.dp`` at ``file``) joined with each rank's calls of it
    (``calls_of(rank)``, rank 0 asked first); the joined records and how many router calls after the
    old-log-prob forward were not placed (R3)."""
    first = calls_of(0)
    with time_budget(file):
        engine, attention, response = _engine_step(
            file, experts, layers, vote, first if layout.replay == "R2" else None
        )
    plans = step_packing(attention, response, layout.batching)
    update = None
    if layout.update is not None:
        update = update_packing(attention, response, layout.batching, layout.update)
    join = _StepJoin(step, engine, layout, update)
    for pp_rank in range(layout.pp):
        for dp_rank in range(layout.dp):
            for cp_rank in range(layout.cp):
                for tp_rank in range(layout.tp):
                    rank = layout.rank(dp_rank, tp_rank, pp_rank, cp_rank)
                    calls = first if rank == 0 else calls_of(rank)
                    join.place(rank, calls, plans[dp_rank], (dp_rank, tp_rank, pp_rank, cp_rank))
    return list(join.records()), join.later


def not_in_dump(where: str, rank: int, step: int, dump: Path) -> str:
    """The input error of a traced step the dump does not hold."""
    return (
        f"{where}: rank {rank} traces step {step}, which the dump at {dump} does not hold; expected the "
        "trace of the same run (its steps)"
    )


def later_note(later: dict[int, int]) -> str | None:
    """The note on the router calls after each step's old-log-prob forward (``later``: per step), or
    ``None`` when there were none."""
    if not any(later.values()):
        return None
    return (
        f"{sum(later.values())} router calls after each step's old-log-prob forward (reference "
        f"log-probs, the update, activation recompute) in {sum(1 for n in later.values() if n)} of "
        f"{len(later)} steps were not placed: only the old-log-prob forward is judged"
    )


def next_step(stream: Iterator[Any], rank: int, step: int, file: Path) -> list[megatron_calls.RouterCall]:
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
        f"importing {shown(dump)} as a verl RolloutSkip dump joined with megatron-core's router trace "
        f"{shown(args.trainer_trace)} (tp={layout.tp}, cp={layout.cp}, pp={layout.pp}, dp={layout.dp}"
        f"{'' if layout.replay == 'R3' else ', replay R2: the update against the old-log-prob recording'})",
        file=sys.stderr,
    )
    inferred: list[str] = []
    notes = list(NOTES if layout.replay == "R3" else NOTES_R2)
    import_joined(
        Path(dump), Path(args.trainer_trace), Path(directory), layout,
        num_experts=args.num_experts, moe_layers=args.moe_layers, inferred=inferred, notes=notes,
    )  # fmt: skip
    return inferred, [f"trainer trace: {note}" for note in notes]
