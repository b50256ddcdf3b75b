"""Test-support patches that let megatron-core 0.16.x run an ``MoELayer`` / GPT model on CPU (gloo).

FACTS §2: megatron-core calls CUDA-only functions unconditionally, and 0.16.1 references
``te_general_gemm`` without Transformer Engine. These patches exist for the harness's own suites
only: **library code never imports this module**, and the CUDA → CPU mappings are applied only in
a process that has no CUDA device (a GPU runner runs megatron-core unpatched, with NCCL).

What is patched, by upstream name (all reversible with ``Patches.undo``):

- ``megatron.core.transformer.moe.moe_utils.te_general_gemm``: 0.16.1 imports it inside the
  ``try: import transformer_engine`` block but ``RouterGatingLinearFunction.forward`` reads it
  unconditionally, a ``NameError`` without TE, on GPU too. Defined as ``None`` (the upstream
  fallback, ``torch.mm``) whenever the name is missing.
- ``torch.cuda.current_device`` → the CPU device (``TopKRouter.gating`` moves the router weight
  to it; ``TopKRouter.__init__`` and the token dispatchers allocate buffers on it).
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` → the CPU generator
  (``CudaRNGStatesTracker.add``, ``model_parallel_cuda_manual_seed``).
- ``megatron.core.tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state`` → the CPU
  generator (``CheckpointFunction``, activation recompute, saves and restores RNG states through
  them; upstream ``_set_cuda_rng_state`` defers through ``torch.cuda._lazy_call``, which never runs
  on CPU).
- ``torch.cuda.current_stream`` / ``Stream`` / ``Event`` / ``synchronize`` → no-op stand-ins.

The alltoall token dispatcher is **not** made to work (it needs CUDA streams, numpy split sizes
and an uneven all-gather that gloo lacks): use ``moe_token_dispatcher_type="allgather"`` on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_MISSING = object()


@dataclass
class Patches:
    """The attributes one ``apply`` replaced; ``undo`` restores them in reverse order."""

    applied: list[tuple[Any, str, Any]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """``module.attr`` of every patched attribute, in the order applied."""
        return [
            f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}" for owner, attr, _ in self.applied
        ]

    def set(self, owner: Any, attr: str, value: Any) -> None:
        self.applied.append((owner, attr, getattr(owner, attr, _MISSING)))
        setattr(owner, attr, value)

    def undo(self) -> None:
        while self.applied:
            owner, attr, old = self.applied.pop()
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def cuda_present() -> bool:
    """True when this process can use a CUDA device (then only the TE fallback is patched)."""
    return bool(torch.cuda.is_available())


class _Stream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    """Stand-in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _stream_context(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _patch_te_fallback(patches: Patches) -> None:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        patches.set(moe_utils, "te_general_gemm", None)


def _patch_cuda_to_cpu(patches: Patches) -> None:
    cuda = torch.cuda
    patches.set(cuda, "current_device", _cpu_current_device)
    patches.set(cuda, "get_rng_state", _cpu_get_rng_state)
    patches.set(cuda, "set_rng_state", _cpu_set_rng_state)
    patches.set(cuda, "manual_seed", _cpu_manual_seed)
    patches.set(cuda.random, "get_rng_state", _cpu_get_rng_state)
    patches.set(cuda, "current_stream", lambda *a, **k: _Stream())
    patches.set(cuda, "default_stream", lambda *a, **k: _Stream())
    patches.set(cuda, "Stream", _Stream)
    patches.set(cuda, "Event", _Event)
    patches.set(cuda, "stream", _stream_context)
    patches.set(cuda, "synchronize", lambda *a, **k: None)
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    patches.set(random, "_get_cuda_rng_state", _cpu_get_rng_state)
    patches.set(random, "_set_cuda_rng_state", _cpu_set_rng_state)


_STEPS: tuple[tuple[str, Callable[[Patches], None], bool], ...] = (
    ("te_general_gemm fallback", _patch_te_fallback, False),
    ("CUDA device/RNG/stream calls on CPU", _patch_cuda_to_cpu, True),
)


def apply(*, force_cpu: bool = False) -> Patches:
    """Apply the patches this process needs; return them (``undo()`` reverts).

    The CUDA → CPU mappings are applied only when no CUDA device is present (or ``force_cpu``);
    the ``te_general_gemm`` fallback whenever the name is missing. Apply before building models.
    """
    patches = Patches()
    cpu = force_cpu or not cuda_present()
    for _, step, cpu_only in _STEPS:
        if cpu or not cpu_only:
            step(patches)
    return patches


@contextlib.contextmanager
def patched(*, force_cpu: bool = False) -> Iterator[Patches]:
    """``apply`` for the duration of a ``with`` block."""
    patches = apply(force_cpu=force_cpu)
    try:
        yield patches
    finally:
        patches.undo()


# --------------------------------------------------------------------------------------------------
# Spawning a gloo (CPU) / NCCL (GPU) world of megatron-core ranks with a hard timeout.
# --------------------------------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """A rank raised, died, or the world ran past its timeout; the message holds every rank's story."""


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    rank: int, world_size: int, port: int, target: str, kwargs: dict[str, Any], queue: Any
) -> None:
    """Entry point of one spawned rank: patches (CPU only), process group, ``target(**kwargs)``."""
    import os
    import traceback
    import warnings

    import torch.distributed as dist

    # megatron-core warns at import and per call about missing TE/Apex, CUDA env vars and
    # deprecated torch.distributed names; none of it is about replay, and it floods test output.
    warnings.simplefilter("ignore", UserWarning)
    warnings.simplefilter("ignore", FutureWarning)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    os.environ.setdefault("LOCAL_RANK", str(rank))
    torch.set_num_threads(1)
    try:
        apply()
        if cuda_present():
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        module_name, _, attr = target.partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
        result = fn(**kwargs)
        queue.put((rank, "ok", result))
    except BaseException as err:  # report everything, SystemExit included, to the parent
        queue.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _last_line(text: str) -> str:
    """The last non-empty line of a traceback: the exception and its message."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def spawn_ranks(target: str, world_size: int, *, timeout: float, **kwargs: Any) -> list[Any]:
    """Run ``target`` (``"module:function"``) on ``world_size`` spawned ranks; return their results.

    Each rank applies the patches it needs (``apply``), joins a gloo (CPU) or NCCL (GPU) process
    group, and calls ``target(**kwargs)``. Raises ``RankFailure`` naming the failing ranks with
    their tracebacks, or when the world runs past ``timeout`` seconds (every rank is then killed).
    """
    import multiprocessing as mp
    import queue as queue_mod
    import time

    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, target, kwargs, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
                outcomes[rank] = (status, payload)
            except queue_mod.Empty:
                pass
            died = any(p.exitcode not in (None, 0) and r not in outcomes for r, p in enumerate(procs))
            if died or any(status == "error" for status, _ in outcomes.values()):
                # a rank failed or died unreported (segfault, OOM kill): the others may hang in a
                # collective, so they get a short grace period, not the whole timeout
                deadline = min(deadline, time.monotonic() + 5)
    finally:
        for proc in procs:
            proc.join(timeout=0.1 if len(outcomes) < world_size else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    errors = {r: p for r, (s, p) in outcomes.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        # The first line names the error itself (reports keep a failure's first line), then tracebacks.
        lines = [f"rank {r} failed: {_last_line(errors[r])}\n{errors[r]}" for r in sorted(errors)]
        if missing:
            lines.append(
                f"ranks {missing} did not report within {timeout:.0f} s "
                f"(exit codes {[procs[r].exitcode for r in missing]})"
            )
        raise RankFailure("\n".join(lines))
    return [outcomes[r][1] for r in range(world_size)]
