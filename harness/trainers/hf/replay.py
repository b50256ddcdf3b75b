"""Record/replay on a transformers MoE model through module hooks (the ``hf`` trainer backend).

``install_replay(model)`` finds every router of a supported family (``families.FAMILIES``), hooks
it and returns an ``HFReplay`` (a ``harness.subjects.capabilities.ReplayController``):

- *record*: a forward hook on each router keeps the ids it chose;
- *replay*: the same hook replaces the ids with the targets and the gate weights with the family's
  rule at the targets, computed from the router's live logits, so the router still gets gradients
  (DESIGN §3.7). Rows whose mask is False keep the router's own choice;
- *dispatched*: the harness's own probe (``harness.probes.hf``) reads the ids the experts received.

DeepSeek-V3 and GLM4-MoE routers of transformers ≤ 5.12 return the logits only and their block
chooses in ``route_tokens_to_experts``; for those the block's method is wrapped instead (detected at
install from whether the block has that method; at forward time, from what the router returns).

The record/replay state machine is the reference's (``reference_impl.routers.RouterReplay``: modes,
target checks, the recompute FIFO, the mask merge); each hooked router owns one, so this module only
reads and rebuilds the routers' outputs.

At install a self-check replays the model's natural choice on a small probe batch and requires the
logits to be bit-identical; a family whose rule or dtype is wrong fails there, by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from harness.conventions.hf_families import (
    FAMILIES,
    WeightRule,
)
from harness.conventions.hf_routers import HFReplayError, HookedRouter, find_routers, parent_module
from harness.probes import ProbeError, RouteProbe
from harness.probes.hf import attach
from reference_impl.routers import ReplayError, RoutingMode, pop_recording, set_replay_targets


@contextmanager
def _as_hf_error() -> Iterator[None]:
    """The reference state machine's ``ReplayError`` as this backend's ``HFReplayError`` (same text:
    it names the router by decoder layer and module)."""
    try:
        yield
    except ReplayError as err:
        raise HFReplayError(str(err)) from None


_INSTALLED = "_rr_hf_replay"


class HFReplay:
    """``ReplayController`` over a transformers model's routers (see the module docstring).

    Routes are ``[tokens, num_moe_layers, top_k]`` int64, row ``b·T + t`` of each forward, MoE layers
    in decoder order (``moe_layers``). Targets apply to every later forward until ``disarm``; each
    replayed forward also queues its targets for activation recompute, which ``prepare_backward``
    switches to (one FIFO entry per forward, as Megatron-core's ``REPLAY_BACKWARD``).
    """

    def __init__(self, model: nn.Module, routers: list[HookedRouter]) -> None:
        self.model = model
        self.routers = routers
        self._hooks: list[RemovableHandle] = []
        self._probe = RouteProbe(())

    @property
    def mode(self) -> RoutingMode:
        """What every router does on the next forward (they are switched together)."""
        return self.routers[0].replay.mode

    @mode.setter
    def mode(self, mode: RoutingMode) -> None:
        for r in self.routers:
            r.replay.mode = mode

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder indices of the MoE layers, in the order of the routes' layer axis."""
        return tuple(r.layer for r in self.routers)

    @property
    def families(self) -> tuple[str, ...]:
        """The router families of this model (one, for every model transformers ships)."""
        return tuple(dict.fromkeys(r.family.name for r in self.routers))

    @property
    def top_k(self) -> int:
        """Experts per token (the same at every MoE layer of the models transformers ships)."""
        return self.routers[0].top_k

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer."""
        return self.routers[0].num_experts

    # --- ReplayController-----------------------------------------------------------------------

    def record(self) -> None:
        """Route natively on the next forwards and keep the chosen ids."""
        self._clear()
        self.mode = RoutingMode.RECORD

    def recording(self) -> torch.Tensor:
        """The ids chosen since ``record()`` (forwards concatenated along tokens); stops recording."""
        with _as_hf_error():
            routes = pop_recording([r.replay for r in self.routers])
        self.mode = RoutingMode.NATIVE
        return routes

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Force ``targets`` ``[tokens, num_moe_layers, top_k]`` on every later forward.

        Rows where ``mask`` (``[tokens]`` bool) is False route natively. Replayed rows must hold
        ``top_k`` distinct ids in ``[0, num_experts)``; anything else raises ``HFReplayError``.
        """
        with _as_hf_error():  # the recompute FIFO keeps earlier forwards' targets
            set_replay_targets([r.replay for r in self.routers], targets, mask, self.moe_layers)
        self.mode = RoutingMode.REPLAY_FORWARD

    def prepare_backward(self) -> None:
        """Activation recompute replays what each forward used, oldest first."""
        self.mode = RoutingMode.REPLAY_BACKWARD

    def dispatched(self) -> torch.Tensor:
        """The ids ``[tokens, num_moe_layers, top_k]`` the experts received in the last forward (read by
        the harness's probe, ``harness.probes.hf``)."""
        try:
            return self._probe.last().ids
        except ProbeError:
            raise HFReplayError("dispatched: no forward has reached the experts yet") from None

    def disarm(self) -> None:
        """Native routing; drop targets, queues and recordings."""
        self._clear()
        self.mode = RoutingMode.NATIVE

    def remove(self) -> None:
        """Take every hook off the model (it routes exactly as before ``install_replay``)."""
        self.disarm()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._probe.remove()
        for r in self.routers:
            if r.block_routing is not None:
                del parent_module(self.model, r.name).route_tokens_to_experts
        delattr(self.model, _INSTALLED)

    # --- hooks ----------------------------------------------------------------------------------

    def _clear(self) -> None:
        for r in self.routers:
            r.replay.clear()

    def _route(self, r: HookedRouter, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """The ids this forward must use at router ``r`` (``None``: keep the router's own, ``ids``)."""
        with _as_hf_error():
            chosen = r.replay.choose(logits, lambda _: ids)
        return chosen if r.replay.replaying else None

    def _router_hook(self, r: HookedRouter) -> Callable[[nn.Module, Any, Any], Any]:
        readout, rule = r.family.readout, r.family.rule

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if isinstance(output, torch.Tensor):  # logits only (≤ 5.12): the block routes
                if r.block_routing is None:
                    raise HFReplayError(
                        f"{r.name} ({r.family.name}) returned logits only and its block has no "
                        "route_tokens_to_experts to hook"
                    )
                return None
            if self.mode is RoutingMode.NATIVE:
                return None
            logits, ids = readout.read(module, output)
            forced = self._route(r, logits, ids)
            if forced is None:
                return None
            return readout.build(output, logits, rule(module, logits, forced), forced)

        return hook

    def _block_routing(self, r: HookedRouter, original: Callable[..., Any]) -> Callable[..., Any]:
        """≤ 5.12 DeepSeek-V3/GLM4: ``route_tokens_to_experts(logits) -> (ids, weights)``."""
        rule = r.family.rule

        def route_tokens_to_experts(router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids, weights = original(router_logits)
            forced = self._route(r, router_logits, ids)
            if forced is None:
                return ids, weights
            return forced, rule(r.module, router_logits, forced)

        return route_tokens_to_experts

    def _attach(self) -> None:
        for r in self.routers:
            if r.block_routing is not None:
                parent_module(self.model, r.name).route_tokens_to_experts = self._block_routing(
                    r, r.block_routing
                )
            self._hooks.append(r.module.register_forward_hook(self._router_hook(r)))
        # the probe after the router hooks: Llama 4's probe reads their output
        self._probe = attach(self.model, keep=1)
        setattr(self.model, _INSTALLED, self)

    # --- install-time self-check ----------------------------------------------------------------

    def self_check(self, tokens: int = 12, seed: int = 0) -> float:
        """Replay the natural choice on a probe batch; raise unless the logits are bit-identical.

        Runs in eval mode (PhiMoE samples its experts, Mixtral jitters its input in training mode)
        and restores the model's mode. Returns the max |difference| (0.0).
        """
        embeddings: Any = self.model.get_input_embeddings()  # type: ignore[operator]
        vocab = int(embeddings.num_embeddings)
        probe = torch.randint(0, vocab, (2, tokens), generator=torch.Generator().manual_seed(seed))
        device = next(self.model.parameters()).device
        with _eval(self.model), torch.no_grad():
            self.record()
            native = _logits(self.model(input_ids=probe.to(device), use_cache=False))
            self.replay(self.recording())
            replayed = _logits(self.model(input_ids=probe.to(device), use_cache=False))
            self.disarm()
        diff = (native.float() - replayed.float()).abs().max().item()
        if not torch.equal(native, replayed):
            raise HFReplayError(
                f"self-check: replaying the natural routing of {'/'.join(self.families)} routers "
                f"({', '.join(sorted({type(r.module).__name__ for r in self.routers}))}, {native.dtype}) "
                f"moved the logits by up to {diff:.3e}, expected 0 (bit-exact): the gate-weight rule "
                "or its dtype does not match the router"
            )
        return diff


@contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output[0]


def install_replay(
    model: nn.Module,
    *,
    rule: WeightRule | None = None,
    self_check: bool = True,
) -> HFReplay:
    """Record/replay control over a transformers MoE model's routers.

    Args:
        model: a transformers causal LM (``*ForCausalLM``) of a supported family.
        rule: a gate-weight rule to use for every family instead of each family's own (mutants only,
            e.g. ``families.softmax_rule``; the self-check then reports how far it moves the logits).
        self_check: replay the natural routing of a probe batch at install and require bit-identical
            logits (``HFReplayError`` names the family and the max difference otherwise).
    """
    if hasattr(model, _INSTALLED):
        raise HFReplayError(
            f"{type(model).__name__}: replay hooks are already installed (call .remove() on the old handle; "
            "a deepcopy of a hooked model carries its hooks)"
        )
    families = FAMILIES if rule is None else {name: f.with_rule(rule) for name, f in FAMILIES.items()}
    handle = HFReplay(model, find_routers(model, families))
    handle._attach()
    if self_check:
        try:
            handle.self_check()
        except BaseException:
            handle.remove()
            raise
    return handle
