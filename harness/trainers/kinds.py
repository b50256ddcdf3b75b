"""The model kinds the replay suite drives, each with the harness's own knowledge of its routers.

A ``ModelKind`` builds a tiny model per router family, runs a forward (optionally with activation
recompute), attaches the harness's route probe, and says — from the model, never from the subject —
how many MoE layers, experts and experts per token it has and where its router weights are. The
replay suite (``suites/test_replay.py``) is parametrised over (kind × family); the subject only
provides the driver of each kind (``capability``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.probes import RouteProbe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEEP_LAYERS = 12
"""Decoder layers of a deep model: more than ten, so name order (``layers.10`` < ``layers.2``) is not
layer order; every other size stays tiny."""
WIDE_EXPERTS = 384
"""Experts of a wide model (Kimi K2's count): more than 256, so ids above 256 do not survive a cast to
bf16 (which holds every integer only up to 256) or to uint8."""


@functools.cache
def _cached(
    construct: Callable[..., nn.Module], family: str, dtype: str, deep: bool, wide: bool, mtp: bool
) -> nn.Module:
    return construct(family, dtype, deep, wide, mtp)


def _builder(construct: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``build`` over ``construct(family, dtype, deep, wide, mtp)``: cached and deep-copied unless
    ``fresh``."""

    def build(
        family: str,
        dtype: str,
        *,
        fresh: bool = False,
        deep: bool = False,
        wide: bool = False,
        mtp: bool = False,
    ) -> nn.Module:
        return (
            construct(family, dtype, deep, wide, mtp)
            if fresh
            else copy.deepcopy(_cached(construct, family, dtype, deep, wide, mtp))
        )

    return build


@dataclass(frozen=True)
class Routing:
    """What the harness knows about a model's routing: MoE layers (decoder indices), experts, top-k."""

    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int


@dataclass(frozen=True)
class ModelKind:
    """One kind of model the harness builds and observes.

    Attributes:
        name: ``reference`` or ``hf``.
        capability: the subject capability whose driver controls this kind.
        families: the router families (reference) or model types (transformers) it is built for.
        vocab: token ids are drawn from ``[3, vocab)``.
        build: ``(family, dtype, *, fresh=False, deep=False, wide=False, mtp=False) -> model``, a
            private model each call: a
            deep copy of a cached one, or with ``fresh`` one constructed now (what a driver that
            patches router constructors needs: a copy of a model built before its patch never ran
            the patched constructor); with ``deep``, ``DEEP_LAYERS`` decoder layers, so that
            ``layers.10`` sorts before ``layers.2`` as a string; with ``wide``, ``WIDE_EXPERTS`` experts
            (the reference and transformers kinds); with ``mtp``, one multi-token-prediction block after
            the decoder (the reference kind).
        run: ``(model, tokens, attention_mask, position_ids, recompute) -> logits [B, T, V]``.
        probe: attach the harness's route probe (after the subject's driver installed).
        routing: the model's ``Routing``.
        router_weights: every MoE router's weight ``[E, H]``, in MoE-layer order.
    """

    name: str
    capability: str
    families: tuple[str, ...]
    vocab: int
    build: Callable[..., nn.Module]
    run: Callable[..., torch.Tensor]
    probe: Callable[[nn.Module], RouteProbe]
    routing: Callable[[nn.Module], Routing]
    router_weights: Callable[[nn.Module], list[torch.Tensor]]

    def negate_routers(self, model: nn.Module) -> None:
        """Negate every router weight: live logits now prefer the opposite experts."""
        with torch.no_grad():
            for weight in self.router_weights(model):
                weight.neg_()


# --- the reference MoELM ------------------------------------------------------------------------------


def _reference_model(family: str, dtype: str, deep: bool, wide: bool = False, mtp: bool = False) -> nn.Module:
    from reference_impl import MoEConfig, MoELM

    grouped = family == "sigmoid_grouped"
    return MoELM(
        MoEConfig.tiny(
            **({"num_layers": DEEP_LAYERS, "hidden_size": 16} if deep else {}),
            **({"num_experts": WIDE_EXPERTS, "hidden_size": 16} if wide else {}),
            mtp_layers=1 if mtp else 0,
            router_family=family,
            n_group=2 if grouped else 1,
            topk_group=1,
            routed_scaling_factor=2.5 if grouped else 1.0,
            shared_expert=family == "llama4",
            dtype="float32" if dtype == "fp32" else "bfloat16",
            seed=7,
        )
    )


def _reference_run(
    model: nn.Module,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    return model(tokens, attention_mask=attention_mask, position_ids=position_ids, use_checkpoint=recompute)


def _reference_routing(model: nn.Module) -> Routing:
    cfg: Any = model.cfg
    return Routing(tuple(cfg.moe_layers), cfg.num_experts, cfg.top_k)


def _reference_probe(model: nn.Module) -> RouteProbe:
    from harness.probes.reference import attach

    return attach(model)  # type: ignore[arg-type]


def _reference_weights(model: nn.Module) -> list[torch.Tensor]:
    return [router.gate.weight for router in model.routers()]  # type: ignore[operator]


def reference_kind() -> ModelKind:
    from reference_impl import ROUTER_FAMILIES

    return ModelKind(
        "reference",
        "install_replay",
        tuple(ROUTER_FAMILIES),
        64,
        _builder(_reference_model),
        _reference_run,
        _reference_probe,
        _reference_routing,
        _reference_weights,
    )


# --- transformers ----------------------------------------------------------------------------------------


def _hf_model(model_type: str, dtype: str, deep: bool, wide: bool = False, mtp: bool = False) -> nn.Module:
    from harness.trainers.hf import tiny_model
    from harness.trainers.hf.models import expert_count_field

    if mtp:
        raise ValueError("transformers builds no MTP block (num_nextn_predict_layers is not modelled)")
    shape: dict[str, int] = {"num_hidden_layers": DEEP_LAYERS} if deep else {}
    if wide:
        shape[expert_count_field(model_type)] = WIDE_EXPERTS
    return tiny_model(model_type, DTYPES[dtype], **shape)


def _hf_run(
    model: nn.Module,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    on = (
        "is_activation_checkpointing"
        if hasattr(type(model), "is_activation_checkpointing")
        else "is_gradient_checkpointing"
    )
    if recompute and not getattr(model, on, False):
        model.train()
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers ≥ 5.x
        enable() if enable is not None else model.gradient_checkpointing_enable()  # type: ignore[operator]
    kwargs = {
        k: v for k, v in (("attention_mask", attention_mask), ("position_ids", position_ids)) if v is not None
    }
    return model(input_ids=tokens, use_cache=False, **kwargs).logits


def _hf_routers(model: nn.Module) -> list[object]:
    from harness.conventions.hf_routers import find_routers

    return find_routers(model)  # type: ignore[return-value]


def _hf_routing(model: nn.Module) -> Routing:
    routers = _hf_routers(model)
    return Routing(
        tuple(r.layer for r in routers),  # type: ignore[attr-defined]
        routers[0].num_experts,  # type: ignore[attr-defined]
        routers[0].top_k,  # type: ignore[attr-defined]
    )


def _hf_probe(model: nn.Module) -> RouteProbe:
    from harness.probes.hf import attach

    return attach(model)


def _hf_weights(model: nn.Module) -> list[torch.Tensor]:
    return [r.module.weight for r in _hf_routers(model)]  # type: ignore[attr-defined]


def hf_kind() -> ModelKind:
    from harness.trainers.hf import MODEL_TYPES
    from harness.trainers.hf.models import VOCAB

    return ModelKind(
        "hf",
        "install_hf_replay",
        tuple(MODEL_TYPES),
        VOCAB,
        _builder(_hf_model),
        _hf_run,
        _hf_probe,
        _hf_routing,
        _hf_weights,
    )
