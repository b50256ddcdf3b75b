"""The Megatron-core model kind of the replay suite (``suites/test_replay.py``), in the test process.

A tiny ``GPTModel`` (local specs, TP = PP = EP = 1) on a one-rank gloo world, with the CPU patches of
``harness.testing.megatron_cpu`` held for as long as the kind is in use (:func:`megatron_session`):
the suite's cases then run against Megatron-core's ``RouterReplay`` exactly as against the reference
``MoELM`` and transformers models. The subject's Megatron capability is two objects
(``install_megatron_replay``: the action switch; ``megatron_data``: the data movement), so
:class:`MegatronKindDriver` presents them as one ``ReplayDriver``: ``replay(targets)`` keeps the
targets, and every later forward of the model first hands them to the subject's ``set_replay_data``
for that forward's ``[B, S]`` (one FIFO entry per forward, as a trainer feeds each micro-batch), then
``REPLAY_FORWARD``; ``recording()`` is the subject's ``merge_recordings``.

What the kind cannot take is refused, never approximated: a per-token replay mask (Megatron-core's
``RouterReplay`` has none) and a padding attention mask raise ``MegatronReplayError``.

The harness's probe reads the dispatch step: the all-gather dispatcher's ``local_map`` and
``local_probs`` in a pre-hook on the experts (ids and gate weights), rows reordered from Megatron's
``s·B + b`` to the suite's ``b·S + s``.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.errors import MegatronReplayError
from harness.probes import RouteProbe
from harness.testing import megatron_cpu
from harness.trainers.kinds import DEEP_LAYERS, ModelKind, Routing
from harness.trainers.megatron.layout import MegatronLayout
from harness.trainers.megatron.model import VOCAB, build_gpt, randomise_expert_bias, router_rules, tiny_config

FAMILIES = tuple(router_rules())
"""Router families of the kind: every gate-weight rule of megatron-core's ``TopKRouter``
(``harness.trainers.megatron.model.router_rules``, 4 experts); the suite runs ``softmax`` and
``sigmoid`` by default, the others under ``slow``."""
FAST_FAMILIES = ("softmax", "sigmoid")
SEED = 7


_BUILT: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""Models :func:`build` made in the current session (their process groups are released at its end)."""
THREADS = 1
"""torch's intra-op threads inside a session (the ranks of ``harness.testing.ranks`` run with one too)."""


def _release_process_groups(models: list[nn.Module]) -> None:
    """Drop every module's references to process groups (and Megatron's collections of them).

    A failing example's traceback keeps its frames, hence the model, alive while hypothesis shrinks
    (hundreds of examples); each model holds its session's gloo groups, and a gloo group's worker
    threads end only when the group is freed: one process reached 5,777 threads. Hollowing the
    references at the session's end frees the groups whatever still holds the model."""
    seen: set[int] = set()
    for model in models:
        for module in model.modules():
            _drop_groups(module, seen, depth=2)


def _drop_groups(obj: object, seen: set[int], depth: int) -> None:
    """Null ``obj``'s attributes that hold process groups, and those of the plain objects it holds
    (Megatron's token dispatchers are not modules), ``depth`` levels down."""
    if id(obj) in seen or not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))
    for name, value in list(vars(obj).items()):
        if _holds_groups(value):
            obj.__dict__[name] = None
        elif depth and not isinstance(value, (nn.Module, torch.Tensor, type)) and hasattr(value, "__dict__"):
            _drop_groups(value, seen, depth - 1)


def _holds_groups(value: object) -> bool:
    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, dist.ProcessGroup) for v in value):
        return True
    return type(value).__name__ == "ProcessGroupCollection"


_HELD: list[bool] = []
"""Non-empty while :func:`megatron_world` holds the one-rank world open across sessions."""


@contextlib.contextmanager
def megatron_world() -> Iterator[None]:
    """Hold one one-rank world (gloo and Megatron's parallel state) open for the block: every
    :func:`megatron_session` inside it uses that world instead of building and destroying its own.

    Wrap a property test of the Megatron kind in it (the replay suite does, per test): its examples
    then share one set of process groups, so however many examples hypothesis runs — and however many
    failing ones it keeps while it shrinks, each holding its model and its autograd graph, whose
    nodes keep the groups they communicated over — the process holds one world's threads, not one
    per example. Closed (world destroyed) at the end of the block."""
    if _HELD:
        yield
        return
    with _cpu_patches():
        _open_world()
    _HELD.append(True)
    try:
        yield
    finally:
        _HELD.clear()
        with _cpu_patches():
            _close_world()
        gc.collect()  # a group held in a reference cycle (a kept failure's frames) goes now, threads too


