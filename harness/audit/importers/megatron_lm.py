"""Megatron-LM's routing trace → validated records, and the layout where the caller knows the packing.

What Megatron-LM writes (read in NVIDIA/Megatron-LM, never imported): ``--moe-routing-trace-path D``
(since Megatron-LM PR #5220; ``megatron/training/training.py``) installs ``RouterTracer``
(``megatron/core/transformer/moe/router_trace.py``), a forward hook on every ``TopKRouter``. Each
rank appends to ``D/router_trace_rank{rank}.jsonl`` one record per router call::

    {"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0,
     "num_tokens": 128, "topk": 8, "top_indices": [[12, 45, ...], ...]}

``top_indices`` is ``[num_tokens, topk]``: the experts the router picked (after any replay) for the
tokens of that call, in the rank's packed local order. MTP routers add ``"mtp_idx"`` (``block``
``"mtp"``). In training, ``step`` is the iteration (``advance_step``); every micro-batch of a step
is one record per layer, in call order, and an activation recompute calls the router again. The
``layer`` is the index under ``decoder.layers`` of the rank's own module, so it is local to a
pipeline stage.

The trace has **no sample id and no position**: which sample a row belongs to is known only to the
trainer that packed the batch. ``check_trace`` validates what the trace alone supports (record
shapes, ids distinct and in range, every layer of a step routing as many tokens); ``records`` maps
rows to samples only with the packing the caller supplies (``StepPacking`` per step and rank), and
otherwise raises a ``LayoutError`` that says what is missing.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers.megatron_calls import RouterCall, call_ids, read_calls
from harness.audit.layout.inputs import glob
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.trace import LayerAxis

DESCRIPTION = (
    "Megatron-LM --moe-routing-trace-path D: router_trace_rank{r}.jsonl, the trainer's top-k per step, "
    "layer and rank (megatron/core/transformer/moe/router_trace.py)"
)
NOTES = (
    "the trace holds the trainer's routes in packed local token order with no sample id or position: "
    "records() needs the packing (cu_seqlens, sample keys and tokens per step and rank) to map rows to "
    "samples; without it, megatron_lm.check_trace validates shapes, id range and distinctness per "
    "step, rank, layer and row",
    "no engine routes, tokens or log-probs: coverage, agreement, replay fidelity and the log-prob checks "
    "need an engine dump beside it",
    "layer numbers are indices under decoder.layers of each rank's module, local to its pipeline stage; "
    "MTP routers (block mtp) are validated, never mapped to samples",
)
HINTS = {
    "engine_routes": "the engine's routes: nothing in Megatron-LM writes them; audit an engine-side dump "
    "(verl, SkyRL, slime) or a tapped run beside the trace",
    "engine_logprobs": "the engine's log-probs: nothing in Megatron-LM writes them",
    "trainer_logprobs": "the trainer's log-probs: nothing in the router trace holds them",
    "trainer_tokens": "the tokens the trainer consumed: the packing given to records() (the trace has none)",
    "replay": "the replay mode of each row: nothing in the router trace says it; harness.audit.tap writes it",
    "group_key": "the prompt's group: the packing given to records() (the trace has none)",
    "attempt payloads": "each attempt's own engine payload: nothing in Megatron-LM writes it",
    "shard positions": "per-rank shards with their positions: nothing in the router trace maps them",
}
"""What writes each column an invariant may miss, said for Megatron-LM (``AuditResult`` lines use it)."""
SOURCE = "Megatron-LM --moe-routing-trace-path"
SOURCE_PREFIXES = ("Megatron-LM ",)
"""The ``source`` of the records this importer writes (``hints_for`` tells a re-audited import by it)."""
_FILE = re.compile(r"router_trace_rank(\d+)\.jsonl")


@dataclass(frozen=True)
class RouterTraceViolation:
    """One record of the trace that breaks a rule, at its step, rank, layer and row (packed order)."""

    check: str
    """``rank``, ``rows``, ``shape``, ``top_k``, ``ids_valid`` or ``layer_tokens``."""
    step: int
    rank: int
    layer: int
    block: str
    """``decoder``, or ``mtp{i}`` for MTP head i."""
    row: int | None
    """Row in the rank's packed stream of the step for this layer (its calls concatenated)."""
    expected: str
    actual: str
    where: str
    """``file:line`` of the record."""

    def line(self) -> str:
        at = f"step {self.step} rank {self.rank} {self.block} layer {self.layer}"
        at += f" row {self.row}" if self.row is not None else ""
        return f"{self.check}: {at}: expected {self.expected}, got {self.actual} ({self.where})"


