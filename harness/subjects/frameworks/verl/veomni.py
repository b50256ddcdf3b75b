"""``install_hf_replay``: the VeOmni engine's router replay on a transformers model,
``VeOmniRouterReplay`` (``verl/utils/veomni/router_replay.py``), driven with the lifecycle of the
release's ``verl/workers/engine/veomni/transformer_impl.py``. VeOmni itself (its patched
``SparseMoeBlock.forward`` calling ``maybe_replay_indices``) is not installed: the harness's
router hooks are the tap, calling the controller's ``on_router_forward`` with the router's logits
and top-k and dispatching the ids it returns, with the family's own gate weights at them. Targets
arrive as the engine hands them over, one slot per decoder layer (dense slots 0), matched to
routers by fire order. 0.9.1: ``begin_microbatch(targets=…)`` / ``take_recorded`` per forward, no
replay mask (a row without a target arrives all-zero; the controller routes rows with a repeated
id natively). 0.8.0 and 0.9.0: ``set_microbatch_targets(per_layer, replay_mask)``,
``advance_record_microbatch`` and ``collect_recorded``, the mask passed through. Every family
the harness builds is tapped; which ones VeOmni wires (at verl #6325: ``qwen3_moe``,
``qwen3_5_moe``) depends on the VeOmni build and is not checked.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from harness.subjects.frameworks import require_release
from harness.trainers.hf.replay import HFReplay, find_routers
from reference_impl.routers import RoutingMode


class _VeOmniReplay(HFReplay, abc.ABC):
    """The release's ``VeOmniRouterReplay`` on a transformers model, as verl's VeOmni engine drives it.

    The harness's router hooks (``HFReplay``) stand in for VeOmni's patched ``SparseMoeBlock.forward``:
    where the block has its top-k, they call the controller's ``on_router_forward(module,
    routing_scores, top_indices)`` (the router's logits and chosen ids) and dispatch the ids it
    returns, with the family's gate weights at those ids (VeOmni's per-family post-top-k math). A
    hook before and after each model forward is the engine's per-micro-batch bracket
    (``prepare_model_inputs`` / ``prepare_model_outputs``); ``record`` / ``replay`` are the step's
    ``begin_record`` / ``begin_replay``, ``disarm`` its ``clear``.

    Targets reach the controller as the engine hands them over: the batch's ``routed_experts`` with
    one slot per decoder layer (what the rollout backends fill, FACTS §1 "layer axis"; dense slots
    0), cut per slot (``unbind(dim=1)``). The harness's MoE-ordinal targets go to their decoder
    layers' slots, up to the last MoE layer they cover. Recompute needs no action: verl's controller
    recognises a router it has seen in this micro-batch and replays the same slot.

    It holds one micro-batch's targets: the VeOmni engine (FSDP2, no pipeline parallelism) runs each
    micro-batch's forward and backward before the next, so one forward is in flight
    (``OneForwardInFlight``).
    """

    forwards_in_flight = 1

    def __init__(self, model: torch.nn.Module, routers: list[Any], veomni: Any) -> None:
        super().__init__(model, routers)
        self.veomni = veomni
        self._decoder_targets: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._recordings: list[torch.Tensor] = []  # 0.9.1: take_recorded() of each recorded forward
        self._forwards = 0  # forwards recorded since record()
        self._bracket = [
            model.register_forward_pre_hook(lambda module, args: self._before_forward()),
            model.register_forward_hook(lambda module, args, output: self._after_forward()),
        ]

    def _route(self, r: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """VeOmni's ``maybe_replay_indices``: the controller decides the ids every armed forward uses."""
        return self.veomni.on_router_forward(r.module, logits, ids)

    def _decoder_axis(self, targets: torch.Tensor) -> torch.Tensor:
        """MoE-ordinal ``[tokens, n, top_k]`` targets on the decoder layer axis, dense slots 0."""
        targets = torch.as_tensor(targets).to(torch.int64)
        if targets.ndim != 3 or targets.shape[1] > len(self.moe_layers):
            raise ValueError(
                f"replay targets: shape {list(targets.shape)}, expected [tokens, ≤ {len(self.moe_layers)}, "
                "top_k] (MoE layers)"
            )
        layers = list(self.moe_layers[: targets.shape[1]])
        decoder = targets.new_zeros((targets.shape[0], layers[-1] + 1 if layers else 0, targets.shape[2]))
        decoder[:, layers] = targets
        return decoder

    def record(self) -> None:
        self._reset()
        self.veomni.begin_record()
        self.mode = RoutingMode.RECORD

    def recording(self) -> torch.Tensor:
        routes = self._recorded()
        self.disarm()
        return routes

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self._reset()
        self._decoder_targets = self._decoder_axis(targets)
        self._mask = None if mask is None else torch.as_tensor(mask).bool()
        self.veomni.begin_replay()
        self.mode = RoutingMode.REPLAY_FORWARD

    def prepare_backward(self) -> None:
        """Nothing to switch: the controller has no backward action (see the class docstring)."""

    def disarm(self) -> None:
        self.veomni.clear()
        self._reset()
        super().disarm()

    def remove(self) -> None:
        for hook in self._bracket:
            hook.remove()
        super().remove()

    def _reset(self) -> None:
        self._decoder_targets, self._mask, self._recordings, self._forwards = None, None, [], 0

    def _after_forward(self) -> None:
        if self.mode is RoutingMode.RECORD:
            self._forwards += 1
            self._take_recorded()

    @abc.abstractmethod
    def _before_forward(self) -> None:
        """Arm the controller for the next forward (the engine's ``prepare_model_inputs``)."""

    @abc.abstractmethod
    def _take_recorded(self) -> None:
        """After a recorded forward (the engine's ``prepare_model_outputs``)."""

    @abc.abstractmethod
    def _recorded(self) -> torch.Tensor:
        """The ids recorded since ``record()``, ``[tokens, n_moe, top_k]``."""