@contextlib.contextmanager
def megatron_session() -> Iterator[None]:
    """A one-rank gloo world with Megatron's parallel state and the CPU patches, for the duration of
    the block (all undone after it, unless :func:`megatron_world` holds the world: other tests in
    the process may build their own). torch's intra-op pool is held to :data:`THREADS` inside it,
    and every model built in it lets go of its process groups at its end
    (:func:`_release_process_groups`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        with _cpu_patches():
            if _HELD:
                yield
            else:
                _open_world()
                try:
                    yield
                finally:
                    _close_world()
    finally:
        models = list(_BUILT)
        _BUILT.clear()
        _release_process_groups(models)
        del models
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _cpu_patches() -> Iterator[None]:
    with megatron_cpu.patched(), warnings.catch_warnings():
        # megatron-core warns per call about missing TE/Apex and deprecated arguments (none of it
        # about replay), as in the spawned ranks (``megatron_cpu.setup_rank``)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _open_world() -> None:
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        raise MegatronReplayError("the Megatron kind builds its own one-rank world; one is already up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
    except BaseException:
        dist.destroy_process_group()
        raise


def _close_world() -> None:
    """Destroy the world, and every group megatron-core's parallel state still holds: 0.16.1's
    ``destroy_model_parallel`` leaves ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`` (and its gloo
    twin) set, whose gloo threads then outlive the world — and a process forked afterwards (a subject
    run in its own process) inherits a live gloo runtime it can deadlock on."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    for name, value in list(vars(ps).items()):
        if _holds_groups(value):
            setattr(ps, name, None)
    dist.destroy_process_group()


def _layout(deep: bool, top_k: int = 2) -> MegatronLayout:
    layers = DEEP_LAYERS if deep else 3
    return MegatronLayout(
        num_layers=layers,
        moe_layers=tuple(range(1, layers)),
        num_experts=4,
        top_k=top_k,
        seq_len=64,
        micro_batch=1,
    )


