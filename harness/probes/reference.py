"""Probe of the reference ``MoELM``: a forward pre-hook on every MoE block's ``dispatch`` step."""

from __future__ import annotations

from typing import Any

from harness.probes import RouteProbe
from reference_impl.model import MoEBlock, MoELM


def attach(model: MoELM) -> RouteProbe:
    """Watch every MoE block of ``model``: ``dispatch(tokens, ids, weights, experts)`` receives the ids
    and gate weights each token is sent with (rows ``b·T + t`` of each call)."""
    blocks = [(i, layer.mlp) for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)]
    probe = RouteProbe(tuple(i for i, _ in blocks))
    for ordinal, (_, block) in enumerate(blocks):

        def hook(module: Any, args: tuple[Any, ...], ordinal: int = ordinal) -> None:
            _, ids, weights, _ = args
            probe.observe(ordinal, ids, weights)

        probe.handles.append(block.dispatch.register_forward_pre_hook(hook))
    return probe
