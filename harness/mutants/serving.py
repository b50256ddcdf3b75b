"""Engine-side mutants: capture that loses rows while the engine serves (FACTS §4's engine rows).

Each is the reference serving engine (``reference_impl.serving.ServingEngine``) with one method
replaced; ``suites/test_serving.py`` judges what they return against the model's own routing. Their
correct twins follow them, registered in ``harness.mutants.benign``.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate
from reference_impl.serving import Prefilled, ServingEngine


class ChunkOffsetLost(ServingEngine):
    """Every prefill chunk written at row 0 of the capture buffer (TensorRT-LLM #18397 review; vLLM's
    dual-batch overlap before 0.33.0): the last chunk's rows overwrite the first, the rest stay zero."""

    def _capture(self, buffer: Tensor, offset: int, rows: Tensor) -> None:
        buffer[: rows.shape[0]] = rows


class RejectedDraftRows(ServingEngine):
    """A speculative step keeps the rows of every token it fed, rejected drafts included (SGLang
    #37949: rows in draft-tree order, not the accepted path's): every later row moves down."""

    def _accepted_rows(self, rows: Tensor, kept: int) -> Tensor:
        return rows


class PromptRowsFromDecodeReplica(ServingEngine):
    """The decode replica reads the prompt rows from its own capture buffer, which holds them only
    when it ran the prefill itself (llm-d-router #1473, vllm router #184): a disaggregated request
    gets zeros, a request served whole on one engine looks right."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.captured: dict[tuple[int, ...], Tensor] = {}

    def prefill(self, prompt: object) -> Prefilled:
        prefilled = super().prefill(prompt)  # type: ignore[arg-type]
        self.captured[tuple(prefilled.prompt.tolist())] = prefilled.rows
        return prefilled

    def _prompt_rows(self, prefilled: Prefilled) -> Tensor:
        own = self.captured.get(tuple(prefilled.prompt.tolist()))
        return own if own is not None else torch.zeros_like(prefilled.rows)


class StaleRouteStore(ServingEngine):
    """A weight update that loads the weights and keeps the route store (vLLM 0.31+'s
    ``aux_output_connector/store.py`` never overwrites a block key until a prefix-cache reset):
    a cached prefix is served with the old weights' rows."""

    def load_weights(self, state: dict[str, Tensor]) -> None:  # type: ignore[override]
        self.model.load_state_dict(state)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "chunk-offset-lost",
        "chunk offset lost in capture",
        "every prefill chunk written at row 0 of the capture buffer (TensorRT-LLM #18397 review; vLLM "
        "dual-batch overlap before 0.33.0); hides when the prompt fits one chunk",
        mutate("chunk-offset-lost", serving=ChunkOffsetLost),
        "test_serving.py::test_chunked_prefill_writes_each_chunks_rows_at_its_positions",
    ),
    Mutant(
        "rejected-draft-rows",
        "speculative decoding rows",
        "a speculative step returns the rows of its rejected drafts too (SGLang #37949); hides when "
        "every draft is accepted or none is proposed",
        mutate("rejected-draft-rows", serving=RejectedDraftRows),
        "test_serving.py::test_speculative_decoding_returns_the_accepted_paths_rows",
    ),
    Mutant(
        "prompt-rows-from-decode-replica",
        "prefill/decode disaggregation",
        "the decode replica returns prompt rows from its own capture, which never ran them "
        "(llm-d-router #1473, #1627; vllm router #184); hides when one engine serves the whole request",
        mutate("prompt-rows-from-decode-replica", serving=PromptRowsFromDecodeReplica),
        "test_serving.py::test_a_decode_replica_returns_the_prefill_replicas_prompt_rows",
    ),
    Mutant(
        "stale-route-store",
        "stale prefix routes at the engine",
        "a weight update keeps the prefix route store (vLLM 0.31+ `aux_output_connector/store.py` "
        "until a prefix-cache reset); hides when no block of the prompt was served before the update",
        mutate("stale-route-store", serving=StaleRouteStore),
        "test_serving.py::test_a_weight_update_serves_no_stale_prefix_rows",
    ),
)


# --- correct twins: another legitimate choice in the same code (registered in harness.mutants.benign)


class ChunksIndexedInt32(ServingEngine):
    """A capture buffer of int32 (any integer dtype holds the ids), each chunk's rows put at their
    positions by an index (``index_copy_``), not a slice."""

    def _buffer(self, rows: int) -> Tensor:
        return super()._buffer(rows).to(torch.int32)

    def _capture(self, buffer: Tensor, offset: int, rows: Tensor) -> None:
        positions = torch.arange(offset, offset + rows.shape[0])
        buffer.index_copy_(0, positions, rows.to(buffer.dtype))


class DraftsFromFirstMatch(ServingEngine):
    """Prompt lookup from the earliest match of the n-gram (another lookup; drafts are only proposals),
    the accepted rows handed back with each row's ids sorted."""

    def _drafts(self, context: list[int]) -> list[int]:
        k, n = self.speculative_tokens, self.ngram
        if k == 0 or len(context) <= n:
            return []
        tail = context[-n:]
        starts = [s for s in range(len(context) - n) if context[s : s + n] == tail]
        return context[starts[0] + n : starts[0] + n + k] if starts else []

    def _accepted_rows(self, rows: Tensor, kept: int) -> Tensor:
        return rows[:kept].sort(dim=-1).values


class HandoffInInt16(ServingEngine):
    """The prefill replica hands its prompt rows over as int16 (a narrow transfer), and the decode
    replica answers in int16 throughout."""

    def prefill(self, prompt: object) -> Prefilled:
        prefilled = super().prefill(prompt)  # type: ignore[arg-type]
        return Prefilled(
            prefilled.prompt, prefilled.cache, prefilled.rows.to(torch.int16), prefilled.last_logits
        )

    def _accepted_rows(self, rows: Tensor, kept: int) -> Tensor:
        return rows[:kept].to(torch.int16)


class VersionKeyedRouteStore(ServingEngine):
    """A route store keyed by the weights' version as well as the tokens: a weight update bumps the
    version and keeps the store (old entries are never looked up again)."""

    version = 0

    def _store_key(self, prompt: Tensor, end: int) -> Hashable:
        return (self.version, super()._store_key(prompt, end))

    def load_weights(self, state: dict[str, Tensor]) -> None:  # type: ignore[override]
        self.model.load_state_dict(state)
        self.version += 1
