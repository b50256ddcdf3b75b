"""A KV-cache rollout engine that stands in for vLLM / SGLang, and multi-attempt episodes.

`RolloutEngine.generate` does what an inference engine does for a batch of requests: left-pad the
prompts, run one prefill forward that fills a KV cache, then one forward per decoded token, and
return each sample's sampled tokens, their log-probs and its *routed experts*.

Row rule (DESIGN §2, §3.1). Row ``i`` of a sample's routes is the routing computed when the token
at position ``start + i`` was the model **input**. The prefill gives one row per prompt position
``0 .. P-1``; each decode step feeds the token sampled at the step before, giving one row for its
position ``P, P+1, ...``; the last sampled token is never fed back, so it has no row. A sample with
prompt length P and R sampled tokens therefore has rows for positions ``[start, P + R - 1)``, i.e.
``P + R - 1 - start`` rows. Padding positions are dropped, and so are the steps a sample ran after
it sampled its stop token (it keeps decoding as padding of the batch). No forward ran (R = 0) →
routes ``None``.

How this maps to the real engines (FACTS §1):

* ``layer_axis="decoder"``: one slot per decoder layer, dense layers filled with 0 — SGLang, and
  vLLM 0.14–0.20 and 0.22–0.26.
* ``layer_axis="moe_ordinal"``: one slot per MoE layer — vLLM 0.21 (which also splits prompt and
  generated rows over two fields; the reference returns them as one trace, splitting is a payload
  format that adapters handle).
* ``start`` skips a prompt prefix: vLLM ``SamplingParams.routed_experts_prompt_start`` (0.22+),
  SGLang ``routed_experts_start_len``; rows = prompt + generated − 1 − start in both.
* Ids are logical expert ids, as vLLM ≥ 0.16 and SGLang capture them (before any EPLB remap); the
  trace is int64 here, the narrow storage dtypes are a payload concern.
* Not modelled: prefix caching (SGLang returns the rows of whichever request first filled a KV
  slot), preemption / retraction (re-prefill rows), chunked prefill. Each request is prefilled on
  its own, so its rows are exactly its own routing.

Episodes (`run_episode`) drive the engine the way RL frameworks do for partial rollouts (abort and
resume) and multi-turn tool use: every attempt resubmits the whole context so far — prompt ⊕
earlier responses ⊕ this attempt's tool tokens — as a new prompt (SGLang: "resume is the client's
job"), so each attempt's payload re-prefills every earlier position under the weights live at that
attempt. `reference_impl.splice.splice` then keeps, for every position, the row of the attempt that
actually consumed it (DESIGN §3.4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import LayerAxis, layer_width, moe_slots
from .model import MoELM
from .routers import RoutingMode
from .splice import Attempt

PAD_TOKEN = 0  # id fed at left-padding positions; masked out of attention and its rows dropped


@dataclass(frozen=True)
class Rollout:
    """One sample of `RolloutEngine.generate`.

    ``tokens`` [R] int64: the sampled response tokens (the stop token included when sampled).
    ``logprobs`` [R] float32: log-prob of each sampled token under the engine's own forward, the
    log-softmax at temperature 1 of the logits it was sampled from (RL's "inference log-probs").
    ``routes`` [P + R - 1 - start, layers, top_k] int64 for positions ``[start, P + R - 1)``, or
    ``None`` when no forward ran. ``finish_reason``: ``"stop"`` if the stop token was sampled,
    ``"length"`` if ``max_new_tokens`` was reached.
    """

    prompt_len: int
    tokens: Tensor
    logprobs: Tensor
    routes: Tensor | None
    start: int
    finish_reason: str


class RolloutEngine:
    """Batched generation with a KV cache that returns the routed experts of every sample.

    ``layer_axis`` is the payload's layer convention (``"decoder"`` or ``"moe_ordinal"``, see the
    module docstring); ``start`` is the first position that gets a row.
    """

    def __init__(
        self, model: MoELM, *, layer_axis: LayerAxis | str = LayerAxis.DECODER, start: int = 0
    ) -> None:
        layer_axis = LayerAxis.parse(layer_axis)
        if start < 0:
            raise ValueError(f"start = {start}: expected an int >= 0")
        self.model = model
        self.layer_axis = layer_axis
        self.start = start

    def generate(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int,
        *,
        greedy: bool = True,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> list[Rollout]:
        """Generate up to ``max_new_tokens`` tokens for each prompt, in one batch.

        Greedy argmax, or ``torch.multinomial`` over the temperature-1 distribution with
        ``generator``. A sample that samples ``stop_token`` is finished; it keeps decoding as
        padding of the batch, but nothing it produces afterwards is kept. Runs under
        ``torch.no_grad`` in routing mode RECORD and leaves each router's mode and recordings as
        they were.
        """
        prompt_ids = [self._as_ids(prompt) for prompt in prompts]
        for index, ids in enumerate(prompt_ids):
            if not self.start <= len(ids):
                raise ValueError(
                    f"prompt {index} has length {len(ids)} < start = {self.start} "
                    "(start skips a prefix of the prompt)"
                )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: expected an int >= 0")
        if max_new_tokens == 0 or not prompt_ids:
            return [
                Rollout(
                    len(ids),
                    torch.zeros(0, dtype=torch.int64),
                    torch.zeros(0, dtype=torch.float32),
                    None,
                    self.start,
                    "length",
                )
                for ids in prompt_ids
            ]

        routers = self.model.routers()
        saved = [(router.replay.mode, router.replay.recorded) for router in routers]
        for router in routers:
            router.replay.mode, router.replay.recorded = RoutingMode.RECORD, []
        try:
            with torch.no_grad():
                return self._generate(prompt_ids, max_new_tokens, greedy, generator, stop_token)
        finally:
            for router, (mode, recorded) in zip(routers, saved, strict=True):
                router.replay.mode, router.replay.recorded = mode, recorded

    def _generate(
        self,
        prompt_ids: list[Tensor],
        max_new_tokens: int,
        greedy: bool,
        generator: torch.Generator | None,
        stop_token: int | None,
    ) -> list[Rollout]:
        """The prefill/decode loop; the caller has put the routers in RECORD with no recordings."""
        batch = len(prompt_ids)
        width = max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((batch, width), PAD_TOKEN, dtype=torch.int64)
        attention_mask = torch.zeros((batch, width), dtype=torch.int64)
        for b, ids in enumerate(prompt_ids):  # left padding
            input_ids[b, width - len(ids) :] = ids
            attention_mask[b, width - len(ids) :] = 1

        cache = self.model.new_cache(batch)
        logits = self.model(input_ids, attention_mask=attention_mask, cache=cache)
        # Per forward: routes [B, T, n_moe, k] (a forward's recording is in row order b*T + t).
        forward_routes = [self._pop_routes(batch)]
        sampled: list[Tensor] = []  # per step: [B] token ids
        sampled_logprobs: list[Tensor] = []  # per step: [B] float32
        lengths = torch.zeros(batch, dtype=torch.int64)  # R of each sample so far
        finished = torch.zeros(batch, dtype=torch.bool)
        for step in range(max_new_tokens):
            logprobs = F.log_softmax(logits[:, -1].float(), dim=-1)
            if greedy:
                next_tokens = logprobs.argmax(dim=-1)
            else:
                next_tokens = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]
            sampled.append(next_tokens)
            sampled_logprobs.append(logprobs.gather(-1, next_tokens[:, None])[:, 0])
            lengths += (~finished).long()
            if stop_token is not None:
                finished |= next_tokens == stop_token
            if step == max_new_tokens - 1 or bool(finished.all()):
                break  # the last sampled token is never fed back
            attention_mask = torch.cat([attention_mask, torch.ones((batch, 1), dtype=torch.int64)], dim=1)
            logits = self.model(next_tokens[:, None], attention_mask=attention_mask, cache=cache)
            forward_routes.append(self._pop_routes(batch))

        tokens = torch.stack(sampled, dim=1)
        token_logprobs = torch.stack(sampled_logprobs, dim=1)
        # Per sample, by position: prompt rows from the prefill (padding dropped), then one row per
        # decode step; steps after a sample finished are cut off by its length.
        decode_routes = torch.cat(forward_routes[1:], dim=1) if len(forward_routes) > 1 else None
        rollouts = []
        for b, ids in enumerate(prompt_ids):
            prompt_len, length = len(ids), int(lengths[b])
            rows = [forward_routes[0][b, width - prompt_len :]]
            if decode_routes is not None:
                rows.append(decode_routes[b, : length - 1])
            routes = torch.cat(rows, dim=0)
            assert routes.shape[0] == prompt_len + length - 1  # the row rule, by construction
            finish_reason = (
                "stop" if stop_token is not None and bool(tokens[b, length - 1] == stop_token) else "length"
            )
            rollouts.append(
                Rollout(
                    prompt_len,
                    tokens[b, :length].clone(),
                    token_logprobs[b, :length].clone(),
                    self._to_layer_axis(routes[self.start :]),
                    self.start,
                    finish_reason,
                )
            )
        return rollouts

    def _pop_routes(self, batch: int) -> Tensor:
        """The last forward's recording as [B, T, n_moe, k]."""
        trace = self.model.pop_recording()
        return trace.view(batch, -1, *trace.shape[1:])

    def _to_layer_axis(self, routes: Tensor) -> Tensor:
        """MoE-ordinal routes [rows, n_moe, k] in this engine's layer convention."""
        cfg = self.model.cfg
        width = layer_width(self.layer_axis, cfg.num_layers, cfg.moe_layers)
        out = torch.zeros((routes.shape[0], width, cfg.top_k), dtype=torch.int64)
        out[:, list(moe_slots(self.layer_axis, cfg.moe_layers))] = routes
        return out

    @staticmethod
    def _as_ids(prompt: Sequence[int] | Tensor) -> Tensor:
        ids = torch.as_tensor(prompt, dtype=torch.int64)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"a prompt must be a non-empty 1-D sequence of token ids, got {prompt!r}")
        return ids


