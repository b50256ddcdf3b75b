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

Episodes of several attempts (partial rollouts, multi-turn) are played through `generate_one` by
`reference_impl.episode.run_episode`, the one driver every engine shares.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import LayerAxis, layer_width, moe_slots
from .model import MoELM
from .routers import RoutingMode

PAD_TOKEN = 0  # id fed at left-padding positions; masked out of attention and its rows dropped


@dataclass(frozen=True)
class Rollout:
    """One sample of one engine call: what `RolloutEngine.generate` returns per prompt.

    The one rollout type of every engine that returns torch tensors (this engine, the harness's
    transformers KV-cache engine and its simulated engine); `reference_impl.episode.run_episode`
    reads it as an ``EngineCall``.

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


@contextmanager
def recording(model: MoELM) -> Iterator[None]:
    """An engine's forwards: every router in RECORD with no recordings, no gradients; each router's
    mode and recordings as they were afterwards (an engine call leaves the trainer's state alone)."""
    routers = model.routers()
    saved = [(router.replay.mode, router.replay.recorded) for router in routers]
    for router in routers:
        router.replay.mode, router.replay.recorded = RoutingMode.RECORD, []
    try:
        with torch.no_grad():
            yield
    finally:
        for router, (mode, recorded) in zip(routers, saved, strict=True):
            router.replay.mode, router.replay.recorded = mode, recorded


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

        with recording(self.model):
            return self._generate(prompt_ids, max_new_tokens, greedy, generator, stop_token)

    def generate_one(
        self,
        context: Sequence[int] | Tensor,
        max_new_tokens: int,
        *,
        greedy: bool = True,
        generator: torch.Generator | None = None,
        stop_token: int | None = None,
    ) -> Rollout:
        """One engine call of an episode: `generate` on the batch of one ``context``."""
        return self.generate(
            [context], max_new_tokens, greedy=greedy, generator=generator, stop_token=stop_token
        )[0]

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
