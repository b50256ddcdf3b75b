"""Driving Megatron-core's ``RouterReplay`` and observing what it did (FACTS §2).

- :func:`check_no_bypass`: the configurations under which 0.16 silently ignores replay
  (``moe_router_fusion``, sinkhorn, quantile balancing) or drops replayed assignments
  (token dropping) are errors, not warnings.
- :func:`model_routers`: the model's ``TopKRouter`` s in build order, checked against the class
  list ``RouterReplay.global_router_replay_instances`` (an instance no live router owns is an
  orphan, verl #7340; a router without an instance routes natively).
- :func:`mtp_routers` / :func:`decoder_routers`: the routers inside a multi-token-prediction block
  and the others, told apart by module (the MTP block's ``MultiTokenPredictionLayer``), never by
  ``layer_number``: an MTP layer's own ``layer_number`` restarts at 1 like the decoder's (FACTS §4
  "MTP routers", NeMo-RL #3903), so a replay keyed by it hands MTP router k decoder layer k's routes.
- :class:`MegatronReplay`: RECORD / REPLAY_FORWARD / REPLAY_BACKWARD over the decoder routers, feeding
  one tensor per instance (``RouterReplay.set_replay_data``, or instance by instance when MTP
  routers own instances too) and checking that each instance received exactly its targets and that
  the backward FIFO is drained. An MTP router replays only targets fed to it (its own rows); given
  none it routes natively (DESIGN §3.8: canonical traces hold decoder rows only).

The harness's observation of what the routers did lives in ``harness.probes.megatron``.

megatron-core is imported lazily; importing this module without it is fine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.errors import MegatronReplayError


def _router_replay_module() -> Any:
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError as err:  # pragma: no cover - exercised only without megatron-core
        raise MegatronReplayError(
            f"megatron-core with RouterReplay (>= 0.16) is required (extra 'megatron'): {err}"
        ) from None
    return router_replay


def check_no_bypass(config: Any) -> None:
    """Raise unless replay can take effect under ``config`` (a ``TransformerConfig``).

    In megatron-core 0.16 ``moe_router_fusion`` returns the fused TE top-k before the replay hook,
    sinkhorn routing never calls it, quantile balancing (later versions) replaces the top-k, and a
    capacity factor drops replayed assignments after routing. Each would leave replay a silent no-op.
    """
    problems = []
    if not getattr(config, "moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay is False (no router owns a RouterReplay)")
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True (the fused top-k never calls RouterReplay)")
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    kinds = balancing if isinstance(balancing, (list, tuple)) else [balancing]
    if "sinkhorn" in kinds:
        problems.append("moe_router_load_balancing_type='sinkhorn' (sinkhorn routing bypasses RouterReplay)")
    for name in sorted(vars(config) if hasattr(config, "__dict__") else ()):
        if "quantile" in name and getattr(config, name):
            problems.append(f"{name}={getattr(config, name)!r} (quantile balancing bypasses RouterReplay)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping drops replayed "
            "assignments after routing)"
        )
    if problems:
        raise MegatronReplayError("routing replay would be bypassed: " + "; ".join(problems))


def model_routers(*modules: torch.nn.Module) -> list[Any]:
    """Every ``TopKRouter`` of ``modules`` (model chunks, in order), checked against the class list.

    Raises when a router has no ``RouterReplay`` or when ``global_router_replay_instances`` is not
    exactly these routers' instances in build order (stale instances of another model, orphans,
    or routers built outside the model).
    """
    from megatron.core.transformer.moe.router import TopKRouter

    replay_cls = _router_replay_module().RouterReplay
    routers = [m for module in modules for m in module.modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise MegatronReplayError("the model has no TopKRouter: nothing to replay")
    missing = [j for j, r in enumerate(routers) if r.router_replay is None]
    if missing:
        raise MegatronReplayError(
            f"routers {missing} (build order) have no RouterReplay (moe_enable_routing_replay off?)"
        )
    owned = [r.router_replay for r in routers]
    instances = replay_cls.global_router_replay_instances
    if len(instances) != len(owned) or any(a is not b for a, b in zip(instances, owned, strict=False)):
        owned_ids = {id(x) for x in owned}
        orphans = sum(id(x) not in owned_ids for x in instances)
        raise MegatronReplayError(
            f"RouterReplay.global_router_replay_instances holds {len(instances)} instances, the model's "
            f"{len(owned)} routers own {len(owned)} ({orphans} orphans, or not in build order): clear the "
            "class list before building a model (RouterReplay.clear_global_router_replay_instances)"
        )
    return routers


def mtp_routers(*modules: torch.nn.Module) -> list[Any]:
    """The ``TopKRouter`` s inside a multi-token-prediction layer of ``modules``, in build order."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return [
        m
        for module in modules
        for layer in module.modules()
        if isinstance(layer, MultiTokenPredictionLayer)
        for m in layer.modules()
        if isinstance(m, TopKRouter)
    ]


def decoder_routers(*modules: torch.nn.Module) -> list[Any]:
    """:func:`model_routers` without the MTP routers: the routers canonical traces have rows for."""
    mtp = {id(r) for r in mtp_routers(*modules)}
    return [r for r in model_routers(*modules) if id(r) not in mtp]