# ------------------------------------------------------------------------------------------------
# Partial rollouts and multi-turn episodes
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptPlan:
    """One engine call of an episode.

    ``tool_tokens`` are appended to the context before the call (an observation or tool result
    of a multi-turn episode); ``max_new_tokens`` is the call's generation budget (a partial
    rollout is cut by it and resumed by the next attempt); ``update_weights`` is called on the
    model before the call (fully-async RL: the weights changed between attempts).
    """

    max_new_tokens: int
    tool_tokens: tuple[int, ...] = ()
    update_weights: Callable[[MoELM], None] | None = None


@dataclass(frozen=True)
class Episode:
    """A sample built by several engine calls.

    ``tokens`` [L] is the full sequence prompt ⊕ everything added (tool and generated tokens);
    ``attempts`` holds, per call, how many tokens it added, its payload and how it ended — the
    input of `reference_impl.splice.splice`. Over the response positions ``[P, L)``,
    ``response_logprobs`` [L - P] float32 is the inference log-prob of each generated token and 0
    at tool tokens, which were not sampled; ``sampled_mask`` [L - P] bool says which is which.
    """

    prompt_len: int
    tokens: Tensor
    attempts: list[Attempt]
    response_logprobs: Tensor
    sampled_mask: Tensor


def run_episode(
    engine: RolloutEngine,
    prompt: Sequence[int],
    plans: Sequence[AttemptPlan],
    *,
    greedy: bool = True,
    generator: torch.Generator | None = None,
    stop_token: int | None = None,
) -> Episode:
    """Run ``plans`` one after the other, each resubmitting the whole context as its prompt.

    Attempt ``j`` counts as new tokens its tool tokens plus the tokens it generated; its payload
    covers ``[0, context_after_attempt - 1)``. Tool tokens are counted by the attempt that
    prefills them (DESIGN §3.4): an attempt with ``max_new_tokens == 0`` runs no forward and
    returns no payload, so its tool tokens are counted by the next attempt that runs, and tool
    tokens that no later attempt prefills are in ``tokens`` but in no attempt (they have no row,
    DESIGN §3.6). ``finish_reason`` is ``"abort"`` for an attempt cut by its own budget when more
    attempts follow, else the engine's (``"length"`` or ``"stop"``). ``greedy``, ``generator`` and
    ``stop_token`` are passed to every `RolloutEngine.generate` call; the engine must have
    ``start == 0``, since the splice needs payloads that start at position 0.
    """
    if engine.start != 0:
        raise ValueError(f"run_episode needs an engine with start = 0, got start = {engine.start}")
    tokens = [int(token) for token in prompt]
    logprobs: list[float] = []
    sampled: list[bool] = []
    attempts: list[Attempt] = []
    unfed_tool_tokens = 0  # tool tokens appended since the last forward
    version = 0
    for index, plan in enumerate(plans):
        if plan.update_weights is not None:
            plan.update_weights(engine.model)
            version += 1
        tokens.extend(plan.tool_tokens)
        logprobs.extend([0.0] * len(plan.tool_tokens))
        sampled.extend([False] * len(plan.tool_tokens))
        unfed_tool_tokens += len(plan.tool_tokens)
        rollout = engine.generate(
            [tokens], plan.max_new_tokens, greedy=greedy, generator=generator, stop_token=stop_token
        )[0]
        generated = rollout.tokens.tolist()
        tokens.extend(generated)
        logprobs.extend(rollout.logprobs.tolist())
        sampled.extend([True] * len(generated))
        new_tokens, tool = 0, 0
        if rollout.routes is not None:
            tool = unfed_tool_tokens
            new_tokens, unfed_tool_tokens = unfed_tool_tokens + len(generated), 0
        more_follow = index < len(plans) - 1
        finish_reason = (
            "abort" if rollout.finish_reason == "length" and more_follow else rollout.finish_reason
        )
        kind = "start" if index == 0 else "turn" if plan.tool_tokens else "resume"
        attempts.append(Attempt(new_tokens, rollout.routes, finish_reason, kind, tool, version))
    return Episode(
        len(prompt),
        torch.tensor(tokens, dtype=torch.int64),
        attempts,
        torch.tensor(logprobs, dtype=torch.float32),
        torch.tensor(sampled, dtype=torch.bool),
    )
