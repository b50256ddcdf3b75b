"""Pipeline schedules over `ShardedMoELM` stages, with point-to-point hidden states.

A micro-batch is one packed sequence: this rank's tokens of it (its CP shard, see
`reference_impl.distributed.routes.rank_tokens`). Model chunk ``m`` of ``pp·vpp`` runs on pipeline
rank ``m % pp`` as its virtual chunk ``m // pp``; the hidden state [1, T, H] of a micro-batch goes
from the rank of chunk ``m`` to the rank of chunk ``m + 1`` with send/recv. All ranks of a stage
(TP, CP, DP, EP peers) run the same schedule, so their collectives line up.

* `pipeline_forward` — forward only (the old-log-prob pass, R2 recording, R3 replay), VPP allowed.
* `pipeline_train_step` — Megatron's non-interleaved 1F1B schedule with backward: stage ``p`` runs
  ``pp − p − 1`` warm-up forwards, then alternates one forward and one backward, then drains the
  backwards. Stage 0 therefore runs two forwards before the first backward when pp ≥ 2, which is
  why activation recompute must replay targets from a FIFO (one entry per forward), and why
  leaving REPLAY_FORWARD on through backward replays the *latest* micro-batch's targets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .collectives import PendingSend, recv, send
from .model import ShardedMoELM

Hook = Callable[[int], None]
"""Called with the micro-batch index: where a trainer sets that micro-batch's replay targets."""


def _stage_rank(model: ShardedMoELM, pp_rank: int) -> int:
    """Global rank of pipeline rank ``pp_rank`` with this rank's TP/CP/DP coordinates."""
    place = model.place
    return model.spec.rank_of(tp=place.tp, cp=place.cp, dp=place.dp, pp=pp_rank)


def _hidden_shape(model: ShardedMoELM, tokens: Tensor) -> tuple[int, int, int]:
    return (1, tokens.shape[0], model.cfg.hidden_size)


def pipeline_forward(
    model: ShardedMoELM,
    micro_batches: Sequence[Tensor],
    *,
    before_forward: Hook | None = None,
    after_forward: Hook | None = None,
) -> list[Tensor | None]:
    """Forward every micro-batch through all model chunks in model order.

    Returns, per micro-batch, the logits [T, V] on last-stage ranks and None on the others.
    ``before_forward(i)`` / ``after_forward(i)`` run on every rank around its share of micro-batch ``i``.
    """
    spec, place = model.spec, model.place
    num_chunks = spec.pp * spec.vpp
    outputs: list[Tensor | None] = []
    pending: list[PendingSend] = []
    for index, tokens in enumerate(micro_batches):
        if before_forward is not None:
            before_forward(index)
        positions = model.positions(tokens.shape[0])
        logits = None
        for m in range(num_chunks):
            owner, chunk = spec.model_chunk_owner(m)
            if owner != place.pp:
                continue
            if m == 0:
                hidden = model.embed_tokens(tokens)
            else:
                previous = _stage_rank(model, spec.model_chunk_owner(m - 1)[0])
                hidden = recv(_hidden_shape(model, tokens), model.cfg.torch_dtype, model.device, previous)
            hidden = model.run_chunk(chunk, hidden, positions)
            if m == num_chunks - 1:
                logits = model.head(hidden)
            else:
                pending.append(send(hidden, _stage_rank(model, spec.model_chunk_owner(m + 1)[0])))
        outputs.append(logits)
        if after_forward is not None:
            after_forward(index)
    for started in pending:
        started.wait()
    return outputs


def pipeline_train_step(
    model: ShardedMoELM,
    micro_batches: Sequence[Tensor],
    loss_fn: Callable[[int, Tensor], Tensor],
    *,
    use_checkpoint: bool = False,
    before_forward: Hook | None = None,
    before_backward: Hook | None = None,
) -> list[float | None]:
    """Forward and backward every micro-batch with the 1F1B schedule (``vpp == 1``).

    ``loss_fn(i, logits)`` gives micro-batch ``i``'s scalar loss on the last stage; gradients
    accumulate into the stage's parameters. ``before_backward(i)`` runs before micro-batch ``i``'s
    backward (with ``use_checkpoint``: before its recompute). Returns the losses on the last
    stage, None elsewhere.
    """
    spec, place = model.spec, model.place
    if spec.vpp != 1:
        raise NotImplementedError("pipeline_train_step runs the non-interleaved 1F1B schedule: vpp must be 1")
    count = len(micro_batches)
    warmup = min(spec.pp - place.pp - 1, count)
    schedule = ["F"] * warmup + ["F", "B"] * (count - warmup) + ["B"] * warmup
    previous = _stage_rank(model, place.pp - 1) if place.pp > 0 else None
    following = _stage_rank(model, place.pp + 1) if place.pp < spec.pp - 1 else None
    in_flight: deque[tuple[int, Tensor | None, Tensor]] = deque()
    losses: list[float | None] = [None] * count
    pending: list[PendingSend] = []
    next_forward = 0
    for step in schedule:
        if step == "F":
            index, next_forward = next_forward, next_forward + 1
            tokens = micro_batches[index]
            if before_forward is not None:
                before_forward(index)
            stage_input = None
            if previous is None:
                hidden = model.embed_tokens(tokens)
            else:
                stage_input = recv(
                    _hidden_shape(model, tokens), model.cfg.torch_dtype, model.device, previous
                )
                hidden = stage_input.requires_grad_()
            out = model.run_chunk(0, hidden, model.positions(tokens.shape[0]), use_checkpoint=use_checkpoint)
            if following is None:
                out = loss_fn(index, model.head(out))
                losses[index] = float(out.detach())
            else:
                pending.append(send(out, following))
            in_flight.append((index, stage_input, out))
        else:
            index, stage_input, out = in_flight.popleft()  # backwards run in forward order
            if before_backward is not None:
                before_backward(index)
            if following is None:
                torch.autograd.backward(out)
            else:
                torch.autograd.backward(out, recv(out.shape, out.dtype, model.device, following))
            if stage_input is not None and previous is not None:
                if stage_input.grad is None:
                    raise RuntimeError(
                        f"{place.describe()}: micro-batch {index}'s stage input got no gradient"
                    )
                pending.append(send(stage_input.grad, previous))
    for started in pending:
        started.wait()
    return losses