@dataclass(frozen=True)
class PackedSample:
    """One sample of a rank's packed stream: its key, its tokens (prompt ⊕ response) and prompt length."""

    sample_key: str
    tokens: Sequence[int]
    prompt_len: int
    group_key: str | None = None


@dataclass(frozen=True)
class StepPacking:
    """How one rank packed one step: segment i (rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of the step's
    calls concatenated in call order) holds ``samples[i]`` from position 0, padding after its tokens."""

    cu_seqlens: Sequence[int]
    samples: Sequence[PackedSample]


Packing = Callable[[int, int], StepPacking | None]
"""``packing(step, rank)``: that rank's packing of that step (``None``: not known)."""


def detect(path: Path) -> bool:
    """A ``router_trace_rank{r}.jsonl`` file or a directory holding them."""
    if path.is_file():
        return _FILE.fullmatch(path.name) is not None
    return path.is_dir() and any(_FILE.fullmatch(p.name) for p in path.glob("router_trace_rank*.jsonl"))


def check_trace(
    path: Path, *, num_experts: int | None = None, limit: int = 1000
) -> list[RouterTraceViolation]:
    """The first ``limit`` violations of the trace at ``path``, rank file by rank file, one step at a time.

    Without ``num_experts`` (not in the trace) ids are checked for being non-negative and distinct
    within a row, not against the expert count.
    """
    found: list[RouterTraceViolation] = []
    for rank, file in rank_files(Path(path)):
        for _, _, violations in rank_steps(file, rank, num_experts):
            found.extend(violations[: limit - len(found)])
            if len(found) >= limit:
                return found
    return found


SHOWN = 20
"""Violations ``trace_report`` prints (``check_trace`` finds up to 1000)."""


def trace_report(path: Path, *, num_experts: int | None = None) -> tuple[list[str], bool]:
    """What ``rrh audit TRACE_DIR`` prints for a trace alone, and whether it broke a rule: the trace's
    own rules checked (``check_trace``), and why nothing per sample is (no sample id, no position,
    no engine routes)."""
    found = check_trace(path, num_experts=num_experts)
    experts = f"in [0, {num_experts})" if num_experts else "non-negative (--num-experts E checks the range)"
    rules = (
        f"ids distinct and {experts}, top-k and token count of every record, equal calls on every layer "
        "of a step"
    )
    if found:
        lines = [
            f"check_trace         VIOLATED {len(found)}{'+' if len(found) >= 1000 else ''} times ({rules}):"
        ]
        lines += [f"  {v.line()}" for v in found[:SHOWN]]
        lines += [f"  … {len(found) - SHOWN} more"] if len(found) > SHOWN else []
    else:
        lines = [f"check_trace         checked: no violation ({rules})"]
    lines.append(
        "per sample          not checkable from a trace alone — it has no sample id, no position and no "
        "engine routes: give the verl RolloutSkip dump of the same run, "
        "rrh audit DUMP --trainer-trace TRACE_DIR"
    )
    return lines, bool(found)


