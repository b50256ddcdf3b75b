"""The MoE routers of a transformers model: where they are, their family, experts and top-k.

``find_routers`` is the one place a transformers model's routers are found, by module path
(``layers.{i}.mlp.gate``, ``…mlp.router``, ``…feed_forward.router``) and by class (``families``):
the replay hooks (``harness.trainers.hf.replay``) and the probe (``harness.probes.hf``) both start
from it, and neither asks the subject where its routers are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.conventions.hf_families import (
    FAMILIES,
    ROUTER_PATHS,
    RouterFamily,
    family_of,
    routing_param,
    supported,
)
from harness.errors import HarnessError
from reference_impl.routers import RouterReplay


class HFReplayError(HarnessError, ValueError):
    """Replay on a transformers model is misconfigured or did not take effect."""


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


@dataclass
class HookedRouter:
    """One MoE layer's router (decoder index ``layer`` read from its module name), its experts
    module and its record/replay state (``replay``, named after the layer and the module)."""

    name: str
    layer: int
    family: RouterFamily
    module: nn.Module
    experts: nn.Module
    num_experts: int
    top_k: int
    block_routing: Callable[..., Any] | None = None  # ≤ 5.12 DeepSeek/GLM: the block's own routing
    replay: RouterReplay = field(init=False)

    def __post_init__(self) -> None:
        self.replay = RouterReplay(f"decoder layer {self.layer} ({self.name})", self.num_experts, self.top_k)


def parent_module(model: nn.Module, name: str) -> Any:
    """The module that holds ``name`` (typed ``Any``: transformers blocks carry untyped attributes)."""
    return model.get_submodule(name.rpartition(".")[0])


def find_routers(model: nn.Module, families: dict[str, RouterFamily] | None = None) -> list[HookedRouter]:
    """Every MoE router of ``model`` in decoder order, with its family and experts module.

    A module at a router path (``layers.{i}.mlp.gate``, ``…mlp.router``, ``…feed_forward.router``)
    whose class no family lists is an error naming the supported families; dense layers have none.
    """
    families = families or FAMILIES
    routers: list[HookedRouter] = []
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if match is None or match.group(2) not in ROUTER_PATHS:
            continue
        family = family_of(module, families)
        if family is None:
            raise HFReplayError(
                f"{name}: router class {type(module).__name__} belongs to no supported family; "
                f"supported: {supported()}"
            )
        layer = int(match.group(1))
        prefix = name[: match.start(2)]
        try:
            experts = model.get_submodule(prefix + family.experts_path)
        except AttributeError:
            raise HFReplayError(
                f"{name} ({family.name}): no experts module at {prefix + family.experts_path}"
            ) from None
        block = parent_module(model, name)
        block_routing = getattr(block, "route_tokens_to_experts", None)
        if block_routing is not None:  # ≤ 5.12: routing parameters live on the block
            module._rr_block_params = {p: getattr(block, p) for p in family.params if hasattr(block, p)}
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise HFReplayError(f"{name} ({family.name}): expected a router weight [num_experts, hidden]")
        try:
            top_k = routing_param(module, "top_k")
        except AttributeError as err:
            raise HFReplayError(f"{name} ({family.name}): {err}") from None
        routers.append(
            HookedRouter(
                name, layer, family, module, experts, int(weight.shape[0]), int(top_k), block_routing
            )
        )
    if not routers:
        raise HFReplayError(
            f"{type(model).__name__}: no MoE router found "
            f"(looked for layers.{{i}}.{{{','.join(ROUTER_PATHS)}}}); "
            f"supported families: {supported()}"
        )
    routers.sort(key=lambda r: r.layer)
    return routers