class _VeOmniReplay091(_VeOmniReplay):
    """0.9.1: ``begin_microbatch(targets=per_layer)`` / ``begin_microbatch()`` before each forward,
    ``take_recorded()`` after it. There is no replay mask: a position without a row reaches the
    controller as an all-zero row (the engine's pad suffix, R3's missing rows), which it routes
    natively because the row repeats an id."""

    def _before_forward(self) -> None:
        if self.mode is RoutingMode.RECORD:
            self.veomni.begin_microbatch()
        elif self._decoder_targets is not None:
            targets = self._decoder_targets
            if self._mask is not None:
                targets = torch.where(self._mask[:, None, None], targets, 0)
            self.veomni.begin_microbatch(targets=list(targets.unbind(dim=1)))

    def _take_recorded(self) -> None:
        self._recordings.append(self.veomni.take_recorded())

    def _recorded(self) -> torch.Tensor:
        return torch.cat(self._recordings)


class _VeOmniReplay080(_VeOmniReplay):
    """0.8.0 and 0.9.0: ``set_microbatch_targets(per_layer, replay_mask=…)`` before each replayed
    forward (targets and mask through the controller's own ``slice_microbatch_replay_*``, no SP
    group), ``advance_record_microbatch()`` between recorded forwards, ``collect_recorded`` at the
    end (no SP padding to trim)."""

    def _before_forward(self) -> None:
        if self.mode is RoutingMode.RECORD and self._forwards:
            self.veomni.advance_record_microbatch()
        elif self.mode is RoutingMode.REPLAY_FORWARD and self._decoder_targets is not None:
            per_layer = self.veomni.slice_microbatch_replay_targets(self._decoder_targets)
            mask = None if self._mask is None else self.veomni.slice_microbatch_replay_mask(self._mask)
            self.veomni.set_microbatch_targets(per_layer, replay_mask=mask)

    def _take_recorded(self) -> None:
        """Nothing per forward: ``collect_recorded`` returns every micro-batch at the end."""

    def _recorded(self) -> torch.Tensor:
        count = self._forwards
        return torch.cat(self.veomni.collect_recorded(pad_size_per_mb=[0] * count, num_micro_batches=count))


class VeOmniDriver:
    """``install_hf_replay``: a fresh ``VeOmniRouterReplay`` per model behind the harness's router
    hooks (nothing global: VeOmni's ``set_active_replay`` slot is what the hooks replace)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def patch(self) -> None:
        require_release("verl", self.version, f"verl-{self.version}")

    def unpatch(self) -> None:
        """Nothing global to undo."""

    def install(self, model: torch.nn.Module) -> _VeOmniReplay:
        require_release("verl", self.version, f"verl-{self.version}")
        from verl.utils.veomni.router_replay import VeOmniRouterReplay

        cls = _VeOmniReplay091 if self.version == "0.9.1" else _VeOmniReplay080
        handle = cls(model, find_routers(model), VeOmniRouterReplay())
        handle._attach()
        return handle
