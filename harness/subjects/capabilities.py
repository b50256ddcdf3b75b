"""The subject seam: every capability a subject may provide, as a typed protocol (DESIGN §4).

A subject supplies what its framework *does*; the harness builds the models and *observes* what
happened with its own probes (``harness.probes``). Nothing here reports on its own effect except
``ReportsDispatch.dispatched``, which is optional and never trusted.

Capabilities are accepted from any object — a module, a class instance, a ``SimpleNamespace`` —
checked structurally: a member the suites need and the object lacks is a *skip that names it*
(``CapabilityView``), never an ``AttributeError`` failure.

Replay is split the way real frameworks split it:

- a **driver** (``ReplayDriver``, ``MegatronReplayDriver``): ``patch()`` once per process — it may
  monkeypatch router classes, as verl's ``apply_router_replay_patch`` or SkyRL's ``replay_utils``
  do — then ``install(model)`` returns a per-model **controller**;
- the **controller** (``ReplayController``; ``MegatronReplayController``) switches the model's
  routers between native, record, replay and recompute-replay, and ``disarm()`` returns them to
  native routing;
- for Megatron-core, the **data movement** (``MegatronDataMovement``) turns one DP rank's
  micro-batch of canonical routes into every local router's targets (sequence-major ``s·B + b``,
  SP shard, PP/VPP stage routers, global logical expert ids) and the rank's recordings back —
  the shape of verl's ``set_router_replay_data`` / ``merge_router_topk_indices`` and SkyRL's
  ``setup_per_microbatch_replay_forward``, so they plug in behind a signature adapter.

A plain callable ``model -> controller`` is accepted wherever a driver is (``as_driver``): it is a
driver with nothing to patch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

# --- replay on a model the harness builds (reference MoELM, transformers) -------------------------


@runtime_checkable
class ReplayController(Protocol):
    """Record/replay control over one model's routers (what a framework's per-model object does).

    Routes are ``[tokens, num_moe_layers, top_k]`` integer ids (any integer dtype, any order within a
    route) in the model's token order (row ``b·T + t`` of each forward), MoE layers in model order.
    """

    def record(self) -> None:
        """Route natively on the next forwards and keep the chosen ids."""

    def recording(self) -> torch.Tensor:
        """The ids chosen since ``record()`` (forwards concatenated along tokens); stops recording."""

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Force ``targets`` on every later forward; rows where ``mask`` ``[tokens]`` is False route
        natively (DESIGN §3.6). Targets a model cannot take exactly raise, never route natively."""

    def prepare_backward(self) -> None:
        """Before backward: activation recompute replays what each forward used (one FIFO entry each)."""

    def disarm(self) -> None:
        """Back to native routing; drop targets, queues and recordings."""


@runtime_checkable
class OneForwardInFlight(Protocol):
    """Optional: the controller keeps one forward's targets for recompute, because its trainer runs
    each micro-batch's forward and backward before the next (FSDP without pipeline parallelism; verl's
    VeOmni engine). A declared contract, not a report: the recompute suite then checks recompute
    with one forward in flight instead of two."""

    forwards_in_flight: int  # 1


@runtime_checkable
class ReportsDispatch(Protocol):
    """Optional: the controller's own word on what the experts received. Reported, never trusted."""

    def dispatched(self) -> torch.Tensor:
        """The ids ``[tokens, num_moe_layers, top_k]`` the controller believes were dispatched."""


@runtime_checkable
class Removable(Protocol):
    """Optional: a controller that can take its hooks off the model (called at teardown)."""

    def remove(self) -> None:
        """Leave the model routing exactly as before ``install``."""


@runtime_checkable
class ReplayDriver(Protocol):
    """A framework's replay: a once-per-process patch plus a per-model controller.

    ``patch()`` is called once per process before the first ``install`` (it may monkeypatch classes
    and must be idempotent); ``unpatch()``, when the driver has it, is called at the end of the
    process's use of the subject (see ``harness.subjects.replay`` for isolation).
    """

    def patch(self) -> None:
        """Apply the framework's global patches (no-op when it needs none)."""

    def install(self, model: torch.nn.Module) -> ReplayController:
        """Control ``model`` 's routers (built by the harness after ``patch()``)."""


@runtime_checkable
class PatchesNothing(Protocol):
    """Optional: a driver whose ``patch()`` changes nothing global (``patches_nothing = True``:
    Megatron-core ≥ 0.16 replays natively). It never takes part in patch isolation: another driver's
    patch that cannot be undone does not refuse it, and it refuses nobody. A wrapper that presents a
    subject's driver (the replay suite's Megatron kind) says what the wrapped driver says."""

    patches_nothing: bool


@runtime_checkable
class Unpatchable(Protocol):
    """Optional: a driver that can undo its global patches (so one process can run several subjects)."""

    def unpatch(self) -> None:
        """Undo ``patch()``."""