def records(
    path: Path, *, packing: Packing | None = None, num_experts: int | None = None
) -> Iterator[SampleRecord]:
    """The trainer's routes of every packed sample, as ``trainer_routes`` on the MoE-ordinal axis.

    Needs ``packing(step, rank)`` and ``num_experts``: the trace has neither sample ids nor
    positions nor the expert count. A sample's routes are its segment's first ``len(tokens) − 1``
    rows (positions ``[0, P + R − 1)``, DESIGN §3.1; the last token's row has no engine
    counterpart). A segment holds a whole sample: a context- or sequence-parallel split of one
    sample over ranks is not mapped. A violation ``check_trace`` would name stops the import there.
    """
    if packing is None or num_experts is None:
        missing = " and ".join(
            what
            for what, absent in (
                ("packing= (cu_seqlens, sample keys and tokens per step and rank)", packing is None),
                ("num_experts=", num_experts is None),
            )
            if absent
        )
        raise LayoutError(
            f"{path}: router_trace_rank*.jsonl rows carry no sample id and no position (packed local order, "
            f"Megatron-LM router_trace.py); expected {missing} to map them to samples — "
            "megatron_lm.check_trace validates the trace without them"
        )
    moe_layers: tuple[int, ...] | None = None
    for rank, file in rank_files(Path(path)):
        seen: set[int] = set()
        for step, calls, violations in rank_steps(file, rank, num_experts):
            if violations:
                raise LayoutError(violations[0].line())
            if step in seen:
                raise LayoutError(
                    f"{calls[0].where}: field 'step' is {step} again after other steps; expected each step's "
                    "records together (one advance_step flush)"
                )
            seen.add(step)
            decoder = [c for c in calls if c.block == "decoder"]
            layers = tuple(sorted({c.layer for c in decoder}))
            if moe_layers is None:
                moe_layers = layers
            elif layers != moe_layers:
                raise LayoutError(
                    f"{calls[0].where}: step {step} rank {rank} traces layers {list(layers)}; expected "
                    f"{list(moe_layers)} like the records before (pipeline stages number layers locally)"
                )
            if not layers:
                continue
            per_layer = [
                np.concatenate([call_ids(c) for c in decoder if c.layer == layer]) for layer in layers
            ]
            routes = np.stack(per_layer, axis=1)  # [rows, MoE layers, top_k]
            yield from _samples(step, rank, routes, packing(step, rank), moe_layers, num_experts, file)


def rank_files(path: Path) -> list[tuple[int, Path]]:
    """``(rank, file)`` of every ``router_trace_rank{r}.jsonl`` at ``path``, in rank order."""
    files = [path] if path.is_file() else glob(path, "router_trace_rank*.jsonl")
    found = sorted((int(m.group(1)), p) for p in files if (m := _FILE.fullmatch(p.name)))
    for (rank, first), (other, second) in itertools.pairwise(found):
        if rank == other:  # router_trace_rank0 and router_trace_rank00: one would be silently dropped
            raise LayoutError(f"{first}, {second}: both are rank {rank}'s trace; expected one file per rank")
    if not found:
        raise LayoutError(
            f"{path}: no router_trace_rank{{r}}.jsonl; expected a --moe-routing-trace-path directory"
        )
    return found


def rank_steps(
    file: Path, rank: int, num_experts: int | None
) -> Iterator[tuple[int, list[RouterCall], list[RouterTraceViolation]]]:
    """``(step, its records, their violations)`` for each run of records of one step in ``file``."""
    calls: list[RouterCall] = []
    top_k: int | None = None
    for call in read_calls(file):
        if calls and call.step != calls[0].step:
            yield calls[0].step, calls, step_violations(calls, rank, top_k, num_experts)
            calls = []
        top_k = call.topk if top_k is None else top_k
        calls.append(call)
    if calls:
        yield calls[0].step, calls, step_violations(calls, rank, top_k, num_experts)


