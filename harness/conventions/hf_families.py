"""Router families of the MoE models transformers ships (FACTS §3), keyed by gate-weight semantics.

A *family* is what replay must reproduce: how a router's return value is read (where the logits and
the chosen ids are), how it is rebuilt around forced ids, and the gate-weight rule at given ids with
its exact dtype behaviour. Each family lists the router classes that have its semantics, so a model
is matched by what its routers compute, not by where they sit. The rules below were read from the
installed transformers (5.23) and are cited by file; each one reproduces the router's own arithmetic
op for op, so replaying a router's natural choice is bit-exact in fp32 and bf16.

The rule is a plain function ``(router, logits, ids) -> weights``; a variant that applies one rule to
every family (SkyRL's structural "mlp.gate + softmax" hook, FACTS §2) is
``{name: f.with_rule(softmax_rule) for name, f in FAMILIES.items()}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WeightRule = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(router, logits [T, E], ids [T, k] int64) -> weights [T, k]``: the gate weights at ``ids``."""


class RuleNotApplicable(ValueError):
    """A gate-weight rule cannot compute weights for this router: it lacks a routing parameter the
    rule reads, or routes a ``k`` the rule does not handle. Asking which rules reproduce a router's
    weights (``rrh gate``), such a rule is simply not one of them."""


class MissingRoutingParameter(RuleNotApplicable, AttributeError):
    """The router has no such routing hyper-parameter (an ``AttributeError`` too)."""


def routing_param(router: nn.Module, name: str) -> Any:
    """A routing hyper-parameter of ``router``; transformers ≤ 5.12 kept some on the parent block
    (``HFReplay`` copies them onto ``router._rr_block_params`` at install)."""
    if hasattr(router, name):
        return getattr(router, name)
    block_params: dict[str, Any] = getattr(router, "_rr_block_params", {})
    if name in block_params:
        return block_params[name]
    raise MissingRoutingParameter(f"router {type(router).__name__} has no routing parameter {name!r}")


# --- weight rules ---------------------------------------------------------------------------------


def softmax_topk_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE, Qwen3-MoE, Qwen3-Next, OlMoE (``modeling_{qwen2_moe,qwen3_moe,qwen3_next,olmoe}.py``,
    ``*TopKRouter.forward``): softmax in fp32, gather, renormalise if ``norm_topk_prob``, cast to the
    logits dtype."""
    weights = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if routing_param(router, "norm_topk_prob"):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_topk_renorm_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE (``modeling_qwen3_5_moe.py``, ``Qwen3_5MoeTopKRouter.forward``): as the Qwen rule,
    always renormalised (the router has no ``norm_topk_prob``), cast to the logits dtype."""
    weights = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def softmax_topk_fp32_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mixtral, MiniMax (``modeling_{mixtral,minimax}.py``, ``*TopKRouter.forward``): softmax of the
    logits cast to fp32, gather, always renormalised, and the weights **stay fp32** (the experts
    multiply in fp32 and cast the product; casting the weights to bf16 first moves logits ~3e-3)."""
    weights = torch.nn.functional.softmax(logits.float(), dim=-1).gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True)


def sigmoid_grouped_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3, GLM4-MoE (``modeling_{deepseek_v3,glm4_moe}.py``, ``*TopkRouter.forward`` ≥ 5.13,
    ``*MoE.route_tokens_to_experts`` ≤ 5.12): sigmoid of the fp32 logits at the ids (the
    ``e_score_correction_bias`` and the group limit only steer the choice), renormalised with
    ``+ 1e-20`` if ``norm_topk_prob``, times ``routed_scaling_factor``; fp32."""
    weights = logits.sigmoid().gather(1, ids)
    if routing_param(router, "norm_topk_prob"):
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing_param(router, "routed_scaling_factor")


def topk_softmax_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """GPT-OSS (``modeling_gpt_oss.py``, ``GptOssTopKRouter.forward``): softmax over the k logits at the
    ids (top-k first, then softmax), in the logits dtype."""
    top = logits.gather(1, ids)
    return torch.nn.functional.softmax(top, dim=1, dtype=top.dtype)