# --- Megatron-core -----------------------------------------------------------------------------------


@runtime_checkable
class MegatronReplayController(Protocol):
    """The Megatron-core action switch over one rank's model chunks (``RouterReplayAction`` + native).

    Targets reach the routers through ``MegatronDataMovement.set_replay_data``; this object only
    says what the routers do with them.
    """

    def record(self) -> None:
        """RECORD: route natively and keep each router's chosen ids."""

    def replay_forward(self) -> None:
        """REPLAY_FORWARD: every later forward uses the targets set last (and queues them)."""

    def prepare_backward(self) -> None:
        """REPLAY_BACKWARD: activation recompute pops the queued targets, oldest first."""

    def disarm(self) -> None:
        """Native routing; drop targets, backward queues and recordings."""


@runtime_checkable
class MegatronReplayDriver(Protocol):
    """Megatron-core replay: global patches, the ``TransformerConfig`` fields it needs, a controller."""

    def patch(self) -> None:
        """Apply global patches before the model is built (verl: ``apply_router_replay_patch``)."""

    def config_overrides(self) -> Mapping[str, Any]:
        """``TransformerConfig`` fields replay needs (Megatron-core: ``moe_enable_routing_replay=True``)."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> MegatronReplayController:
        """Control the routers of this rank's model chunks (one per VPP stage)."""


@runtime_checkable
class RefusesMegatronLayout(Protocol):
    """Optional on a ``MegatronReplayDriver``: the layouts the release itself refuses at setup.

    A release that raises on a parallel configuration before training (SkyRL 0.4.0: routing replay
    with virtual pipeline stages) is not run on it: the suite skips the layout, naming the reason
    this returns (the release's own check, cited from its source). A reason is a declared contract
    the verdict shows, never a pass.
    """

    def refusal(self, layout: Any) -> str | None:
        """Why the release refuses ``layout`` (a ``MegatronLayout``), or None when it runs it."""


@runtime_checkable
class PacksAtOwnAlignment(Protocol):
    """Optional on a ``MegatronDataMovement``: a release that packs a THD micro-batch itself.

    verl and SkyRL do not read the forward's ``packed_seq_params``: they pad each sample to the
    alignment their own ``preprocess_packed_seqs`` derives from the parallel state (``tp`` at
    CP = 1 without FP8, ``tp·cp·2`` under CP). A packed layout padded otherwise is one the release
    never builds: the suite skips it, naming both alignments, instead of judging the release on
    rows its own trainer would not hold.
    """

    def packing_align(self, tp: int) -> int:
        """The per-sample alignment the release packs to at tensor parallel size ``tp`` (CP = 1)."""


