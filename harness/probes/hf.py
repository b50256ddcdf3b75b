"""Probe of transformers MoE models: what every family's experts module actually receives.

Every family but Llama 4 calls ``experts(hidden, top_k_index, top_k_weights)``: a forward pre-hook on
``mlp.experts`` sees the dispatched ids as ``args[1]`` and the gate weights as ``args[2]`` (FACTS §3).
Llama 4 scales each token's copy for expert ``e`` by a dense score ``[T, E]`` (0 off its experts): the
probe reads the router's *final* output (hooks registered after the subject's, so it sees what the
block consumes) — the experts a token reaches are its non-zero scores, its weights those scores.
Routers are found by the harness (``find_routers``), not asked of the subject.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.conventions.hf_families import FAMILIES
from harness.conventions.hf_routers import find_routers
from harness.probes import RouteProbe

_IDS = ("top_k_index", "router_indices", "selected_experts")
_WEIGHTS = ("top_k_weights", "routing_weights", "router_weights")


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, names: tuple[str, ...]) -> Any:
    if len(args) > position:
        return args[position]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    raise ValueError(f"experts module called without argument {position} ({'/'.join(names)})")


def attach(model: nn.Module, keep: int | None = None) -> RouteProbe:
    """Watch every MoE layer of a transformers model (attach *after* the subject installs its hooks)."""
    routers = find_routers(model, FAMILIES)
    probe = RouteProbe(tuple(r.layer for r in routers), keep)
    for ordinal, r in enumerate(routers):
        if r.family.readout.dispatched_at == "router":

            def after_router(module: Any, args: Any, output: Any, ordinal: int = ordinal, r: Any = r) -> None:
                scores = output[0]
                ids = r.family.readout.dispatched((scores,), {}, r.num_experts, r.top_k)
                probe.observe(ordinal, ids, scores.gather(1, ids))

            probe.handles.append(r.module.register_forward_hook(after_router))
        else:

            def before_experts(module: Any, args: Any, kwargs: Any, ordinal: int = ordinal) -> None:
                ids = _argument(args, kwargs, 1, _IDS)
                weights = _argument(args, kwargs, 2, _WEIGHTS)
                probe.observe(ordinal, torch.as_tensor(ids), torch.as_tensor(weights))

            probe.handles.append(r.experts.register_forward_pre_hook(before_experts, with_kwargs=True))
    return probe
