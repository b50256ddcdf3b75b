"""Serving features that change which forward computes a row, and the capture rule under each.

`RolloutEngine` prefills each prompt in one forward and decodes one token per forward, so every row
is written by the forward that fed its position. Real engines serve with features that break that
one-to-one picture, and each has shipped a capture bug (FACTS §4):

* **chunked prefill** (`prefill_chunk`): the prompt is fed in chunks; chunk ``c`` writes its rows at
  its own offset ``c · chunk`` of the capture buffer (TensorRT-LLM #18397 review: every chunk at row 0).
* **a prefix route store** (`prefix_block`): rows of a prompt block already served are taken from a
  store keyed by the tokens up to the block's end, as vLLM 0.31+'s route store does beside its KV
  blocks. A weight update makes every stored row stale, so `load_weights` empties the store (vLLM
  keeps them until a prefix-cache reset). The reference still recomputes the KV of a stored block:
  only the rows are served from the store, and they are what is judged.
* **n-gram speculative decoding** (`speculative_tokens`): each decode step drafts up to ``k`` tokens
  by looking the last `ngram` tokens up earlier in the context, feeds the last sampled token and the
  drafts in one forward, keeps the longest draft prefix that greedy decoding would have sampled plus
  one token of its own, and drops the rejected drafts' KV *and rows* (SGLang #37949: rows of the
  tree order, or all zeros, instead of the accepted path's).
* **prefill/decode disaggregation** (`prefill` on one engine, `decode` on another): the prefill
  replica runs the prompt and hands over its KV cache with the prompt's rows; the decode replica
  never ran the prompt, so its rows for positions ``[0, P)`` are the handed-over ones, and it writes
  its own from ``P`` (llm-d-router #1473, vLLM RFC #55584).

Whatever the features, a greedy request of prompt length P that sampled R tokens returns the rows of
positions ``[0, P + R − 1)``, each the routing of the model (live weights) when that position was
fed: the rule of `reference_impl.engine`. One request at a time, greedy, fp32 (DESIGN §6: a
chunk, a cached forward and a full forward route alike), MoE-ordinal rows.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .engine import Rollout, recording
from .model import KVCache, MoELM


@dataclass(frozen=True)
class Prefilled:
    """What a prefill replica hands to a decode replica: the KV cache, the prompt's rows, the logits
    of the last prompt position (the first token is sampled from them) and the prompt itself."""

    prompt: Tensor
    cache: KVCache
    rows: Tensor
    last_logits: Tensor


class ServingEngine:
    """Greedy generation of one request at a time with the serving features switched on.

    ``prefill_chunk``: prefill in chunks of that many tokens (None: one forward).
    ``prefix_block``: serve prompt rows from a route store of blocks of that many tokens (None: off).
    ``speculative_tokens``: n-gram drafts per decode step (0: off); ``ngram``: the lookup length.
    """

    def __init__(
        self,
        model: MoELM,
        *,
        prefill_chunk: int | None = None,
        prefix_block: int | None = None,
        speculative_tokens: int = 0,
        ngram: int = 2,
    ) -> None:
        for name, value in (("prefill_chunk", prefill_chunk), ("prefix_block", prefix_block)):
            if value is not None and value < 1:
                raise ValueError(f"{name} = {value}: expected None or an int >= 1")
        if speculative_tokens < 0 or ngram < 1:
            raise ValueError(
                f"speculative_tokens = {speculative_tokens}, ngram = {ngram}: expected >= 0 and >= 1"
            )
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.prefix_block = prefix_block
        self.speculative_tokens = speculative_tokens
        self.ngram = ngram
        self.store: dict[Hashable, Tensor] = {}

    # ------------------------------------------------------------------ requests

    def generate(self, prompt: Sequence[int] | Tensor, max_new_tokens: int) -> Rollout:
        """Prefill and decode on this engine: rows of positions ``[0, P + R − 1)``."""
        return self.decode(self.prefill(prompt), max_new_tokens)

    def prefill(self, prompt: Sequence[int] | Tensor) -> Prefilled:
        """Run the prompt (in chunks when asked) and capture its rows (from the store where it has them)."""
        ids = torch.as_tensor(prompt, dtype=torch.int64)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(f"prompt: expected a non-empty 1-D sequence of token ids, got {prompt!r}")
        cache = self.model.new_cache(1)
        chunk = self.prefill_chunk or len(ids)
        rows = self._buffer(len(ids))
        logits = torch.empty(0)
        with recording(self.model):
            for offset in range(0, len(ids), chunk):
                logits = self.model(ids[None, offset : offset + chunk], cache=cache)
                self._capture(rows, offset, self.model.pop_recording())
        self._serve_stored(ids, rows)
        return Prefilled(ids, cache, rows, logits[0, -1])

    def decode(self, prefilled: Prefilled, max_new_tokens: int) -> Rollout:
        """Decode from a prefill (this engine's or another replica's): the prompt rows are the prefill's."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: expected an int >= 1")
        prompt_len = len(prefilled.prompt)
        rows = [self._prompt_rows(prefilled)]
        context = prefilled.prompt.tolist()
        logprobs = [F.log_softmax(prefilled.last_logits.float(), dim=-1)]
        tokens = [int(logprobs[0].argmax())]
        with recording(self.model):
            while len(tokens) < max_new_tokens:
                fed_at = prompt_len + len(tokens) - 1  # the position of the last sampled token
                drafts = self._drafts(context + tokens)
                logits = self.model(torch.tensor([[tokens[-1], *drafts]]), cache=prefilled.cache)[0]
                step = F.log_softmax(logits.float(), dim=-1)
                accepted = self._accepted(drafts, step.argmax(dim=-1))
                kept = min(accepted + 1, max_new_tokens - len(tokens))  # fed tokens kept, each with its row
                rows.append(self._accepted_rows(self.model.pop_recording(), kept))
                prefilled.cache.truncate(fed_at + kept)
                tokens += [*drafts[:accepted], int(step[accepted].argmax())][:kept]
                logprobs += list(step[:kept])
        chosen = torch.stack([lp[t] for lp, t in zip(logprobs, tokens, strict=True)])
        return Rollout(prompt_len, torch.tensor(tokens), chosen, torch.cat(rows), 0, "length")

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """A weight update: load ``state`` and drop every stored row (each was routed by the old weights)."""
        self.model.load_state_dict(state)
        self.store.clear()

    # ------------------------------------------------------------------ capture

    def _buffer(self, rows: int) -> Tensor:
        """A capture buffer of ``rows`` rows, zero until a forward writes them."""
        cfg = self.model.cfg
        return torch.zeros((rows, len(cfg.moe_layers), cfg.top_k), dtype=torch.int64)

    def _capture(self, buffer: Tensor, offset: int, rows: Tensor) -> None:
        """Write a prefill chunk's rows at the position of its first token."""
        buffer[offset : offset + rows.shape[0]] = rows

    def _accepted_rows(self, rows: Tensor, kept: int) -> Tensor:
        """A decode step's rows: the accepted path's only (the last sampled token and the accepted drafts)."""
        return rows[:kept]

    def _prompt_rows(self, prefilled: Prefilled) -> Tensor:
        """The prompt's rows: those the prefill handed over (captured by the replica that ran the prompt)."""
        return prefilled.rows

    def _serve_stored(self, prompt: Tensor, rows: Tensor) -> None:
        """Rows of every full prompt block already in the store come from it; the others are stored."""
        if self.prefix_block is None:
            return
        block = self.prefix_block
        for end in range(block, len(prompt) + 1, block):
            key = self._store_key(prompt, end)
            if key in self.store:
                rows[end - block : end] = self.store[key]
            else:
                self.store[key] = rows[end - block : end].clone()

    def _store_key(self, prompt: Tensor, end: int) -> Hashable:
        """The store's key of the block ending at ``end``: every token up to it (a hash chain's content)."""
        return tuple(prompt[:end].tolist())

    # ------------------------------------------------------------------ speculation

    def _drafts(self, context: list[int]) -> list[int]:
        """Up to ``speculative_tokens`` tokens that followed the last earlier match of the context's
        last ``ngram`` tokens (prompt lookup decoding); none when speculation is off or nothing matches."""
        k, n = self.speculative_tokens, self.ngram
        if k == 0 or len(context) <= n:
            return []
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                return context[start + n : start + n + k]
        return []

    @staticmethod
    def _accepted(drafts: list[int], greedy: Tensor) -> int:
        """How many leading drafts greedy decoding samples too (``greedy[i]`` follows fed token i)."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == int(greedy[accepted]):
            accepted += 1
        return accepted
