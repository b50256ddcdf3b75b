"""Probe of Megatron-core ``GPTModel`` s: what every MoE layer's router chose and its experts received.

For every forward (activation recompute included) and every ``MoELayer``: the expert set each token
was routed to (the router's ``routing_map``, bool ``[local_tokens, E]``) and the token → local-expert
map the all-gather dispatcher actually handed to this rank's experts (``token_dispatcher.local_map``,
read in a pre-hook on ``experts``, with ``tokens_per_expert``). The dispatch map is the evidence: a
replay that never reached the routers, or reached router objects the model does not call, shows
up there whatever the subject reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.trainers.megatron.layout import MegatronReplayError


@dataclass
class DispatchProbe:
    """Forward hooks recording, per forward call, what each router chose and what was dispatched.

    ``chosen[j]`` is a list (one entry per forward of router ``j``, recompute included) of bool
    ``[local_tokens, E]`` maps; ``dispatched[j]`` of bool ``[gathered_tokens, E/ep]`` maps (tokens the
    all-gather dispatcher handed to this rank's local experts) with ``tokens_per_expert``.
    """

    moe_layers: list[Any]
    chosen: list[list[torch.Tensor]] = field(default_factory=list)
    dispatched: list[list[torch.Tensor]] = field(default_factory=list)
    tokens_per_expert: list[list[torch.Tensor]] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)

    @classmethod
    def attach(cls, *modules: torch.nn.Module) -> DispatchProbe:
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

        layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
        probe = cls(layers)
        for j, layer in enumerate(layers):
            if not isinstance(layer.token_dispatcher, MoEAllGatherTokenDispatcher):
                raise MegatronReplayError(
                    f"DispatchProbe reads the all-gather dispatcher's local_map; layer {j} uses "
                    f"{type(layer.token_dispatcher).__name__}"
                )
            probe.chosen.append([])
            probe.dispatched.append([])
            probe.tokens_per_expert.append([])
            probe._handles.append(layer.router.register_forward_hook(probe._on_router(j)))
            probe._handles.append(layer.experts.register_forward_pre_hook(probe._on_experts(j, layer)))
        return probe

    def _on_router(self, j: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            _, routing_map = output
            self.chosen[j].append(routing_map.detach().bool().cpu().clone())

        return hook

    def _on_experts(self, j: int, layer: Any) -> Any:
        def hook(module: Any, args: Any) -> None:
            self.dispatched[j].append(layer.token_dispatcher.local_map.detach().bool().cpu().clone())
            self.tokens_per_expert[j].append(torch.as_tensor(args[1]).detach().cpu().long().clone())

        return hook

    def clear(self) -> None:
        for lists in (self.chosen, self.dispatched, self.tokens_per_expert):
            for entries in lists:
                entries.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
