"""Probe of Megatron-core ``GPTModel`` s: what every MoE layer's router chose and its experts received.

For every forward (activation recompute included) and every ``MoELayer``: the expert set each token
was routed to (the router's ``routing_map``, bool ``[local_tokens, E]``), the gate weights it was
given (the router's ``probs``, ``[local_tokens, E]``, zero off the map) with the router logits the
harness computes itself from the router's input and weight, and the token → local-expert
map the all-gather dispatcher actually handed to this rank's experts (``token_dispatcher.local_map``,
read in a pre-hook on ``experts``, with ``tokens_per_expert``). The dispatch map is the evidence: a
replay that never reached the routers, or reached router objects the model does not call, shows
up there whatever the subject reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.errors import MegatronReplayError


@dataclass
class DispatchProbe:
    """Forward hooks recording, per forward call, what each router chose and what was dispatched.

    ``chosen[j]`` is a list (one entry per forward of router ``j``, recompute included) of bool
    ``[local_tokens, E]`` maps; ``dispatched[j]`` of bool ``[gathered_tokens, E/ep]`` maps (tokens the
    all-gather dispatcher handed to this rank's local experts) with ``tokens_per_expert``.
    """

    moe_layers: list[Any]
    chosen: list[list[torch.Tensor]] = field(default_factory=list)
    weights: list[list[torch.Tensor]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)
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
            probe.weights.append([])
            probe.logits.append([])
            probe.dispatched.append([])
            probe.tokens_per_expert.append([])
            probe._handles.append(layer.router.register_forward_hook(probe._on_router(j)))
            probe._handles.append(layer.experts.register_forward_pre_hook(probe._on_experts(j, layer)))
        return probe

    def _on_router(self, j: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            probs, routing_map = output
            hidden = args[0]
            logits = torch.nn.functional.linear(
                hidden.detach().reshape(-1, hidden.shape[-1]).float(), module.weight.detach().float()
            )
            self.chosen[j].append(routing_map.detach().bool().cpu().clone())
            self.weights[j].append(probs.detach().float().cpu().clone())
            self.logits[j].append(logits.cpu())

        return hook

    def _on_experts(self, j: int, layer: Any) -> Any:
        def hook(module: Any, args: Any) -> None:
            self.dispatched[j].append(layer.token_dispatcher.local_map.detach().bool().cpu().clone())
            self.tokens_per_expert[j].append(torch.as_tensor(args[1]).detach().cpu().long().clone())

        return hook

    def clear(self) -> None:
        for lists in (self.chosen, self.weights, self.logits, self.dispatched, self.tokens_per_expert):
            for entries in lists:
                entries.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def expected_gate_weights(logits: torch.Tensor, routing_map: torch.Tensor, config: Any) -> torch.Tensor:
    """The gate weights ``[N, E]`` a token must get for the experts it is routed to, from the training
    model's own logits (R2/R3: the ids are replayed, the weights never are), zero elsewhere.

    Megatron-core's ``topk_routing_with_score_function`` for its score functions: ``softmax`` over the
    chosen experts' logits (over all experts first with ``moe_router_pre_softmax``), ``sigmoid`` of
    each chosen logit normalised over the chosen ones when ``top_k > 1``; then
    ``moe_router_topk_scaling_factor``. Group-limited routing (``moe_router_num_groups``) and the
    aux-loss-free expert bias change which experts are chosen, never the rule: the weights are
    gathered from the unbiased scores at the chosen ids.
    """
    chosen = routing_map.bool()
    masked = logits.float().masked_fill(~chosen, float("-inf"))
    function = getattr(config, "moe_router_score_function", "softmax")
    if function == "softmax":
        if getattr(config, "moe_router_pre_softmax", False):
            weights = torch.softmax(logits.float(), dim=-1) * chosen
        else:
            weights = torch.softmax(masked, dim=-1)
    elif function == "sigmoid":
        weights = torch.sigmoid(logits.float()) * chosen
        if int(config.moe_router_topk) > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise MegatronReplayError(f"expected_gate_weights: score function {function!r} not modelled")
    scale = getattr(config, "moe_router_topk_scaling_factor", None)
    return (weights * scale if scale else weights).masked_fill(~chosen, 0.0)
