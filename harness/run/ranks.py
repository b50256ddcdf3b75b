"""``rrh run --ranks N``: trainer ranks on gloo, each holding a CP or SP shard of every sample.

Rank 0 runs the engine and the whole-sample tap (engine payloads, splice, the trainer routes of its
forward); every rank forwards each sample and taps, as *shard rows*, only the positions its shard
holds (``TrainerTap(shard=rank, shards=N)``, its own per-rank files), computes the loss of the
tokens its rows predict, and the ranks sum their gradients (``all_reduce``) before identical Adam
steps. Every rank computing each sample's full context stands in for the KV exchange of ring
attention (CP) or the all-to-all of Ulysses (SP); what ``shard_union`` judges — which rank claims
which (sample, position) — does not depend on how the context reached the rank. ``rrh audit`` then
checks it on the ranks' real files.

Splits (``SPLITS``): ``cp`` — Megatron's load-balanced zig-zag, 2·N chunks, rank r holding chunks r
and 2N−1−r; ``sp`` — N contiguous slices; ``sp-halo`` — a broken SP split whose slices also claim
the next slice's first position (a halo row counted as the rank's own): every boundary row is held
twice.

Rank 0 sends each step's samples to the other ranks over the gloo group as JSON bytes
(``samples_to_json``: tokens, attempts, payloads, splice), never pickled.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from harness.audit.tap.engine import EngineSample, TapAttempt, TapError

SPLITS = ("cp", "sp", "sp-halo")
GLOO_TIMEOUT = datetime.timedelta(minutes=5)
"""A rank waiting longer than this for the others fails instead of hanging."""


def shard_positions(split: str, length: int, rank: int, world: int) -> npt.NDArray[np.int64]:
    """The positions of a ``length``-token sample that ``rank`` of ``world`` holds under ``split``."""
    if split == "cp":
        bounds = np.linspace(0, length, 2 * world + 1).round().astype(np.int64)
        chunks = (rank, 2 * world - 1 - rank)
        return np.concatenate([np.arange(bounds[c], bounds[c + 1]) for c in chunks])
    if split in ("sp", "sp-halo"):
        bounds = np.linspace(0, length, world + 1).round().astype(np.int64)
        end = int(bounds[rank + 1]) + (1 if split == "sp-halo" and rank + 1 < world else 0)
        return np.arange(bounds[rank], min(end, length))
    raise TapError(f"--split: expected one of {list(SPLITS)}, got {split!r}")


def shard_mask(split: str, lengths: Sequence[int], width: int, rank: int, world: int) -> torch.Tensor:
    """``[batch, width]`` bool: the rows of a right-padded batch that ``rank`` holds."""
    held = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        held[i, torch.from_numpy(shard_positions(split, n, rank, world))] = True
    return held


def samples_to_json(samples: Sequence[EngineSample]) -> bytes:
    """The samples a step trains on, as JSON (the wire format between ranks)."""

    def attempt(a: TapAttempt) -> dict[str, Any]:
        return {"kind": a.kind, "weight_version": a.weight_version, "context": list(a.context),
                "generated": list(a.generated),
                "logprobs": None if a.logprobs is None else list(a.logprobs),
                "routes": np.asarray(a.routes).tolist()}  # fmt: skip

    return json.dumps([
        {"key": s.key, "group_key": s.group_key, "prompt_len": s.prompt_len,
         "attempts": [attempt(a) for a in s.attempts],
         "spliced": None if s.spliced is None else np.asarray(s.spliced).tolist()}
        for s in samples
    ]).encode()  # fmt: skip


def samples_from_json(data: bytes) -> list[EngineSample]:
    """``samples_to_json``'s inverse."""
    out = []
    for s in json.loads(data):
        sample = EngineSample(s["key"], s["group_key"], s["prompt_len"])
        for a in s["attempts"]:
            sample.attempts.append(TapAttempt(
                a["kind"], a["weight_version"], tuple(a["context"]), tuple(a["generated"]),
                None if a["logprobs"] is None else tuple(a["logprobs"]),
                np.asarray(a["routes"], dtype=np.int64),
            ))  # fmt: skip
        sample.spliced = None if s["spliced"] is None else np.asarray(s["spliced"], dtype=np.int64)
        out.append(sample)
    return out


class RankGroup:
    """The run's own gloo group over a file rendezvous in its scratch directory: not
    ``torch.distributed``'s default group, which vLLM's in-process engine already holds on rank 0."""

    def __init__(self, rendezvous: Path, rank: int, world: int) -> None:
        import torch.distributed as dist

        self.rank, self.world = rank, world
        self.group = dist.ProcessGroupGloo(dist.FileStore(str(rendezvous), world), rank, world, GLOO_TIMEOUT)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (its length, then the bytes as a uint8 tensor)."""
        size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
        self.group.broadcast(size, 0).wait()  # type: ignore[attr-defined]  # Backend's, unstubbed
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(int(size.item()), dtype=torch.uint8)
        )
        self.group.broadcast(buffer, 0).wait()  # type: ignore[attr-defined]
        return bytes(buffer.numpy().tobytes())

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over the ranks (each rank's loss covers its shard's tokens)."""
        for param in model.parameters():
            if param.requires_grad:
                if param.grad is None:  # no token of this rank's shard reached it: every rank takes part
                    param.grad = torch.zeros_like(param)
                self.group.allreduce(param.grad).wait()  # type: ignore[attr-defined]


@contextmanager
def ranks_started(
    world: int, scratch: Path, target: Callable[..., None], *args: Any
) -> Iterator[RankGroup | None]:
    """With ``world`` > 1: ranks 1.. started as spawned processes running ``target(rank, rendezvous,
    *args)`` (a module-level function: it joins ``RankGroup(rendezvous, rank, world)``) and this
    process joined to their gloo group as rank 0 (yielded; None with one rank); on leaving, they are
    waited for (terminated if the block raised), and a rank that failed is a ``TapError`` naming it."""
    if world == 1:
        yield None
        return
    import multiprocessing

    rendezvous = scratch / "gloo-rendezvous"
    context = multiprocessing.get_context("spawn")
    procs = [
        context.Process(target=target, name=f"rrh-run-rank{r}", args=(r, str(rendezvous), *args))
        for r in range(1, world)
    ]  # fmt: skip
    for proc in procs:
        proc.start()
    finished = False
    try:
        yield RankGroup(rendezvous, 0, world)
        finished = True
    finally:
        for proc in procs:
            if not finished:
                proc.terminate()
            proc.join(GLOO_TIMEOUT.total_seconds())
    failed = [(r, proc.exitcode) for r, proc in enumerate(procs, start=1) if proc.exitcode != 0]
    if failed:
        rank, code = failed[0]
        raise TapError(f"rank {rank}: exited with code {code}; expected 0 (its error is above)")
