"""The tap: what a run's engine returned and what its trainer dispatched, written as the run layout.

Opt-in and framework-agnostic; a run switches it on and the audit (``rrh audit``) then checks the
invariants no framework dump allows (FACTS §7): R3 replay fidelity, R2 update == recorded, splice
consistency per attempt, CP/SP shard union, live agreement and the log-prob gap split by agreement.

- **Engine side** (``EngineTap``, in ``harness.audit.tap.engine`` with ``TapError``): each engine
  call of a sample — the start, a resume after an abort, a new turn after tool tokens — as the
  harness's conventions decode it (a vLLM ``RequestOutput`` through
  ``harness.engines.vllm.decode_request_output``, or an ``EngineRollout`` any adapter made), with
  the attempt kind and the engine's weight version the caller gives. It keeps each attempt's own
  payload: the splice the framework made is judged against them.
- **Trainer side** (``TrainerTap``): per rank, the routes each MoE layer *dispatched* in each
  forward (old log-probs, reference, update, recompute), read by the harness's own probes
  (``harness.probes``), never what replay code reports; each packed row assigned to its sample and
  position from the packing metadata the caller passes (``PackedRows``); the trainer's token
  log-probs.
- **Writing** (``BackgroundWriter``): a thread writes the rows into per-rank run-layout files
  (``harness.audit.layout.writer``, atomic per file), one file per step, through a bounded queue (memory:
  ``queue_records`` records plus one step's rows); after each file it rewrites the rank's manifest
  (``harness.audit.tap.manifest``), so a crash loses at most the file being written and the audit
  reports the run as cut short.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from harness.audit.layout.schema import FORWARDS, REPLAY_MODES, SampleRecord
from harness.audit.layout.writer import RunWriter
from harness.audit.tap.engine import EngineSample, TapError
from harness.audit.tap.manifest import write_manifest

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class PackedRows:
    """Where every row (token) of a trainer forward belongs: ``sample[i]`` indexes ``keys`` (−1:
    padding), ``position[i]`` is its position in that sample (−1: padding). Rows are in the order
    the forward flattens them (batch-major for ``[batch, seq]`` inputs, packed order for THD)."""

    keys: tuple[str, ...]
    sample: IntArray
    position: IntArray

    def __post_init__(self) -> None:
        bad_keys = [k for k in self.keys if not isinstance(k, str) or not k]
        if bad_keys:
            raise TapError(f"keys: expected non-empty sample keys, got {bad_keys[0]!r}")
        if self.sample.shape != self.position.shape or self.sample.ndim != 1:
            raise TapError(
                f"position: {self.position.shape} entries; expected one per row, like sample "
                f"{self.sample.shape}"
            )
        no_position = np.flatnonzero((self.sample >= 0) & (self.position < 0))
        if no_position.size:
            i = int(no_position[0])
            raise TapError(f"position: row {i} of sample {self.keys[int(self.sample[i])]!r} has no position; "
                           "expected its position in the sample (packing metadata)")  # fmt: skip
        no_key = np.flatnonzero((self.sample < 0) & (self.position >= 0))
        if no_key.size:
            i = int(no_key[0])
            raise TapError(f"sample_key: row {i} (position {int(self.position[i])}) has no sample key; "
                           "expected "
                           "the sample each non-padding row belongs to")  # fmt: skip
        if (self.sample >= len(self.keys)).any():
            raise TapError(f"sample: an index ≥ {len(self.keys)} keys; expected indices into keys or −1")

    @property
    def size(self) -> int:
        return int(self.sample.size)

    @classmethod
    def rows(cls, keys: Sequence[str | None], positions: Sequence[int | None]) -> PackedRows:
        """From one sample key (None: padding) and one position (None: padding) per row."""
        names = sorted({k for k in keys if k is not None})
        index = {k: i for i, k in enumerate(names)}
        sample = np.array([-1 if k is None else index[k] for k in keys], dtype=np.int64)
        position = np.array([-1 if p is None else int(p) for p in positions], dtype=np.int64)
        return cls(tuple(names), sample, position)

    @classmethod
    def padded(cls, keys: Sequence[str], attention_mask: Any) -> PackedRows:
        """A ``[batch, seq]`` batch, one sample per row, padding where ``attention_mask`` is 0 (left or
        right)."""
        mask = np.asarray(attention_mask, dtype=bool)
        if mask.ndim != 2 or mask.shape[0] != len(keys):
            raise TapError(f"attention_mask: shape {mask.shape}; expected [batch={len(keys)}, seq]")
        position = np.where(mask, np.cumsum(mask, axis=1) - 1, -1).reshape(-1)
        sample = np.where(mask, np.arange(len(keys))[:, None], -1).reshape(-1)
        return cls(tuple(keys), sample.astype(np.int64), position.astype(np.int64))

    @classmethod
    def packed(cls, keys: Sequence[str], cu_seqlens: Any, position_ids: Any = None) -> PackedRows:
        """THD packing: sample i holds rows ``cu_seqlens[i]:cu_seqlens[i+1]``; positions from
        ``position_ids`` (a CP/SP shard's own) or counted from 0 in each sample."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        if cu.ndim != 1 or cu.size != len(keys) + 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
            raise TapError(
                f"cu_seqlens: {cu.tolist()[:8]}; expected {len(keys) + 1} increasing offsets from 0"
            )
        lengths = np.diff(cu)
        sample = np.repeat(np.arange(len(keys)), lengths)
        if position_ids is None:
            position = np.arange(cu[-1]) - np.repeat(cu[:-1], lengths)
        else:
            position = np.asarray(position_ids, dtype=np.int64).reshape(-1)
            if position.size != cu[-1]:
                raise TapError(
                    f"position_ids: {position.size} entries; expected cu_seqlens[-1] = {int(cu[-1])}"
                )
        return cls(tuple(keys), sample.astype(np.int64), position.astype(np.int64))


def attach_probe(model: Any) -> Any:
    """The harness probe for ``model``: the reference ``MoELM``, a Megatron-core ``GPTModel`` or a
    transformers MoE model (attach after the subject installed its replay)."""
    from reference_impl.model import MoELM

    if isinstance(model, MoELM):
        from harness.probes.reference import attach as reference

        return reference(model)
    if type(model).__module__.startswith("megatron."):
        return _MegatronProbe(model)
    from harness.probes.hf import attach as hf

    return hf(model)


class _MegatronProbe:
    """The Megatron-core probe (``harness.probes.megatron``) as the tap reads it: each MoE layer's
    dispatch map (tokens → experts, all-gather dispatcher, no expert parallelism) as expert ids."""

    def __init__(self, model: Any) -> None:
        from harness.probes.megatron import DispatchProbe

        self.inner = DispatchProbe.attach(model)
        self.keep: int | None = None

    def clear(self) -> None:
        self.inner.clear()

    def remove(self) -> None:
        self.inner.remove()

    def last(self) -> Any:
        from harness.probes import Dispatch

        ids = []
        for layer, calls in enumerate(self.inner.dispatched):
            routed = calls[-1]
            counts = routed.sum(dim=1)
            if (counts != counts[0]).any():
                seen = sorted(set(counts.tolist()))
                raise TapError(f"megatron dispatch map of MoE layer {layer}: rows with {seen} experts; "
                               "expected top_k on every row")  # fmt: skip
            order = routed.to(torch.int8).argsort(dim=1, descending=True, stable=True)
            ids.append(order[:, : int(counts[0])])
        stacked = torch.stack(ids, dim=1)
        return Dispatch(stacked, torch.ones_like(stacked, dtype=torch.float32))


@dataclass
class _Dispatched:
    """Pieces of one sample's dispatch in one forward: positions and ids ``[rows, n_moe, top_k]``."""

    positions: list[IntArray] = field(default_factory=list)
    ids: list[npt.NDArray[Any]] = field(default_factory=list)
    tokens: list[IntArray] = field(default_factory=list)
    """The input token of each row, where the caller passed the forward's ``input_ids``."""


class TrainerTap:
    """One rank's trainer tap (see the module docstring).

    ``probe``: a ``harness.probes`` probe already attached to the trainer's model (default:
    ``attach_probe(model)``). ``shard``/``shards``: this rank's CP/SP shard of every sample (its
    rows are written as shard rows with their positions); None for whole samples.
    """

    def __init__(
        self,
        model: Any,
        writer: BackgroundWriter,
        *,
        num_layers: int,
        moe_layers: Sequence[int],
        num_experts: int,
        top_k: int,
        source: str,
        probe: Any = None,
        shard: int | None = None,
        shards: int | None = None,
    ) -> None:
        if (shard is None) != (shards is None) or (shard is not None and not 0 <= shard < shards):  # type: ignore[operator]
            raise TapError(
                f"shard: expected an index in [0, shards) with shards given, got {shard!r} of {shards!r}"
            )
        self.writer = writer
        self.num_layers, self.moe_layers = int(num_layers), tuple(int(x) for x in moe_layers)
        self.num_experts, self.top_k, self.source = int(num_experts), int(top_k), source
        self.shard, self.shards = shard, shards
        self.probe = probe if probe is not None else attach_probe(model)
        self.probe.keep = 1
        self._dispatched: dict[tuple[str, str], _Dispatched] = {}
        self._logprobs: dict[str, npt.NDArray[np.float32]] = {}

    @contextmanager
    def forward(self, kind: str, rows: PackedRows, input_ids: Any = None) -> Iterator[None]:
        """Record what the forward run inside this block dispatched, row by row (``rows``), and the
        tokens it consumed (``input_ids``, flattened like the rows; optional: ``trainer_tokens``)."""
        if kind not in FORWARDS:
            raise TapError(f"forward: expected one of {list(FORWARDS)}, got {kind!r}")
        if not isinstance(rows, PackedRows):
            raise TapError(
                f"rows: expected PackedRows (sample key and position per row), got {type(rows).__name__}"
            )
        self.probe.clear()
        yield
        dispatch = self.probe.last().ids
        flat = dispatch.reshape(-1, *dispatch.shape[-2:]).numpy()
        if flat.shape[0] != rows.size:
            raise TapError(
                f"rows: {rows.size} packed rows given; the forward dispatched {flat.shape[0]} tokens per "
                "MoE layer"
            )
        tokens = None if input_ids is None else np.asarray(input_ids).reshape(-1).astype(np.int64)
        if tokens is not None and tokens.size != rows.size:
            raise TapError(f"input_ids: {tokens.size} tokens; expected one per packed row ({rows.size})")
        real = np.flatnonzero(rows.sample >= 0)
        order = real[np.argsort(rows.sample[real], kind="stable")]
        bounds = np.searchsorted(rows.sample[order], np.arange(len(rows.keys) + 1))
        for s, key in enumerate(rows.keys):
            take = order[bounds[s] : bounds[s + 1]]
            if take.size:
                entry = self._dispatched.setdefault((key, kind), _Dispatched())
                entry.positions.append(rows.position[take])
                entry.ids.append(flat[take])
                if tokens is not None:
                    entry.tokens.append(tokens[take])

    def discard(self) -> None:
        """Drop every dispatch and log-prob recorded and not yet written (a forward nobody trains on)."""
        self._dispatched.clear()
        self._logprobs.clear()

    def logprobs(self, key: str, values: Any) -> None:
        """The trainer's (old-log-prob pass) log-probs of sample ``key``'s response tokens."""
        self._logprobs[key] = np.asarray(values, dtype=np.float32).reshape(-1)

    def _routes(
        self, key: str, kind: str, expected: int
    ) -> tuple[npt.NDArray[Any], IntArray, IntArray | None] | None:
        """Sample ``key``'s dispatch in forward ``kind`` on the decoder axis: rows at their positions,
        the positions, and the tokens it consumed (``None`` unless every position's was given)."""
        entry = self._dispatched.pop((key, kind), None)
        if entry is None:
            return None
        positions = np.concatenate(entry.positions)
        ids = np.concatenate(entry.ids)
        consumed = None
        if entry.tokens:
            consumed = np.full(expected + 1, -1, dtype=np.int64)
            inside = positions <= expected
            consumed[positions[inside]] = np.concatenate(entry.tokens)[inside]
            consumed = None if (consumed < 0).any() else consumed
        keep = positions < expected  # the last token is forwarded but has no route row (DESIGN §3.1)
        positions, ids = positions[keep], ids[keep]
        order = np.argsort(positions, kind="stable")
        positions, ids = positions[order], ids[order]
        full = np.zeros((positions.size, self.num_layers, self.top_k), dtype=np.int64)
        full[:, list(self.moe_layers)] = ids
        if self.shard is None and not np.array_equal(positions, np.arange(expected)):
            have = set(positions.tolist())
            gap = next((p for p in range(expected) if p not in have), None)
            what = f"position {gap} has no row" if gap is not None else "a position has two rows"
            raise TapError(
                f"positions: sample {key!r} in forward {kind!r}: {what}; expected each of its {expected} "
                "route rows "
                "once (whole samples; pass shard/shards for a CP/SP rank's part)"
            )
        return full, positions, consumed

    def write(self, step: int, samples: Sequence[EngineSample], *, replay: str) -> None:
        """Queue the rows of ``samples`` (trained on at ``step`` under ``replay``) for the writer.

        The trainer routes are the old-log-prob pass's (R3 and none), or the update's with the
        old-log-prob pass's as ``recorded_routes`` (R2).
        """
        if replay not in REPLAY_MODES:
            raise TapError(f"replay: expected one of {list(REPLAY_MODES)}, got {replay!r}")
        judged = "update" if replay == "R2" else "old_logprob"
        for sample in samples:
            expected = sample.prompt_len + sample.response_len - 1
            trainer = self._routes(sample.key, judged, expected)
            recorded = self._routes(sample.key, "old_logprob", expected) if replay == "R2" else None
            for kind in FORWARDS:
                self._dispatched.pop((sample.key, kind), None)
            lp, generated = sample.engine_logprobs()
            trainer_lp = self._logprobs.pop(sample.key, None)
            if trainer_lp is not None and trainer_lp.size != sample.response_len:
                raise TapError(f"logprobs: sample {sample.key!r} has {trainer_lp.size}; expected "
                               "response_len "
                               f"{sample.response_len}")  # fmt: skip
            record = SampleRecord(
                step=step, sample_key=sample.key, group_key=sample.group_key, rank=self.writer.rank,
                prompt_len=sample.prompt_len, response_len=sample.response_len, tokens=sample.tokens,
                num_experts=self.num_experts, top_k=self.top_k, num_layers=self.num_layers,
                moe_layers=self.moe_layers, source=self.source, loss_mask=generated, engine_logprobs=lp,
                trainer_logprobs=trainer_lp, replay=replay, forward=None if trainer is None else judged,
                trainer_tokens=None if trainer is None or self.shard is not None else trainer[2],
                trainer_routes=None if trainer is None else trainer[0],
                recorded_routes=None if recorded is None else recorded[0],
            )  # fmt: skip
            if self.shard is not None:
                if trainer is None:
                    continue  # this rank held no row of the sample
                record.shard, record.shards = self.shard, self.shards
                record.positions = None if trainer is None else trainer[1]
            else:
                record.engine_routes = sample.spliced
                record.attempt_ends = sample.attempt_ends()
                record.attempt_kinds = [a.kind for a in sample.attempts]
                record.weight_versions = [a.weight_version for a in sample.attempts]
                record.attempt_routes = [a.routes for a in sample.attempts]
            self.writer.put(record)
        self.writer.end_step(step)


# --- writing --------------------------------------------------------------------------------------


_END_STEP = object()
_CLOSE = object()


class BackgroundWriter:
    """Writes one rank's records on a thread: a file per step, the rank's manifest after each.

    ``put`` blocks when ``queue_records`` records wait (bounded memory); an error of the thread is
    raised by the next ``put``, ``end_step`` or ``close``. Use as a context manager: leaving it on
    an exception does *not* close the manifest, so the audit reports the run as cut short.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int = 0,
        world_size: int = 1,
        queue_records: int = 256,
    ) -> None:
        if not isinstance(world_size, int) or not 0 <= rank < world_size:
            raise TapError(f"rank: expected 0 <= rank < world_size={world_size!r}, got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self.directory = os.fspath(directory)
        self._writer = RunWriter(directory, rank=rank, file_bytes=1 << 62)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_records)
        self._error: BaseException | None = None
        self._last_step: int | None = None
        self._manifest(closed=False)
        self._thread = threading.Thread(target=self._run, name=f"rrh-tap-writer-r{rank}", daemon=True)
        self._thread.start()

    def _manifest(self, closed: bool) -> None:
        write_manifest(self.directory, rank=self.rank, world_size=self.world_size,
                       files=[p.name for p in self._writer.files], last_step=self._last_step,
                       closed=closed)  # fmt: skip

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _CLOSE:
                    return
                if self._error is not None:
                    continue
                if isinstance(item, tuple) and item[0] is _END_STEP:
                    if self._writer.flush() is not None:
                        self._last_step = item[1]
                        self._manifest(closed=False)
                else:
                    self._writer.write(item)
            except BaseException as err:  # handed to the caller's next call
                self._error = err
            finally:
                self._queue.task_done()

    def _check(self) -> None:
        if self._error is not None:
            raise TapError(f"tap writer (rank {self.rank}): {type(self._error).__name__}: {self._error}")

    def put(self, record: SampleRecord) -> None:
        self._check()
        self._queue.put(record)

    def end_step(self, step: int) -> None:
        """Close the step: its rows become one file (written on the thread)."""
        self._check()
        self._queue.put((_END_STEP, int(step)))

    def close(self) -> None:
        """Write what is queued, close the manifest (the run finished), stop the thread."""
        self._queue.put(_CLOSE)
        self._thread.join()
        self._check()
        self._writer.close()
        self._manifest(closed=True)

    def abandon(self) -> None:
        """Stop the thread after what is queued, leaving the manifest open (the run was cut short)."""
        self._queue.put(_CLOSE)
        self._thread.join()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()