def build(
    family: str,
    dtype: str,
    *,
    fresh: bool = False,
    deep: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A fresh tiny ``GPTModel`` of router rule ``family`` with the subject driver's
    ``config_overrides()`` on top (always constructed now: a copy's ``RouterReplay`` objects would not
    be the ones Megatron-core's class list holds). Call inside :func:`megatron_session`."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if dtype != "fp32":
        raise MegatronReplayError(f"the Megatron kind is built in fp32, got dtype {dtype!r}")
    rule = router_rules()[family]
    layout = _layout(deep, int(rule["moe_router_topk"]))
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(SEED)
    model_parallel_cuda_manual_seed(SEED)
    model = build_gpt(tiny_config(layout, **rule, **dict(overrides or {})), layout)
    randomise_expert_bias(model, SEED)
    model.harness_layout = layout  # type: ignore[assignment]
    _BUILT.add(model)
    return model


def run(
    model: nn.Module,
    tokens: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """Logits ``[B, S, V]`` of a causal forward (MoE activation recompute is built into the model)."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise MegatronReplayError("the Megatron kind takes no padding: attention_mask must be all ones")
    s = tokens.shape[1]
    if position_ids is None:
        position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    return model(tokens, position_ids, causal)


def _moe_layers(model: nn.Module) -> list[Any]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def routing(model: nn.Module) -> Routing:
    layout: MegatronLayout = model.harness_layout  # type: ignore[assignment]
    return Routing(layout.moe_layers, layout.num_experts, layout.top_k)


def router_weights(model: nn.Module) -> list[torch.Tensor]:
    return [layer.router.weight for layer in _moe_layers(model)]


def probe(model: nn.Module) -> RouteProbe:
    """The harness's probe at the dispatch step: ids and gate weights the experts receive, ``b·S + s``."""
    layers = _moe_layers(model)
    top_k = routing(model).top_k
    out = RouteProbe(tuple(range(len(layers))))
    shape: list[tuple[int, int]] = []

    def on_model(module: Any, args: Any, kwargs: Any) -> None:
        tokens = args[0] if args else kwargs["input_ids"]
        shape[:] = [tuple(tokens.shape)]

    def on_experts(j: int, layer: Any) -> Any:
        def hook(module: Any, args: Any) -> None:
            dispatcher = layer.token_dispatcher
            local_map = dispatcher.local_map.detach().bool()
            weights = torch.zeros(local_map.shape[1], local_map.shape[0], dtype=dispatcher.local_probs.dtype)
            weights[local_map.T] = dispatcher.local_probs.detach().cpu()
            batch, seq = shape[0]
            order = torch.arange(batch * seq).view(seq, batch).T.reshape(-1)  # row b·S + s ← s·B + b
            ids = local_map.float().topk(top_k, dim=1).indices[order]
            out.observe(j, ids, weights.T[order].gather(1, ids))

        return hook

    out.handles.append(model.register_forward_pre_hook(on_model, with_kwargs=True))
    for j, layer in enumerate(layers):
        out.handles.append(layer.experts.register_forward_pre_hook(on_experts(j, layer)))
    return out


class MegatronKindController:
    """``ReplayController`` over the subject's Megatron action switch and data movement."""

    def __init__(self, model: nn.Module, control: Any, data: Any) -> None:
        self.model, self.control, self.data = model, control, data
        self.routing = routing(model)
        self.targets: torch.Tensor | None = None
        self.shape: tuple[int, int] | None = None
        self.handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _routes(self, targets: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """Suite targets ``[B·S, n_moe, k]`` (row ``b·S + s``) → decoder-axis routes ``[B, S, L, k]``."""
        layout: MegatronLayout = self.model.harness_layout  # type: ignore[assignment]
        if targets.shape[0] != batch * seq:
            raise MegatronReplayError(
                f"targets: {targets.shape[0]} rows for a forward of {batch}×{seq} tokens"
            )
        routes = torch.zeros(batch, seq, layout.num_layers, layout.top_k, dtype=torch.long)
        routes[:, :, list(layout.moe_layers)] = targets.long().view(batch, seq, *targets.shape[1:])
        return routes

    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        tokens = args[0] if args else kwargs["input_ids"]
        self.shape = tuple(tokens.shape)
        if self.targets is None:
            return
        batch, seq = self.shape
        routes = self._routes(self.targets, batch, seq)
        mask = torch.ones(batch, seq, dtype=torch.long)
        self.data.set_replay_data(routes, mask, self.model.config, model=[self.model])
        self.control.replay_forward()

    def record(self) -> None:
        self.targets = None
        self.control.record()

    def recording(self) -> torch.Tensor:
        if self.shape is None:
            raise MegatronReplayError("recording(): no forward since record()")
        batch, seq = self.shape
        mask = torch.ones(batch, seq, dtype=torch.long)
        merged = torch.as_tensor(self.data.merge_recordings(mask, self.model.config, model=[self.model]))
        self.control.disarm()
        layout: MegatronLayout = self.model.harness_layout  # type: ignore[assignment]
        if merged.shape[2] == layout.num_layers:
            merged = merged[:, :, list(layout.moe_layers)]
        return merged.reshape(batch * seq, *merged.shape[2:])

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise MegatronReplayError(
                "replay mask: Megatron-core's RouterReplay has no per-token mask (every row is replayed)"
            )
        n_moe = len(self.routing.moe_layers)
        if targets.dim() != 3 or targets.shape[1] != n_moe:
            raise MegatronReplayError(
                f"targets: shape {tuple(targets.shape)}, expected [tokens, {n_moe} MoE layers, top_k]"
            )
        self.targets = torch.as_tensor(targets)

    def prepare_backward(self) -> None:
        self.control.prepare_backward()

    def disarm(self) -> None:
        self.targets = None
        self.control.disarm()

    def remove(self) -> None:
        self.handle.remove()


class MegatronKindDriver:
    """The subject's ``install_megatron_replay`` + ``megatron_data`` as one ``ReplayDriver`` (equal to
    another over the same two objects, so its patch runs once per process). Patch isolation counts
    what the subject's driver patches, not the wrapper: ``patches_nothing`` is the subject driver's
    (the reference's and Megatron-core's own patch nothing), and ``unpatch`` exists exactly when the
    subject driver has one (a wrapper that always offered it would pass an un-undoable patch off as
    undoable)."""

    def __init__(self, driver: Any, data: Any) -> None:
        self.driver, self.data = driver, data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MegatronKindDriver) and (other.driver, other.data) == (
            self.driver,
            self.data,
        )

    def __hash__(self) -> int:
        return hash((id(self.driver), id(self.data)))

    @property
    def patches_nothing(self) -> bool:
        return bool(getattr(self.driver, "patches_nothing", False))

    def patch(self) -> None:
        self.driver.patch()

    def __getattr__(self, name: str) -> Any:
        undo = getattr(self.__dict__.get("driver"), "unpatch", None) if name == "unpatch" else None
        if undo is None:
            raise AttributeError(name)
        return undo

    def config_overrides(self) -> Any:
        return self.driver.config_overrides()

    def install(self, model: nn.Module) -> MegatronKindController:
        return MegatronKindController(model, self.driver.install([model], model.config), self.data)


def megatron_kind() -> ModelKind:
    """The kind (capability ``install_megatron_replay``; the suite also requires ``megatron_data``)."""
    return ModelKind(
        "megatron",
        "install_megatron_replay",
        tuple(FAMILIES),
        VOCAB,
        build,
        run,
        probe,
        routing,
        router_weights,
    )
