"""The few collectives the sharded model needs, as differentiable functions.

``torch.distributed`` calls are not autograd operations; each one here is wrapped in an
``autograd.Function`` whose backward is the matching collective, so a sharded forward can be
trained (and recomputed under activation checkpointing) like the single-process model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class _AllToAll(torch.autograd.Function):
    """Rows ``[sum(send_counts), ...]`` → rows ``[sum(recv_counts), ...]``; backward sends them back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, send_counts: list[int], recv_counts: list[int], group: Any) -> Tensor:
        ctx.counts, ctx.group = (send_counts, recv_counts), group
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        send_counts, recv_counts = ctx.counts
        back = grad.new_empty((sum(send_counts), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send_counts, recv_counts, group=ctx.group)
        return back, None, None, None


def all_to_all_rows(x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group: Any) -> Tensor:
    """Send ``send_counts[j]`` consecutive rows of ``x`` to group rank ``j``; receive theirs in rank order."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)


def exchange_counts(send_counts: Tensor, group: Any) -> Tensor:
    """Each rank's ``send_counts`` [group size] → how many rows it will receive from each rank."""
    if group is None:
        return send_counts.clone()
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv


class _AllGather(torch.autograd.Function):
    """Concatenate equal-size shards of every group rank along ``dim``.

    Backward: with ``replicated_downstream`` every rank computes the same thing from the gathered
    tensor (the replicated math of TP here), so its gradient already is the full gradient and
    this rank keeps its own slice; otherwise (CP keys/values: each rank's queries use every
    rank's keys) the gradients of all ranks are summed first.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, replicated_downstream: bool) -> Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.group, ctx.rank, ctx.length = dim, group, rank, x.shape[dim]
        ctx.replicated_downstream = replicated_downstream
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous()
        if not ctx.replicated_downstream:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.length, ctx.length), None, None, None


def all_gather_cat(x: Tensor, group: Any, *, dim: int = 0, replicated_downstream: bool) -> Tensor:
    """Every group rank's ``x`` (all the same shape) concatenated along ``dim``, in group-rank order."""
    if group is None:
        return x
    return _AllGather.apply(x, dim, group, replicated_downstream)


class PendingSend:
    """A started send: keeps its buffer alive until `wait`."""

    def __init__(self, x: Tensor, dst: int) -> None:
        self.buffer = x.detach().contiguous()
        self.work = dist.isend(self.buffer, dst)

    def wait(self) -> None:
        self.work.wait()


def send(x: Tensor, dst: int) -> PendingSend:
    """Start sending ``x`` to global rank ``dst``; ``wait()`` on the result before the step ends.

    Non-blocking, as Megatron's pipeline schedules are: a blocking send of activations forward
    while the next stage blocks on sending gradients backward would deadlock 1F1B.
    """
    return PendingSend(x, dst)


def recv(shape: Sequence[int], dtype: torch.dtype, device: torch.device, src: int) -> Tensor:
    """Receive a tensor of ``shape`` from global rank ``src`` (blocks until it arrives)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(out, src)
    return out