def step_violations(
    calls: list[RouterCall], rank: int, top_k: int | None, num_experts: int | None
) -> list[RouterTraceViolation]:
    """Every rule broken by one step's records of one rank."""
    found: list[RouterTraceViolation] = []
    offset: dict[tuple[str, int], int] = defaultdict(int)
    counts: dict[tuple[str, int], list[int]] = defaultdict(list)
    for call in calls:
        key = (call.block, call.layer)
        start = offset[key]
        offset[key] += len(call.rows)
        counts[key].append(len(call.rows))

        def violation(check: str, row: int | None, expected: str, actual: str, c: RouterCall = call) -> None:
            found.append(
                RouterTraceViolation(check, c.step, rank, c.layer, c.block, row, expected, actual, c.where)
            )

        if call.rank != rank:
            violation("rank", None, f"rank {rank} (the file's)", f"rank {call.rank}")
        if call.num_tokens != len(call.rows):
            violation(
                "rows", None, f"num_tokens = {call.num_tokens} rows", f"{len(call.rows)} rows in top_indices"
            )
        if call.topk != top_k:
            violation("top_k", None, f"topk {top_k} (this rank's first record)", f"topk {call.topk}")
        regular = isinstance(call.rows, np.ndarray) and call.rows.shape[1] == call.topk
        if not regular:
            listed = call.rows if isinstance(call.rows, list) else call.rows.tolist()
            bad = next(
                (i for i, r in enumerate(listed) if not isinstance(r, list) or len(r) != call.topk), None
            )
            if bad is not None:
                violation("shape", start + bad, f"{call.topk} ids (topk)", repr(listed[bad])[:80])
                continue
        ids = call_ids(call)
        if ids.size == 0:
            continue
        out = (ids < 0).any(axis=1)
        if num_experts is not None:
            out |= (ids >= num_experts).any(axis=1)
        ordered = np.sort(ids, axis=1)
        repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
        if out.any() or repeated.any():
            row = int(np.flatnonzero(out | repeated)[0])
            expected = (
                f"{call.topk} distinct ids in [0, {num_experts})" if num_experts else "distinct ids >= 0"
            )
            violation("ids_valid", start + row, expected, f"ids {ids[row].tolist()}")
    reference = Counter(tuple(v) for (block, _), v in counts.items() if block == "decoder").most_common(1)
    for (block, layer), sizes in counts.items():
        if block == "decoder" and reference and tuple(sizes) != reference[0][0]:
            first = next(c for c in calls if (c.block, c.layer) == (block, layer))
            found.append(
                RouterTraceViolation(
                    "layer_tokens", first.step, rank, layer, block, None,
                    f"calls of {list(reference[0][0])} tokens like the other layers of the step",
                    f"calls of {sizes} tokens", first.where,
                )
            )  # fmt: skip
    return found


def _samples(
    step: int,
    rank: int,
    routes: npt.NDArray[np.integer[Any]],
    pack: StepPacking | None,
    moe_layers: tuple[int, ...],
    num_experts: int,
    file: Path,
) -> Iterator[SampleRecord]:
    """The samples of one rank's step: segment i of ``cu_seqlens`` is sample i from position 0."""
    where = f"{file}: step {step} rank {rank}"
    if pack is None:
        raise LayoutError(f"{where}: packing(step, rank) is None; expected its cu_seqlens and samples")
    cu = np.asarray(pack.cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size != len(pack.samples) + 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise LayoutError(
            f"{where}: cu_seqlens {cu.tolist()}; expected {len(pack.samples) + 1} sorted offsets from 0"
        )
    if cu[-1] != routes.shape[0]:
        raise LayoutError(
            f"{where}: cu_seqlens ends at {int(cu[-1])}; expected {routes.shape[0]}, the rows each layer "
            "traced in the step (an activation recompute traces each micro-batch again)"
        )
    for i, sample in enumerate(pack.samples):
        tokens = np.asarray(sample.tokens, dtype=np.int64)
        if not 1 <= sample.prompt_len <= tokens.size <= cu[i + 1] - cu[i]:
            raise LayoutError(
                f"{where}: sample {sample.sample_key!r} has {tokens.size} tokens, prompt_len "
                f"{sample.prompt_len}, segment {int(cu[i + 1] - cu[i])} rows; expected 1 <= prompt_len <= "
                "tokens <= segment"
            )
        yield SampleRecord(
            step=step,
            sample_key=sample.sample_key,
            group_key=sample.group_key,
            prompt_len=sample.prompt_len,
            response_len=int(tokens.size - sample.prompt_len),
            tokens=tokens,
            num_experts=num_experts,
            top_k=int(routes.shape[2]),
            num_layers=len(moe_layers),
            moe_layers=moe_layers,
            layer_axis=LayerAxis.MOE_ORDINAL.value,
            trainer_routes=routes[int(cu[i]) : int(cu[i]) + tokens.size - 1],
            source=SOURCE,
            origin=f"{where} segment {i}",
            origin_column=int(cu[i]),
        )
