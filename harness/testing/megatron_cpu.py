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
- ``torch.cuda.is_current_stream_capturing`` → ``False`` (0.19's router tracer asks it on every
  router call; a CPU build of torch raises instead of answering).

``setup_rank`` is the per-rank setup hook of ``harness.testing.ranks.run_ranks`` that applies them
in every spawned rank (``suites/test_megatron.py``).

The alltoall token dispatcher is **not** made to work (it needs CUDA streams, numpy split sizes
and an uneven all-gather that gloo lacks): use ``moe_token_dispatcher_type="allgather"`` on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings
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
    patches.set(cuda, "is_current_stream_capturing", lambda: False)
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


def setup_rank(rank: int, world_size: int) -> None:
    """``run_ranks`` setup hook for a megatron-core rank: quiet warnings, then ``apply`` (kept applied).

    megatron-core warns at import and per call about missing TE/Apex, CUDA environment variables and
    deprecated ``torch.distributed`` names; none of it is about replay, and it floods test output.
    """
    warnings.simplefilter("ignore", UserWarning)
    warnings.simplefilter("ignore", FutureWarning)
    apply()
