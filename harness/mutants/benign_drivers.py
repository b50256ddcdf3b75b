"""The benign variants' replay drivers: correct drivers that work differently from the reference's
(one forward in flight through backward, a hook that logs the replayed gate weights, a patch that
cannot be undone, a bare callable). ``harness.mutants.benign`` makes subjects of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from harness.mutants.replay import ReplayForwardThroughBackward
from harness.subjects.reference import REFERENCE
from harness.trainers.megatron.subject import HarnessMegatronDriver
from reference_impl import MoELM


class OneForwardInFlightThroughBackward(ReplayForwardThroughBackward):
    """REPLAY_FORWARD left on through backward, under a declared one-forward-in-flight contract (each
    micro-batch's backward runs before the next forward, as in verl's VeOmni engine): the recompute
    then replays the one forward's own targets, which is right."""

    forwards_in_flight = 1


def one_forward_in_flight(model: MoELM) -> OneForwardInFlightThroughBackward:
    """The one-forward-in-flight driver of ``model``."""
    return OneForwardInFlightThroughBackward(model)


class LogsReplayedWeightsDriver(HarnessMegatronDriver):
    """The twin of ``megatron-replay-drops-scaling-factor``: a forward hook on every ``TopKRouter``
    that, under replay, keeps a copy of the gate weights for its own logging and hands Megatron-core's
    weights on untouched (scaling factor and all), as a framework that wraps the replayed routing."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        from megatron.core.transformer.moe.router import TopKRouter

        from harness.mutants.megatron import replaying

        self.logged: list[torch.Tensor] = []

        def log(module: Any, args: Any, output: Any) -> Any:
            probs, routing_map = output
            if replaying(module):
                self.logged = [*self.logged[-7:], probs.detach().clone()]
            return probs, routing_map

        for chunk in model:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    m.register_forward_hook(log)
        return super().install(model, config)


class HooksWithoutUnpatch:
    """A transformers driver whose ``patch()`` sets a process-wide default and cannot be undone (no
    ``unpatch()``), as a framework that imports its patches for good."""

    patched = False

    def patch(self) -> None:
        type(self).patched = True

    def install(self, model: torch.nn.Module) -> Any:
        return REFERENCE.install_hf_replay(model)  # type: ignore[misc]


def bare_install_replay(model: MoELM) -> Any:
    """A bare ``model -> controller`` callable: a driver with nothing to patch."""
    return REFERENCE.install_replay(model)  # type: ignore[misc]
