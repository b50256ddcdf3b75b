"""Weight updates of a running vLLM, as a framework's weight sync makes them between partial-rollout
attempts or turns (fully-async RL): what the real-engine splice suites need to make a re-prefilled
row really differ from the row first computed.

``negate_routers`` negates every MoE router weight of vLLM's model in place (live routing then
prefers other experts; twice restores it bit for bit). ``weight_updates(engine)`` gives the
``update_weights(version)`` callback of ``reference_impl.episode.run_episode``: each call negates
the routers through ``LLM.apply_model`` and resets the prefix cache (cached KV was computed under the
old weights, as a framework's sync does); the original weights are back when the block ends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.errors import HarnessError

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
