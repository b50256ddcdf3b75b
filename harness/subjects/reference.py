"""The reference subject: the executable specification, against which every suite must pass."""

from __future__ import annotations

import torch

from harness.conventions import decode_payload
from harness.subjects import Subject
from harness.subjects.capabilities import ReplayController
from harness.trainers.megatron.subject import MEGATRON_DATA, MEGATRON_DRIVER
from reference_impl import MoELM, RoutingMode, layouts, splice, training
from reference_impl.serving import ServingEngine


class ReferenceReplay:
    """``ReplayController`` of the reference model, whose routers carry Megatron-style replay state."""

    def __init__(self, model: MoELM) -> None:
        self.model = model

    def record(self) -> None:
        self.model.clear_replay()
        self.model.set_routing_mode(RoutingMode.RECORD)

    def recording(self) -> torch.Tensor:
        routes = self.model.pop_recording()
        self.model.set_routing_mode(RoutingMode.NATIVE)
        return routes

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self.model.set_replay_targets(targets, mask)
        self.model.set_routing_mode(RoutingMode.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        self.model.set_routing_mode(RoutingMode.REPLAY_BACKWARD)

    def dispatched(self) -> torch.Tensor:
        return self.model.dispatched_routes()

    def disarm(self) -> None:
        self.model.clear_replay()
        self.model.set_routing_mode(RoutingMode.NATIVE)


def install_replay(model: MoELM) -> ReferenceReplay:
    """Replay control for a reference model (nothing to patch: its routers implement replay)."""
    if not isinstance(model, MoELM):
        raise TypeError(f"model: expected a reference_impl.MoELM, got {type(model).__name__}")
    return ReferenceReplay(model)


def install_hf_replay(model: torch.nn.Module) -> ReplayController:
    """The harness's own transformers hooks (imported lazily: transformers is an optional extra)."""
    from harness.trainers.hf import install_replay as install

    return install(model)


REFERENCE = Subject(
    name="reference",
    serving=ServingEngine,
    decode_payload=decode_payload,
    splice=splice.splice,
    truncate=splice.truncate,
    layouts=layouts,
    install_replay=install_replay,
    install_hf_replay=install_hf_replay,
    install_megatron_replay=MEGATRON_DRIVER,
    megatron_data=MEGATRON_DATA,
    training=training,
)
