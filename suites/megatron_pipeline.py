"""Pipeline stages for the Megatron checks: one micro-batch's forward and backward across PP ranks.

Each PP rank builds only its stage (``pre_process`` on the first, ``post_process`` on the last) and
the stages exchange activations point to point over the pipeline group (gloo on CPU, NCCL on a GPU),
as Megatron's ``p2p_communication`` does between ``forward_step`` s: the output hidden states (and the
placement oracle's slots, which PP never moves) go to the next stage, the gradient of its input comes
back in backward, and the last stage's loss is broadcast so every stage reports the same value.
One micro-batch's steps are :class:`StageStep`; several may be in flight (forward mb1, forward mb2,
then backward mb1, mb2), which is what makes each stage's ``REPLAY_BACKWARD`` FIFO matter.

With virtual pipeline stages (VPP) each PP rank holds ``vpp`` model chunks, and chunk ``c`` of rank
``r`` is virtual stage ``c·pp + r`` (Megatron's interleaved order): activations flow rank 0 chunk 0 →
rank 1 chunk 0 → … → rank 0 chunk 1 → …, so one :class:`StageLink` per chunk names its neighbours
among the virtual stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class StageStep:
    """One micro-batch on one (virtual) stage: the loss (last stage only, with its graph), the stage
    output that backward starts from (other stages) and the received input whose gradient goes back."""

    loss: torch.Tensor | None = None
    output: torch.Tensor | None = None
    received: torch.Tensor | None = None


@dataclass
class MicroBatchStep:
    """One micro-batch on this rank: the step's loss (the last stage's, on every rank) and the steps of
    this rank's chunks, in forward order."""

    loss: torch.Tensor
    stages: list[StageStep]


class StageLink:
    """The neighbours (global ranks) of this rank's model chunk ``vp_stage`` among the ``pp·vpp``
    virtual pipeline stages, and the exchanges between them."""

    def __init__(self, vp_stage: int = 0, vpp: int = 1) -> None:
        from megatron.core import parallel_state as ps

        self.size = ps.get_pipeline_model_parallel_world_size()
        self.group = ps.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(self.group) if self.size > 1 else [dist.get_rank()]
        stage, stages = vp_stage * self.size + ps.get_pipeline_model_parallel_rank(), self.size * vpp
        self.prev = ranks[(stage - 1) % self.size] if stage > 0 else None
        self.next = ranks[(stage + 1) % self.size] if stage < stages - 1 else None
        self.last = ranks[-1]

    @property
    def first_stage(self) -> bool:
        return self.prev is None

    @property
    def last_stage(self) -> bool:
        return self.next is None

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's tensor of ``shape`` (blocking)."""
        assert self.prev is not None
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.prev)
        return out

    def send(self, tensor: torch.Tensor) -> None:
        """``tensor`` to the next stage (blocking)."""
        assert self.next is not None
        dist.send(tensor.detach().contiguous(), dst=self.next)

    def send_back(self, grad: torch.Tensor) -> None:
        """The gradient of this stage's input to the previous stage."""
        assert self.prev is not None
        dist.send(grad.contiguous(), dst=self.prev)

    def receive_back(self, like: torch.Tensor) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        assert self.next is not None
        out = torch.empty_like(like)
        dist.recv(out, src=self.next)
        return out

    def share_loss(self, loss: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The last stage's loss on every stage (the last stage keeps its graph)."""
        if self.size == 1:
            assert loss is not None
            return loss
        value = loss.detach().clone() if loss is not None else torch.zeros((), device=device)
        dist.broadcast(value, src=self.last, group=self.group)
        return loss if loss is not None else value

    def backward(self, step: StageStep) -> None:
        """This stage's backward of ``step``: from the loss (last stage) or the gradient the next stage
        sends; then the input's gradient to the previous stage."""
        if self.last_stage:
            assert step.loss is not None
            step.loss.backward()
        else:
            assert step.output is not None
            step.output.backward(self.receive_back(step.output))
        if not self.first_stage:
            assert step.received is not None and step.received.grad is not None
            self.send_back(step.received.grad)


def stage_input(link: StageLink, model: Any, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Receive the previous stage's hidden states and make them this stage's decoder input."""
    received = link.receive(shape, torch.float32, device).requires_grad_(True)
    model.set_input_tensor(received)
    return received
