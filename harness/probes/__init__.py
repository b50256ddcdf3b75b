"""Harness-owned route probes: what each token's hidden state was dispatched to, observed by the harness.

A probe watches the point where routing takes effect — the dispatch step or the experts' inputs —
never a router's return value or anything a subject reports (DESIGN §4 "subject seam"). Per MoE layer
it keeps every call (activation recompute included): the expert ids ``[tokens, top_k]`` each token
was sent to and the gate weights it was sent with.

- ``harness.probes.reference``: the reference ``MoELM`` (a pre-hook on each block's ``dispatch``);
- ``harness.probes.hf``: transformers MoE families (a pre-hook on ``mlp.experts``, which receives
  ``(hidden, ids, weights)``; Llama 4's dense scores read from its router's final output);
- ``harness.probes.megatron``: Megatron-core ``GPTModel`` (the token → local-expert map the
  dispatcher hands to the experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Dispatch:
    """One forward of every probed MoE layer: ids ``[tokens, n_moe, top_k]`` int64 and their gate
    weights ``[tokens, n_moe, top_k]`` (the dtype the experts received them in), both on the CPU."""

    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class RouteProbe:
    """Per MoE layer (model order), every call's dispatched ids and weights; ``remove()`` detaches it."""

    layers: tuple[int, ...]
    keep: int | None = None  # calls kept per layer (None: all; an HF handle's own ``dispatched`` keeps 1)
    ids: list[list[torch.Tensor]] = field(default_factory=list)
    weights: list[list[torch.Tensor]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.ids = [[] for _ in self.layers]
        self.weights = [[] for _ in self.layers]

    def observe(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Keep one call of MoE layer ``layer`` (its ordinal)."""
        self.ids[layer].append(ids.detach().to("cpu", torch.int64).clone())
        self.weights[layer].append(weights.detach().to("cpu").clone())
        if self.keep is not None and len(self.ids[layer]) > self.keep:
            del self.ids[layer][0], self.weights[layer][0]

    @property
    def calls(self) -> list[int]:
        """Calls seen per MoE layer."""
        return [len(c) for c in self.ids]

    def call(self, index: int = -1) -> Dispatch:
        """Call ``index`` (in call order, recompute included) of every layer, stacked over layers."""
        calls = self.calls
        if not calls or min(calls) == 0 or len(set(calls)) != 1:
            raise ProbeError(f"probe: calls per MoE layer {calls}, expected the same non-zero number")
        return Dispatch(
            torch.stack([c[index] for c in self.ids], dim=1),
            torch.stack([c[index] for c in self.weights], dim=1),
        )

    def last(self) -> Dispatch:
        """The last forward's dispatch."""
        return self.call(-1)

    def clear(self) -> None:
        for lists in (self.ids, self.weights):
            for entries in lists:
                entries.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class ProbeError(RuntimeError):
    """A probe saw nothing, or not the same number of calls at every MoE layer."""
