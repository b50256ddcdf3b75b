"""The reference engine (``reference_impl.RolloutEngine``) as the gate observes it.

Convention: from one rollout of a model with a dense first layer; metrics: the bf16 mismatch lab
(``harness.lab.reference``); invariants: the CPU suites (the optional backends — transformers, Megatron-core,
the engines — have their own gates).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harness.gate.adapters.base import Observation, Suites, lab_metrics, layer_axis, observing, row_rule

if TYPE_CHECKING:
    from harness.conventions import Convention
    from reference_impl import MoELM, RolloutEngine


class ReferenceAdapter:
    """``rrh gate --engine reference``: the reference engine and model of this harness version."""

    name = "reference"
    suites = Suites("not slow and not gpu and not hf and not megatron")

    def installed_version(self) -> str:
        """The harness's version: the reference ships with it."""
        from harness import __version__

        return __version__

    def convention(self, version: str) -> Convention | None:
        """None: the reference declares no payload convention; the gate observes it."""
        return None

    def start(self, model: MoELM) -> RolloutEngine:
        """The reference KV-cache engine on ``model`` (nothing to stop)."""
        from reference_impl import RolloutEngine

        return RolloutEngine(model)

    def observe(self) -> Observation:
        """Convention from a rollout, metrics from the mismatch lab."""
        from harness.lab.reference import run_mismatch_lab

        with observing(self.name, "convention"):
            convention = self.observe_convention()
        with observing(self.name, "mismatch lab metrics"):
            metrics = lab_metrics("lab", run_mismatch_lab())
        return Observation(self.name, self.installed_version(), convention, metrics)

    def observe_convention(self) -> dict[str, Any]:
        """Row rule, dtype and layer axis of the reference engine, from a rollout (a dense first layer)."""
        import torch

        from harness.trace import RoutingTrace
        from reference_impl import MoEConfig, MoELM

        cfg = MoEConfig(num_layers=3, first_k_dense=1, num_experts=8, top_k=2)
        prompt_len, response_len = 5, 4
        prompt = torch.arange(3, 3 + prompt_len)
        rollout = self.start(MoELM(cfg)).generate([prompt], response_len)[0]
        if rollout.routes is None:
            raise ValueError("the rollout carries no routes")
        rows, width = int(rollout.routes.shape[0]), int(rollout.routes.shape[1])
        trace = RoutingTrace(
            rollout.routes, num_experts=cfg.num_experts, moe_layers=cfg.moe_layers, num_layers=cfg.num_layers
        )
        dense = [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]
        return {
            "payload_dtype": str(rollout.routes.dtype).removeprefix("torch."),
            "dtype": str(trace.experts.dtype),
            "row_rule": row_rule(rows, prompt_len, len(rollout.tokens)),
            "layer_axis": layer_axis(width, cfg.num_layers, len(cfg.moe_layers)),
            "dense_slots_zero": bool((rollout.routes[:, dense] == 0).all()),
        }
