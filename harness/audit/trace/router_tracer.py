"""Turn megatron-core's own router tracer on in a trainer that does not wire it (verl 0.9.1 does not).

megatron-core ≥ 0.19 ships ``megatron/core/transformer/moe/router_trace.py``; Megatron-LM turns it on
with ``--moe-routing-trace-path``, frameworks that build their own training loop never call it. Two
calls are enough, and what they write is megatron-core's own format (``router_trace_rank{r}.jsonl``,
one record per router call) for ``rrh audit DUMP --trainer-trace DIR``:

- ``start_router_trace(model, directory)`` once the model is built and ``torch.distributed`` is up:
  ``init_moe_router_tracer(..., training_mode=True)`` then ``register_hooks(model)`` (every
  ``TopKRouter`` of the model or of its list of VPP chunks);
- ``mark_step(step)`` after each training step's forwards, with the step the engine's dump is keyed by
  (verl's ``global_steps``): ``advance_step(step)`` stamps the step's records with it and writes them.

In a verl 0.9.1 worker (``verl/workers/engine/megatron/transformer_impl.py``'s engine), after the model
is built and before training, and at the end of each step::

    from harness.audit.trace.router_tracer import mark_step, start_router_trace
    start_router_trace(engine.module, "/runs/exp1/router_trace")   # once, every rank
    mark_step(global_steps)                                        # after each step, every rank

The tracer records what each router returned: under replay, the experts it dispatched.
"""

from __future__ import annotations

import os
from typing import Any

MAX_STEPS = 2**31 - 1
"""Steps traced by default: all of them (megatron-core stops tracing after ``max_steps``)."""


class RouterTraceError(RuntimeError):
    """The tracer cannot be started or marked as asked."""


def _tracer_module() -> Any:
    try:
        from megatron.core.transformer.moe import router_trace
    except ImportError as err:
        raise RouterTraceError(
            f"megatron-core's router tracer is not importable ({err}); it ships with megatron-core >= 0.19"
        ) from None
    return router_trace


def start_router_trace(
    model: Any, directory: str | os.PathLike[str], *, rank: int | None = None, max_steps: int = MAX_STEPS
) -> None:
    """Start megatron-core's tracer (training mode) on every router of ``model`` (a module or a list of
    model chunks), writing ``directory/router_trace_rank{rank}.jsonl``; ``rank`` defaults to this
    process's ``torch.distributed`` rank. A tracer already started for another directory is an error
    (megatron-core keeps one per process and would silently keep the first)."""
    router_trace = _tracer_module()
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    active = router_trace.get_moe_router_tracer()
    if active is not None and os.path.abspath(active.output_dir) != os.path.abspath(directory):
        raise RouterTraceError(
            f"megatron-core's router tracer already writes to {active.output_dir}; expected one directory "
            f"per process, got {os.fspath(directory)}"
        )
    router_trace.init_moe_router_tracer(os.fspath(directory), max_steps, rank, training_mode=True)
    router_trace.get_moe_router_tracer().register_hooks(model)


def mark_step(step: int) -> None:
    """End a training step: its records are stamped ``step`` and written (``advance_step``)."""
    tracer = _tracer_module().get_moe_router_tracer()
    if tracer is None:
        raise RouterTraceError(
            "mark_step: no router tracer started; call start_router_trace(model, directory) first"
        )
    tracer.advance_step(int(step))