@runtime_checkable
class MegatronDataMovement(Protocol):
    """Canonical routes ↔ one rank's routers, for one DP rank's micro-batch (FACTS §2).

    The harness splits the global batch over DP ranks (the data loader's job); the subject does the
    rest. ``routes`` are ``[B, S, num_layers, top_k]`` on the *decoder* layer axis (dense slots are
    never read), row ``s`` of sample ``b`` the route of the token at position ``s``; ``attention_mask``
    ``[B, S]`` says which positions hold tokens. Routers see tokens sequence-major (``s·B + b``),
    each TP rank its contiguous sequence-parallel shard, each (PP rank, VPP chunk) its own MoE
    layers, expert ids global and logical. With virtual pipeline stages the suites pass all of this
    rank's chunks as ``model`` (chunk 0 first) with ``vp_rank=None``: one call covers every chunk.

    A packed (THD) micro-batch comes with the ``packed_seq_params`` (``PackedSeqParams``,
    ``qkv_format='thd'``) the model's forward receives: ``attention_mask`` is then right-padded (sample
    ``b``'s ``n_b`` tokens at positions ``0 … n_b-1``) and the routers see one sequence, sample after
    sample, each padded to ``cu_seqlens_q_padded``, sharded contiguously over TP. The keyword is
    optional in a subject: one whose methods do not take it is not checked on packed input.
    """

    def set_replay_data(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> None:
        """Give every router of this rank's ``model`` chunks its targets for the next forward."""

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """This DP rank's recorded routes ``[B, S, L, top_k]``, gathered over TP and PP ranks
        (``L``: decoder layers or MoE layers, either axis is accepted). Collective: every rank calls it."""


# --- pure functions ----------------------------------------------------------------------------------


@runtime_checkable
class LayoutsCapability(Protocol):
    """The trainer's layout functions (``reference_impl.layouts``), every one the suites call."""

    place_left_padded: Callable[..., Any]
    unplace: Callable[..., Any]
    select_samples: Callable[..., Any]
    pack: Callable[..., Any]
    plan_micro_batches: Callable[..., Any]
    sp_pad: Callable[..., Any]
    sp_shard: Callable[..., Any]
    sp_gather: Callable[..., Any]
    sp_valid_mask: Callable[..., Any]
    cp_pad: Callable[..., Any]
    cp_zigzag_indices: Callable[..., Any]
    cp_zigzag_shard: Callable[..., Any]
    cp_zigzag_merge: Callable[..., Any]
    cp_valid_mask: Callable[..., Any]
    pp_layer_ranges: Callable[..., Any]
    stage_targets: Callable[..., Any]
    stage_targets_moe_ordinal: Callable[..., Any]
    merge_stage_recordings: Callable[..., Any]
    ep_local_ids: Callable[..., Any]
    ep_global_ids: Callable[..., Any]


@runtime_checkable
class TrainingCapability(Protocol):
    """The trainer passes of ``reference_impl.training`` the suites call: R2/R3 configuration rules,
    replay targets from a placed batch, the log-prob passes (old, policy, reference), backward, the
    PPO quantities, and the router statistics of a micro-batch (``tokens_per_expert``)."""

    check_mode: Callable[..., Any]
    has_rollout_routes: Callable[..., Any]
    place_without_routes: Callable[..., Any]
    replay_targets: Callable[..., Any]
    logprob_mask: Callable[..., Any]
    token_logprobs: Callable[..., Any]
    old_logprobs: Callable[..., Any]
    policy_logprobs: Callable[..., Any]
    backward: Callable[..., Any]
    reference_logprobs: Callable[..., Any]
    ppo_kl: Callable[..., Any]
    ppo_loss: Callable[..., Any]
    tokens_per_expert: Callable[..., Any]


@runtime_checkable
class ServedEngine(Protocol):
    """A rollout engine serving one request at a time (``reference_impl.serving.ServingEngine``): what
    a ``serving`` factory ``(model, *, prefill_chunk, prefix_block, speculative_tokens, ngram)`` returns.

    ``generate(prompt, max_new_tokens)`` greedy, a ``Rollout``-like answer (``tokens``, ``routes``
    ``[P + R − 1, moe_layers, top_k]``); ``prefill(prompt)`` the prefill replica's half of a
    disaggregated request, whose opaque answer ``decode(prefilled, max_new_tokens)`` of another
    engine continues; ``load_weights(state_dict)`` a weight update of the running engine.
    """

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> Any: ...

    def prefill(self, prompt: Sequence[int]) -> Any: ...

    def decode(self, prefilled: Any, max_new_tokens: int) -> Any: ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...


PROTOCOLS: dict[str, type] = {
    "install_replay": ReplayDriver,
    "install_hf_replay": ReplayDriver,
    "install_megatron_replay": MegatronReplayDriver,
    "megatron_data": MegatronDataMovement,
    "layouts": LayoutsCapability,
    "training": TrainingCapability,
}
"""The protocol of every object-valued capability (``decode_payload``, ``splice``, ``truncate`` are
plain functions)."""


def members(protocol: type) -> tuple[str, ...]:
    """The member names a protocol requires (methods and attributes), in definition order."""
    names = [n for n in vars(protocol) if not n.startswith("_")]
    names += [n for n in getattr(protocol, "__annotations__", {}) if n not in names]
    return tuple(names)


def missing_members(obj: object, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (works for modules, instances, namespaces)."""
    return [name for name in members(protocol) if not hasattr(obj, name)]


class MissingMember(LookupError):
    """A capability object lacks a member a suite needs (the test is skipped, naming it)."""


@dataclass(frozen=True, eq=False)
class CapabilityView:
    """A capability object whose missing members are ``MissingMember`` errors naming them.

    ``on_missing`` turns the message into the caller's outcome (the pytest plugin: a skip).
    """

    target: object
    capability: str
    subject: str
    on_missing: Callable[[str], NoReturn] | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self.target, name)
        except AttributeError:
            protocol = PROTOCOLS.get(self.capability)
            where = f" ({protocol.__name__})" if protocol is not None else ""
            message = f"subject {self.subject!r}: {self.capability}{where} has no member {name!r}"
            if self.on_missing is not None:
                self.on_missing(message)
            raise MissingMember(message) from None


@dataclass(frozen=True)
class CallableDriver:
    """A plain ``model -> controller`` callable seen as a ``ReplayDriver`` with nothing to patch."""

    install_fn: Callable[[Any], Any]

    def patch(self) -> None:
        """Nothing to patch."""

    def unpatch(self) -> None:
        """Nothing to undo."""

    def install(self, model: Any) -> Any:
        return self.install_fn(model)


def as_driver(value: object, capability: str = "install_replay") -> ReplayDriver:
    """``value`` as a ``ReplayDriver``: a driver object as is, a bare callable wrapped (no patch)."""
    if isinstance(value, ReplayDriver):
        return value
    if callable(value):
        return CallableDriver(value)
    missing = missing_members(value, ReplayDriver)
    raise MissingMember(
        f"{capability}: {type(value).__name__} is neither callable nor a ReplayDriver "
        f"(missing {', '.join(missing)})"
    )