def llama4_sigmoid_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Llama 4 (``modeling_llama4.py``, ``Llama4Router.forward``): sigmoid in fp32 of the logits at the
    ids, cast to the logits dtype. The router takes the sigmoid of a dense ``[T, E]`` matrix of
    ``-inf`` holding the logits at the ids; so does this rule (the vectorised sigmoid rounds a dense
    row differently from a gathered ``[T, k]`` one, by ~3e-8 in fp32). ``LLAMA4_SCORES`` scatters the
    weights back into that matrix, whose other entries are ``sigmoid(-inf) = 0``."""
    dense = torch.full_like(logits, float("-inf")).scatter(1, ids, logits.gather(1, ids))
    return torch.sigmoid(dense.float()).to(logits.dtype).gather(1, ids)


def sparsemixer_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """PhiMoE (``modeling_phimoe.py``, ``sparsemixer``, eval branch), top-2 only and ordered.

    Slot 1: softmax over the experts whose score lies within ``2·router_jitter_noise`` (relative) of
    the slot-1 expert's score, taken at that expert. Slot 2: the same around the slot-2 expert with
    the slot-1 expert masked out. Natively the slot-1 expert is the arg-max and the slot-2 expert the
    runner-up, so the thresholds are the maxima ``sparsemixer`` uses. In training mode PhiMoE samples
    the experts (Gumbel) and applies a Heun-method gradient estimator (``PhimoeMultiplier``); replay
    keeps the eval-mode weights, whose gradient is the plain softmax gradient.
    """
    if ids.shape[1] != 2:
        raise RuleNotApplicable(f"PhiMoE sparsemixer routes top-2, got replay ids of shape {list(ids.shape)}")
    eps = 2 * routing_param(router, "router_jitter_noise")
    first, second = ids[:, :1], ids[:, 1:]
    threshold = logits.gather(1, first)
    outside = ((threshold - logits) / logits.abs().clamp(min=threshold)) > eps
    weight_first = torch.softmax(logits.masked_fill(outside, float("-inf")), dim=-1).gather(1, first)
    masked = torch.scatter(logits, -1, first, float("-inf"))
    threshold = logits.gather(1, second)
    outside = ((threshold - logits) / logits.abs().clamp(min=threshold)) > eps
    weight_second = torch.softmax(masked.masked_fill(outside, float("-inf")), dim=-1).gather(1, second)
    return torch.cat((weight_first, weight_second), dim=-1)


def softmax_rule(router: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """SkyRL's structural rule for every ``mlp.gate`` (PR #1772, FACTS §2): softmax in fp32, gather,
    renormalise if ``norm_topk_prob`` (default on), cast to the logits dtype. Correct for the Qwen
    family only: the harness uses it to build the "wrong gate rule" mutant, never for replay."""
    weights = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(1, ids)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


# --- return values --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readout:
    """How a router's return value is read and rebuilt.

    ``read(router, output) -> (logits [T, E], ids [T, k])`` and
    ``build(output, logits, weights, ids) -> output`` (the router's return value around forced ids).
    ``dispatched(args, kwargs, num_experts, top_k) -> ids [T, k]`` reads the ids the experts get:
    from the experts module's inputs when ``dispatched_at == "experts"``, from the router's final
    return value (``args = output``, after replay) when ``"router"``.
    """

    name: str
    read: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
    build: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], Any]
    dispatched: Callable[[tuple[Any, ...], dict[str, Any], int, int], torch.Tensor]
    dispatched_at: str = "experts"


def _triple_read(router: nn.Module, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    logits, _, ids = output
    return logits, ids


def _triple_build(output: Any, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
    return logits, weights, ids


def _ids_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_experts: int, top_k: int
) -> torch.Tensor:
    """``experts(hidden, ids, weights)``: every family but Llama 4 passes the ids second."""
    if len(args) > 1:
        return args[1]
    for name in ("top_k_index", "router_indices", "selected_experts"):
        if name in kwargs:
            return kwargs[name]
    raise ValueError("experts module was called without expert ids (expected them as its second argument)")


TRIPLE = Readout("(logits, weights, ids)", _triple_read, _triple_build, _ids_argument)
"""Every family but Llama 4 (DeepSeek-V3/GLM4 from transformers 5.13)."""


def _llama4_read(router: nn.Module, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    _, logits = output
    # Llama4Router returns no ids: its own top-k, recomputed on the same tensor (deterministic).
    return logits, torch.topk(logits, routing_param(router, "top_k"), dim=1)[1]


def _llama4_build(output: Any, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Any:
    return torch.zeros_like(logits).scatter(1, ids, weights), logits


def _llama4_dispatched(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_experts: int, top_k: int
) -> torch.Tensor:
    """Llama4TextMoe multiplies each token's copy for expert e by its dense score ``[T, E]``: the
    experts a token is dispatched to are its non-zero scores. Read from the router's final output
    (after replay), not from the experts' input, where a token whose hidden state is 0 (padding) is 0
    for every expert."""
    scores = args[0]
    hit = scores.ne(0)
    counts = hit.sum(-1)
    if not bool((counts == top_k).all()):
        row = int((counts != top_k).nonzero()[0])
        raise ValueError(
            f"llama4 router output gives token {row} {int(counts[row])} non-zero expert scores, "
            f"expected top_k={top_k}"
        )
    return hit.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[:, :top_k]


LLAMA4_SCORES = Readout(
    "(dense scores [T, E], logits)", _llama4_read, _llama4_build, _llama4_dispatched, dispatched_at="router"
)
"""Llama 4: dense sigmoid scores and the logits, no ids."""


# --- the registry ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterFamily:
    """One router family: its routers, their return value and the gate-weight rule.

    Attributes:
        name: the family key (``FAMILIES``).
        models: the model families that use it, for messages.
        router_classes: ``type(router).__name__`` of every transformers router with these semantics.
        router_path: the router's name inside a decoder layer (``layers.{i}.<router_path>``).
        experts_path: the experts module's name inside a decoder layer (where dispatched ids are read,
            unless the readout reads them from the router).
        readout: how the router's return value is read and rebuilt.
        rule: the gate weights at given ids from the live logits.
        params: routing hyper-parameters the rule reads (copied from the block if the router lacks them).
    """

    name: str
    models: tuple[str, ...]
    router_classes: tuple[str, ...]
    router_path: str
    experts_path: str
    readout: Readout
    rule: WeightRule
    params: tuple[str, ...] = ()

    def with_rule(self, rule: WeightRule) -> RouterFamily:
        """This family with another gate-weight rule (to build a mutant)."""
        return dataclasses.replace(self, rule=rule)


FAMILIES: dict[str, RouterFamily] = {
    f.name: f
    for f in (
        RouterFamily(
            "softmax_topk",
            ("Qwen2-MoE", "Qwen3-MoE", "Qwen3-Next", "OlMoE"),
            ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "OlmoeTopKRouter"),
            "mlp.gate",
            "mlp.experts",
            TRIPLE,
            softmax_topk_rule,
            ("norm_topk_prob",),
        ),
        RouterFamily(
            "softmax_topk_renorm",
            ("Qwen3.5-MoE",),
            ("Qwen3_5MoeTopKRouter",),
            "mlp.gate",
            "mlp.experts",
            TRIPLE,
            softmax_topk_renorm_rule,
        ),
        RouterFamily(
            "softmax_topk_fp32",
            ("Mixtral", "MiniMax"),
            ("MixtralTopKRouter", "MiniMaxTopKRouter"),
            "mlp.gate",
            "mlp.experts",
            TRIPLE,
            softmax_topk_fp32_rule,
        ),
        RouterFamily(
            "sigmoid_grouped",
            ("DeepSeek-V3", "GLM4-MoE"),
            ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter"),
            "mlp.gate",
            "mlp.experts",
            TRIPLE,
            sigmoid_grouped_rule,
            ("norm_topk_prob", "routed_scaling_factor", "top_k"),
        ),
        RouterFamily(
            "topk_softmax",
            ("GPT-OSS",),
            ("GptOssTopKRouter",),
            "mlp.router",
            "mlp.experts",
            TRIPLE,
            topk_softmax_rule,
        ),
        RouterFamily(
            "llama4",
            ("Llama 4",),
            ("Llama4Router",),
            "feed_forward.router",
            "feed_forward.experts",
            LLAMA4_SCORES,
            llama4_sigmoid_rule,
            ("top_k",),
        ),
        RouterFamily(
            "sparsemixer",
            ("PhiMoE",),
            ("PhimoeTopKRouter",),
            "mlp.router",
            "mlp.experts",
            TRIPLE,
            sparsemixer_rule,
            ("router_jitter_noise",),
        ),
    )
}
"""Every supported router family, by name."""

ROUTER_PATHS: tuple[str, ...] = tuple(sorted({f.router_path for f in FAMILIES.values()}))
"""Where routers sit inside a decoder layer; a module there whose class no family lists is an error."""


def family_of(router: nn.Module, families: dict[str, RouterFamily] | None = None) -> RouterFamily | None:
    """The family whose ``router_classes`` include ``type(router).__name__``, or ``None``."""
    cls = type(router).__name__
    for family in (families or FAMILIES).values():
        if cls in family.router_classes:
            return family
    return None


def supported() -> str:
    """The supported families, for error messages: ``name (models: router classes)``."""
    return "; ".join(
        f"{f.name} ({', '.join(f.models)}: {', '.join(f.router_classes)})" for f in FAMILIES.values()
    )