@dataclass
class MegatronReplay:
    """Record/replay control over a model's routers through Megatron-core's ``RouterReplay``.

    ``routers`` are the decoder routers (targets required); ``mtp`` the MTP routers, which replay
    only what was fed to them and otherwise route natively under replay.
    """

    routers: list[Any]
    top_k: int
    num_experts: int
    fed: list[list[torch.Tensor]] = field(default_factory=list)
    mtp: list[Any] = field(default_factory=list)

    @classmethod
    def install(cls, *modules: torch.nn.Module, config: Any) -> MegatronReplay:
        """Check the configuration and the class list, then control ``modules`` ' routers."""
        check_no_bypass(config)
        model_routers(*modules)
        routers, mtp = decoder_routers(*modules), mtp_routers(*modules)
        return cls(routers, int(config.moe_router_topk), int(config.num_moe_experts), mtp=mtp)

    @property
    def instances(self) -> list[Any]:
        return [r.router_replay for r in self.routers]

    @property
    def layer_numbers(self) -> list[int]:
        """The decoder layer (0-based) of each router, in build order."""
        return [int(r.layer_number) - 1 if r.layer_number is not None else -1 for r in self.routers]

    def _set_action(self, action: Any) -> None:
        """``action`` on every instance; a replay action leaves an MTP router without targets native."""
        self._replay_cls().set_global_router_replay_action(action)
        if action is self._action().RECORD:
            return
        for router in self.mtp:
            replay = router.router_replay
            if replay.target_topk_idx is None and not replay.replay_backward_list:
                replay.clear_router_replay_action()

    @staticmethod
    def _replay_cls() -> Any:
        return _router_replay_module().RouterReplay

    @staticmethod
    def _action() -> Any:
        return _router_replay_module().RouterReplayAction

    def native(self) -> None:
        """Route natively (no action)."""
        self._replay_cls().clear_global_router_replay_action()

    def record(self) -> None:
        """RECORD: route natively and keep each router's chosen ids."""
        self._replay_cls().clear_global_indices()
        self._set_action(self._action().RECORD)

    def recording(self) -> list[torch.Tensor]:
        """Each router's recorded ids ``[local_tokens, k]``, in build order; back to native routing."""
        recorded = [inst.get_recorded_indices() for inst in self.instances]
        if any(r is None for r in recorded):
            raise MegatronReplayError(
                f"routers {[i for i, r in enumerate(recorded) if r is None]} recorded nothing"
            )
        self.native()
        return [r.detach().clone() for r in recorded]

    def feed(self, targets: list[torch.Tensor], local_tokens: int) -> None:
        """Queue one micro-batch's targets, one tensor per router in build order (``set_replay_data``).

        Checks shape ``[local_tokens, k]``, ids in ``[0, E)`` and distinct per token before feeding,
        and afterwards that every instance holds exactly its own tensor, queued last in its FIFO.
        """
        if len(targets) != len(self.routers):
            raise MegatronReplayError(
                f"targets: {len(targets)} tensors for {len(self.routers)} routers "
                "(one per RouterReplay instance)"
            )
        for j, t in enumerate(targets):
            where = f"targets[{j}] (decoder layer {self.layer_numbers[j]})"
            if t.dim() != 2 or tuple(t.shape) != (local_tokens, self.top_k):
                raise MegatronReplayError(
                    f"{where}: shape {tuple(t.shape)}, expected [{local_tokens}, {self.top_k}]"
                )
            if t.dtype != torch.long:
                raise MegatronReplayError(f"{where}: dtype {t.dtype}, expected int64 (torch.gather index)")
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_experts):
                raise MegatronReplayError(f"{where}: ids outside [0, {self.num_experts})")
            if self.top_k > 1 and bool((t.sort(dim=1).values.diff(dim=1) == 0).any()):
                raise MegatronReplayError(f"{where}: a token repeats an expert id")
        if self.mtp:  # set_replay_data wants one tensor per instance, MTP routers' included
            for inst, t in zip(self.instances, targets, strict=True):
                inst.set_target_indices(t)
        else:
            self._replay_cls().set_replay_data(list(targets))
        for j, (inst, t) in enumerate(zip(self.instances, targets, strict=True)):
            if (
                inst.target_topk_idx is not t
                or not inst.replay_backward_list
                or inst.replay_backward_list[-1] is not t
            ):
                raise MegatronReplayError(f"RouterReplay instance {j} did not receive targets[{j}]")
        self.fed.append(list(targets))

    def replay_forward(self) -> None:
        """REPLAY_FORWARD: the next forward uses the targets fed last."""
        self._set_action(self._action().REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        """REPLAY_BACKWARD: each activation recompute pops the oldest queued targets (FIFO)."""
        self._set_action(self._action().REPLAY_BACKWARD)

    def pending(self) -> list[int]:
        """Entries left in each instance's backward FIFO."""
        return [len(inst.replay_backward_list) for inst in self.instances]

    def check_drained(self) -> None:
        """Raise unless every backward FIFO is empty (one recompute per queued forward)."""
        left = self.pending()
        if any(left):
            raise MegatronReplayError(
                f"backward FIFO not drained: entries left per router {left} (recompute did not replay "
                "every forward, or REPLAY_BACKWARD was never set)"
            )

    def disarm(self) -> None:
        """Native routing; drop targets, FIFOs and recordings."""
        self._replay_cls().clear_global_indices()
        self.native()
        self.fed.clear()
