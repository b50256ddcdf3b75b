"""The mismatch lab's measurement: where routing replay must earn its keep (DESIGN §3.10, §6).

A bf16 MoE model samples rollouts through its KV cache (prefill, then one-token decode steps), the
way an inference engine does; the trainer then recomputes the same sequences with one full forward.
The two computations round differently, near-tied routers flip, and the sampled tokens' log-probs
drift apart. The lab measures, for the trainer without replay and with R3 (rollout routes replayed
through the subject's ``install_replay``):

- routing disagreement between rollout and trainer per (position, MoE layer), per layer and per
  token (DESIGN §3.3 set comparison);
- the log-prob gap on response tokens (``harness.metrics``), over all of them and over the tokens
  whose routing had flipped (the input position that produced their logits routed differently in
  at least one layer without replay).

R3 must make the disagreement exactly 0 and shrink the gap on the flipped tokens.

Here: the lab's configuration and model, the scoring of the trainer's two passes against a rollout
(any engine, any model: the engines call :func:`lab_result`), and the terminal table. Running the
lab on the reference engine with a subject's replay driver is ``harness.lab.reference`` (it needs a subject).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from harness.metrics.accumulator import LogprobGap, logprob_gap
from harness.table import format_table
from harness.trace import RoutingComparison, route_overlap
from reference_impl import MoEConfig, MoELM


@dataclass(frozen=True)
class LabConfig:
    """The lab's model and batch. The defaults are DESIGN §6's CPU mismatch lab: bf16, 64 experts top-8."""

    family: str = "softmax_topk"
    num_experts: int = 64
    top_k: int = 8
    num_layers: int = 4
    hidden_size: int = 64
    batch: int = 8
    prompt_len: int = 16
    response_len: int = 48
    dtype: str = "bfloat16"
    seed: int = 0


@dataclass(frozen=True)
class LabArm:
    """One trainer setting: its routing against the rollout's, and its log-prob gap."""

    name: str
    routing: RoutingComparison
    gap: LogprobGap
    gap_on_flipped: LogprobGap
    abs_delta: np.ndarray | None = field(default=None, repr=False, compare=False)
    """|Δ log-prob| of every response token, in (sample, position) order (for histograms)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "disagreement": self.routing.disagreement,
            "token_disagreement": self.routing.token_disagreement,
            "per_layer_disagreement": self.routing.per_layer.tolist(),
            "gap": self.gap.as_dict(),
            "gap_on_flipped": self.gap_on_flipped.as_dict(),
        }


@dataclass(frozen=True)
class LabResult:
    """The lab's two arms on the same rollouts."""

    config: LabConfig
    without_replay: LabArm
    with_r3: LabArm
    flipped_tokens: int
    response_tokens: int
    flipped_mask: np.ndarray | None = field(default=None, repr=False, compare=False)
    """Per response token, aligned with ``LabArm.abs_delta``: True where its routing had flipped."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "flipped_tokens": self.flipped_tokens,
            "response_tokens": self.response_tokens,
            "arms": [self.without_replay.as_dict(), self.with_r3.as_dict()],
        }


def build_model(cfg: LabConfig) -> MoELM:
    """The lab's reference model, deterministic from ``cfg.seed``."""
    grouped = cfg.family == "sigmoid_grouped"
    return MoELM(
        MoEConfig(
            vocab_size=256,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers,
            num_heads=4,
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            expert_hidden=32,
            router_family=cfg.family,
            n_group=8 if grouped else 1,
            topk_group=4 if grouped else 1,
            shared_expert=cfg.family == "llama4",
            dtype=cfg.dtype,
            seed=cfg.seed,
        )
    )


def lab_result(
    cfg: LabConfig,
    moe_layers: tuple[int, ...],
    targets: torch.Tensor,
    mask: torch.Tensor,
    native: tuple[torch.Tensor, torch.Tensor],
    r3: tuple[torch.Tensor, torch.Tensor],
    infer_logprobs: torch.Tensor,
) -> LabResult:
    """Score the trainer's two passes against the rollout (any engine, any model).

    ``targets`` ``[B·W, n_moe, k]`` and ``mask`` ``[B·W]`` are the rollout routes in the trainer's
    row order (``W = prompt_len + response_len``, no padding); ``native`` and ``r3`` are each
    pass's dispatched routes and ``[B, W]`` token log-probs; ``infer_logprobs`` ``[B, R]`` are the
    rollout's sampled-token log-probs.
    """
    batch, width = cfg.batch, cfg.prompt_len + cfg.response_len
    rows = mask.nonzero().squeeze(1)  # every position that has a rollout row

    def compare_rows(routes: torch.Tensor) -> RoutingComparison:
        overlap = route_overlap(targets[rows].numpy(), routes[rows].numpy())
        return RoutingComparison(overlap, cfg.top_k, moe_layers)

    without, with_r3 = compare_rows(native[0]), compare_rows(r3[0])
    response = torch.zeros(batch, width, dtype=torch.bool)
    response[:, cfg.prompt_len :] = True
    # Response token at column c was sampled from the logits of input column c − 1.
    flipped_rows = torch.zeros(batch * width, dtype=torch.bool)
    flipped_rows[rows] = torch.from_numpy(without.differs.any(axis=1))
    flipped = torch.zeros_like(response)
    flipped[:, 1:] = flipped_rows.reshape(batch, width)[:, :-1]
    flipped &= response
    infer = torch.zeros(batch, width)
    infer[:, cfg.prompt_len :] = infer_logprobs

    def arm(name: str, lp: torch.Tensor, routing: RoutingComparison) -> LabArm:
        gap, gap_on_flipped = (
            logprob_gap(lp, infer, response.numpy()),
            logprob_gap(lp, infer, flipped.numpy()),
        )
        abs_delta = (lp.double() - infer.double()).abs()[response].numpy()
        return LabArm(name, routing, gap, gap_on_flipped, abs_delta)

    return LabResult(
        cfg,
        arm("no replay", native[1], without),
        arm("R3", r3[1], with_r3),
        int(flipped.sum()),
        int(response.sum()),
        flipped[response].numpy(),
    )


def format_lab(result: LabResult) -> str:
    """The lab as a terminal table: one row per arm, then the per-layer profile."""
    cfg = result.config
    head = (
        f"mismatch lab: {cfg.family}, {cfg.num_experts} experts top-{cfg.top_k}, {cfg.num_layers} layers, "
        f"{cfg.dtype}; {cfg.batch} rollouts × {cfg.response_len} tokens by KV-cache decode vs one full "
        f"forward; {result.flipped_tokens} of {result.response_tokens} response tokens had flipped routing"
    )
    rows = []
    for a in (result.without_replay, result.with_r3):
        rows.append(
            (
                a.name,
                f"{a.routing.disagreement:.4f}",
                f"{a.routing.token_disagreement:.4f}",
                f"{a.gap.mean_abs_diff:.3e}",
                f"{a.gap.max_abs_diff:.3e}",
                f"{a.gap.k3:.3e}",
                f"{a.gap.extreme_fraction:.4f}",
                f"{a.gap_on_flipped.mean_abs_diff:.3e}",
            )
        )
    table = format_table(
        ("trainer", "route disagr.", "token disagr.", "mean|Δ|", "max|Δ|", "k3", "F(2)", "mean|Δ| flipped"),
        rows,
    )
    profile = " ".join(f"{x:.3f}" for x in np.asarray(result.without_replay.routing.per_layer))
    return f"{head}\n{table}\nper-layer disagreement without replay: {profile}"
