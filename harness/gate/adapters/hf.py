"""transformers as the gate observes it: per model family, what its router does.

For each family (``harness.trainers.hf.MODEL_TYPES``): the router's class, what it returns
(``tuple[3]``, ``tuple[2]`` or ``tensor`` — logits only), which gate-weight rules reproduce its
weights bit for bit on a fixed probe at its own ids, whether the family rule's replay is bit-exact,
and how far the SkyRL softmax rule moves the logits (a metric). A transformers upgrade that changes
a router's return signature or weight rule fails the gate. Convention: from the transformers
KV-cache engine (``harness.engines.hf``); metrics: also the mismatch lab on a real Qwen3-MoE;
invariants: ``suites/test_hf.py`` and ``conformance/test_hf_engine.py``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from harness.gate.adapters.base import (
    Observation,
    ObservationError,
    Suites,
    lab_metrics,
    layer_axis,
    observing,
    row_rule,
)
from harness.gate.baseline import metric

if TYPE_CHECKING:
    import torch

    from harness.conventions import Convention
    from harness.trainers.hf import HFReplay
    from harness.trainers.hf.replay import HookedRouter

NO_BLOCK_ROUTING = "logits only and no block route_tokens_to_experts"
"""Why a router's weights cannot be read: it returns logits only and its block has no routing."""


def _describe_return(output: Any) -> str:
    import torch

    if isinstance(output, torch.Tensor):
        return "tensor"
    if isinstance(output, tuple):
        return f"tuple[{len(output)}]"
    return type(output).__name__


def _candidate_rules() -> dict[str, Any]:
    from harness.conventions import hf_families as families

    rules = {f.name: f.rule for f in families.FAMILIES.values()}
    rules["softmax (SkyRL)"] = families.softmax_rule
    return rules


def _reproduces(
    rule: Any, router: Any, logits: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> bool:
    """Whether ``rule`` gives exactly ``weights`` (values and dtype); a rule that does not apply to this
    router (``RuleNotApplicable``: a parameter it lacks, a k it does not route) does not."""
    import torch

    from harness.conventions.hf_families import RuleNotApplicable

    try:
        with torch.no_grad():
            got = rule(router, logits, ids)
    except RuleNotApplicable:
        return False
    return bool(got.shape == weights.shape and got.dtype == weights.dtype and torch.equal(got, weights))


def _own_weights(router: HookedRouter, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(logits, ids, weights)``: the router's own weights at its own ids, read from its ``output``
    (a ``HookedRouter``'s first forward); None when it returns logits only and its block has no
    ``route_tokens_to_experts`` to route them."""
    import torch

    from harness.conventions import hf_families as families

    with torch.no_grad():
        if isinstance(output, torch.Tensor):  # logits only: the block routes
            if router.block_routing is None:
                return None
            ids, weights = router.block_routing(output)
            return output, ids, weights
        logits, ids = router.family.readout.read(router.module, output)
        weights = output[0] if router.family.readout is families.LLAMA4_SCORES else output[1]
        if weights.shape[-1] != ids.shape[-1]:  # dense [T, E] scores: the weights at the ids
            weights = weights.gather(1, ids)
        return logits, ids, weights


class HFAdapter:
    """``rrh gate --engine hf``; ``model_types`` restricts the families (default: every one harness
    builds), ``lab=False`` leaves out the mismatch lab (both for quick tests)."""

    name = "hf"
    suites = Suites(
        "hf and not slow", ("suites/test_replay.py", "suites/test_hf.py", "conformance/test_hf_engine.py")
    )

    def __init__(self, *, lab: bool = True, model_types: Sequence[str] | None = None) -> None:
        self.lab = lab
        self.model_types = tuple(model_types) if model_types else None

    def installed_version(self) -> str | None:
        """The installed transformers, or None."""
        try:
            return importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            return None

    def convention(self, version: str) -> Convention | None:
        """None: transformers declares no payload convention; the gate observes it."""
        return None

    def start(self, model: Any) -> HFReplay:
        """The transformers KV-cache engine on ``model``: its replay hooks, through which
        ``harness.engines.hf.generate_rollouts`` records routes (the caller removes them)."""
        from harness.trainers.hf import install_replay

        return install_replay(model)

    def observe(self) -> Observation:
        """Every family's router facts and logit move, the lab's metrics, the engine's convention."""
        import transformers

        from harness.trainers.hf import MODEL_TYPES

        families: dict[str, Any] = {}
        metrics: dict[str, dict[str, Any]] = {}
        for model_type in self.model_types or MODEL_TYPES:
            families[model_type] = self.observe_family(model_type)
            name = f"hf.{model_type}.softmax_rule_logit_move"
            with observing(self.name, f"metric {name}"):
                move = self.softmax_rule_logit_move(model_type)
                metrics[name] = metric(move, max(1e-6, 0.25 * move), "equal")
        if self.lab:
            from harness.lab.hf import run_hf_mismatch_lab
            from harness.lab.measure import LabConfig

            with observing(self.name, "mismatch lab metrics"):
                result = run_hf_mismatch_lab(LabConfig(family="qwen3_moe", batch=4, response_len=32))
                metrics.update(lab_metrics("lab", result))
        with observing(self.name, "convention"):
            convention = self.observe_convention()
        version = str(transformers.__version__)
        return Observation(self.name, version, convention, metrics, {"families": families})

    def observe_family(self, model_type: str, *, seed: int = 0) -> dict[str, Any]:
        """One family's router: class, return signature, the rules that reproduce its weights bit for
        bit, and whether replaying its natural routing with its family rule is bit-exact.

        A router that returns logits only from a block without ``route_tokens_to_experts`` has no
        weights to read: ``bit_exact_rules`` is empty and ``readout_error`` says so (recorded, so a
        change either way is a diff). Any other failure is an ``ObservationError``.
        """
        import torch

        from harness.conventions.hf_routers import find_routers
        from harness.trainers.hf import install_replay, tiny_model
        from harness.trainers.hf.replay import HFReplayError

        what = f"observations.families.{model_type}"
        with observing(self.name, what):
            model = tiny_model(model_type, torch.float32, seed=seed)
            probe = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
            first = find_routers(model)[0]
            seen: dict[str, Any] = {}
            hook = first.module.register_forward_hook(lambda m, a, out: seen.setdefault("output", out))
            with torch.no_grad():
                model(input_ids=probe, use_cache=False)
            hook.remove()
            output = seen["output"]
            entry: dict[str, Any] = {
                "router_class": type(first.module).__name__,
                "router_path": first.name.split(f"layers.{first.layer}.", 1)[-1],
                "family": first.family.name,
                "returns": _describe_return(output),
            }
            read = _own_weights(first, output)
            if read is None:
                entry["bit_exact_rules"] = []
                entry["readout_error"] = NO_BLOCK_ROUTING
            else:
                entry["bit_exact_rules"] = sorted(
                    name
                    for name, rule in _candidate_rules().items()
                    if _reproduces(rule, first.module, *read)
                )
            try:
                install_replay(model).remove()
                entry["family_rule_replay_bit_exact"] = True
            except HFReplayError as err:  # the install-time self-check refused the family rule: recorded
                entry["family_rule_replay_bit_exact"] = False
                entry["self_check"] = str(err).split(":", 1)[0]
        return entry

    def softmax_rule_logit_move(self, model_type: str, *, seed: int = 0) -> float:
        """The largest logit move of replaying a family's natural routing with SkyRL's softmax rule."""
        import torch

        from harness.conventions import hf_families as families
        from harness.trainers.hf import install_replay, tiny_model

        model = tiny_model(model_type, torch.float32, seed=seed)
        probe = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            native = model(input_ids=probe, use_cache=False).logits
        handle = install_replay(model, rule=families.softmax_rule, self_check=False)
        with torch.no_grad():
            handle.record()
            model(input_ids=probe, use_cache=False)
            handle.replay(handle.recording())
            moved = model(input_ids=probe, use_cache=False).logits
        handle.remove()
        return float((moved - native).abs().max())

    def observe_convention(self) -> dict[str, Any]:
        """Row rule, dtype and layer axis of the transformers KV-cache engine (``harness.engines.hf``)."""
        import torch

        from harness.engines.hf import generate_rollouts, hf_trace
        from harness.trainers.hf import tiny_model

        model: Any = tiny_model("deepseek_v3", torch.float32)  # a dense first layer
        handle = self.start(model)
        prompt_len, response_len = 5, 4
        prompts = torch.randint(3, 128, (1, prompt_len), generator=torch.Generator().manual_seed(0))
        rollout = generate_rollouts(model, handle, prompts, response_len, greedy=True)[0]
        trace = hf_trace(rollout, handle)
        handle.remove()
        payload = rollout.routes
        if payload is None:
            raise ObservationError("hf", "convention", "the KV-cache rollout returned no routes")
        return {
            "payload_dtype": str(payload.dtype).removeprefix("torch."),
            "dtype": str(trace.experts.dtype),
            "row_rule": row_rule(int(payload.shape[0]), prompt_len, response_len),
            "layer_axis": layer_axis(
                int(payload.shape[1]), int(model.config.num_hidden_layers), len(handle.moe_layers)
            ),
        }
