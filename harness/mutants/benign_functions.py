"""The benign variants' pure functions: correct truncate, splice, decode_payload, layouts and training
that choose differently from the reference (another integer dtype, another id order within a route,
numpy instead of torch, another EP ownership scheme, another padding or micro-batch packing), and
refusals in a framework's own words. ``harness.mutants.benign`` makes subjects of them.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from harness.conventions import decode_payload
from harness.mutants import patched_module
from harness.mutants.conventions import rebuilt
from harness.subjects.capabilities import LayoutsCapability, members
from harness.trace import RoutingTrace
from reference_impl import MoELM, layouts, splice, training
from reference_impl.layouts import LayoutError, MicroBatchPlan, Placed

# --- truncate --------------------------------------------------------------------------------------


def truncate_to_int32(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct cut, routes handed back as int32 (any integer dtype that holds the ids is right)."""
    cut_tokens, cut_routes = splice.truncate(tokens, routes, prompt_len, max_response_len)
    return cut_tokens, cut_routes.to(torch.int32)


def truncate_dedup_by_position(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of ``truncation-collapses-repeated-rows``: ``unique_consecutive`` over rows keyed by
    their position (a resume's re-sent overlap row has its position twice, equal routes at two
    positions do not), so nothing real is collapsed; the last kept token's real row is kept."""
    splice.truncate(tokens, routes, prompt_len, max_response_len)  # same input checks
    keep = min(tokens.shape[0], prompt_len + max_response_len)
    flat = torch.as_tensor(routes).flatten(1).long()
    keyed = torch.cat([torch.arange(flat.shape[0]).unsqueeze(1), flat], dim=1)
    unique = torch.unique_consecutive(keyed, dim=0)[:, 1:].reshape(-1, *routes.shape[1:])
    return tokens[:keep], unique[:keep].to(routes.dtype)


def truncate_keeping_last_kept_row(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cut to ``P + R′`` tokens and keep ``P + R′`` rows when something was cut: the last kept token was
    forwarded (a later token was sampled from it), so its row is a real route (DESIGN §3.1). numpy out."""
    keep = min(tokens.shape[0], prompt_len + max_response_len)
    splice.truncate(tokens, routes, prompt_len, max_response_len)  # same input checks
    rows = keep if keep < tokens.shape[0] else keep - 1
    return tokens[:keep].numpy(), routes[:rows].numpy()


# --- splice ----------------------------------------------------------------------------------------


def splice_to_numpy(prompt_len: int, attempts: Sequence[splice.Attempt]) -> np.ndarray:
    """The correct splice, returned as a numpy int32 array with each route's ids sorted."""
    return np.sort(splice.splice(prompt_len, attempts).numpy().astype(np.int32), axis=-1)


def splice_payload_tails(prompt_len: int, attempts: Sequence[splice.Attempt]) -> torch.Tensor:
    """The twin of ``seam-found-by-content``: each later attempt's rows are the last ``new_tokens``
    rows of its payload (the rows before them are the context it re-prefilled), found by the
    payload's length, never by content (verl's ``FullyAsyncLLMServerClient`` with its ``[-0:]``
    guard); the first contributing attempt's payload whole. Bad input: the reference's checks."""
    checked = splice.splice(prompt_len, attempts)  # same input checks; the answer when nothing was fed
    rows: list[torch.Tensor] = []
    for attempt in attempts:
        if not attempt.new_tokens or attempt.routes is None:
            continue
        payload = torch.as_tensor(attempt.routes)
        rows.append(payload[-attempt.new_tokens :] if rows else payload)
    return torch.cat(rows) if rows else checked


def splice_into_buffer(prompt_len: int, attempts: Sequence[splice.Attempt]) -> torch.Tensor | None:
    """The correct splice written as a buffer fill: allocate ``P + Σa − 1`` rows, then copy each
    contributing attempt's own new positions from the same rows of its payload, by index. It never
    compares rows, so rows that repeat across a seam stay where they are (the twin of the
    ``repeated-row-at-seam`` mutant). ``None`` when no position was fed; its own ValueErrors."""
    if prompt_len < 1 or any(a.new_tokens < 0 for a in attempts):
        raise ValueError(
            f"bad schedule: prompt of {prompt_len}, new tokens {[a.new_tokens for a in attempts]}"
        )
    rows = prompt_len + sum(a.new_tokens for a in attempts) - 1
    buffer: torch.Tensor | None = None
    filled, context_len = 0, prompt_len
    for attempt in attempts:
        context_len += attempt.new_tokens
        if not attempt.new_tokens:
            continue
        payload = attempt.routes
        if payload is None or payload.dim() != 3 or payload.shape[0] != context_len - 1:
            shape = None if payload is None else tuple(payload.shape)
            raise ValueError(f"payload {shape} cannot fill positions [{filled}, {context_len - 1})")
        if buffer is None:
            buffer = payload.new_zeros((rows, *payload.shape[1:]))
        buffer[filled : context_len - 1] = payload[filled : context_len - 1]
        filled = context_len - 1
    if buffer is None and rows:
        raise ValueError(f"no attempt added a token: nobody owns the {rows} prompt rows")
    return buffer


def splice_refusing_omitted_prefixes(prompt_len: int, attempts: Sequence[splice.Attempt]) -> torch.Tensor:
    """The correct splice for engines that return whole payloads, refusing, in its own words, any
    payload whose engine omitted a cached prefix (``routes_start`` > 0): a feature it does not
    support, refused rather than read shifted (the twin of ``omitted-prefix-read-from-zero``)."""
    for index, attempt in enumerate(attempts):
        if attempt.routes_start:
            raise NotImplementedError(f"attempt {index}: payloads omitting a cached prefix are not supported")
    return splice.splice(prompt_len, attempts)


# --- decode_payload ---------------------------------------------------------------------------------


def decode_sorted_ids(*args: Any, **kwargs: Any) -> RoutingTrace:
    """The correct decoding with each route's ids sorted (kernels order top-k as they like, §3.3)."""
    trace = decode_payload(*args, **kwargs)
    return rebuilt(trace, np.sort(trace.experts, axis=-1))


def decode_to_moe_ordinal(*args: Any, **kwargs: Any) -> RoutingTrace:
    """The correct decoding, always on the MoE-ordinal layer axis (vLLM 0.21's, Megatron R2's)."""
    return decode_payload(*args, **kwargs).to_moe_ordinal()


# --- layouts ---------------------------------------------------------------------------------------


def ep_local_ids_round_robin(
    ids: torch.Tensor, num_experts: int, ep: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-robin expert ownership: expert e lives on rank e mod ep as local id e // ep."""
    _ = layouts.ep_local_ids(ids, num_experts, ep, rank)  # same input checks
    ids = ids.long()
    owned = ids % ep == rank
    return torch.where(owned, ids // ep, torch.full_like(ids, -1)), owned


def ep_global_ids_round_robin(local_ids: torch.Tensor, num_experts: int, ep: int, rank: int) -> torch.Tensor:
    """Inverse of :func:`ep_local_ids_round_robin` on rank ``rank``."""
    _ = layouts.ep_global_ids(local_ids, num_experts, ep, rank)  # same input checks
    return local_ids.long() * ep + rank


def place_prompt_left_response_right(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """Given prompt lengths, prompts left-padded to the longest prompt and responses right-padded after
    it (verl's older ``prompts ⊕ responses`` batch); every row stays at its token's column."""
    placed = layouts.place_left_padded(samples, width, prompt_lens)
    if prompt_lens is None:
        return placed
    prompt_width = max(prompt_lens)
    needed = prompt_width + max(t.shape[0] - p for (t, _), p in zip(samples, prompt_lens, strict=True))
    if needed > width:
        raise LayoutError(f"width {width}: prompts left-padded to {prompt_width} and responses need {needed}")
    shifts = [width - t.shape[0] - (prompt_width - p) for (t, _), p in zip(samples, prompt_lens, strict=True)]

    def moved(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.roll(row, -shift, dims=0) for row, shift in zip(x, shifts, strict=True)])

    assert placed.response_mask is not None
    return Placed(
        moved(placed.tokens),
        moved(placed.attention_mask),
        moved(placed.routes),
        moved(placed.replay_mask),
        moved(placed.response_mask),
    )


def plan_micro_batches_first_fit(seq_lens: Sequence[int], max_tokens_per_micro_batch: int) -> MicroBatchPlan:
    """Samples packed in order, a new micro-batch whenever the budget would overflow; each group
    listed longest first (no balancing: a simpler trainer's packing)."""
    layouts.plan_micro_batches(seq_lens, max_tokens_per_micro_batch)  # same input checks
    groups: list[list[int]] = [[]]
    load = 0
    for index, length in enumerate(seq_lens):
        if groups[-1] and load + length > max_tokens_per_micro_batch:
            groups.append([])
            load = 0
        groups[-1].append(index)
        load += length
    groups = [sorted(group, key=lambda i: (-seq_lens[i], i)) for group in groups]
    order = torch.tensor([i for group in groups for i in group], dtype=torch.long)
    return MicroBatchPlan(groups, order, torch.argsort(order))


# --- training --------------------------------------------------------------------------------------


def replay_targets_int32_sorted(
    placed: Placed, moe_layers: Sequence[int], layer_axis: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct targets as int32 with each route's ids sorted, the mask as uint8."""
    targets, mask = training.replay_targets(placed, moe_layers, layer_axis)
    return targets.to(torch.int32).sort(-1).values, mask.to(torch.uint8)


def reference_logprobs_on_a_copy(model_ref: MoELM, placed: Placed) -> torch.Tensor:
    """π_ref from a frozen copy of the model whose routers were reset to native routing."""
    frozen = copy.deepcopy(model_ref)
    frozen.clear_replay()
    frozen.set_routing_mode(training.RoutingMode.NATIVE)
    with torch.no_grad():
        return training.token_logprobs(frozen, placed.tokens, placed.attention_mask)


# --- errors in a framework's own words ------------------------------------------------------------------


def in_own_words(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` refusing bad input with a framework's own terse wording (the offending field unnamed)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ValueError:
            raise ValueError(f"{fn.__name__}: arguments do not describe a valid batch") from None

    return call


LAYOUTS_IN_OWN_WORDS = patched_module(
    layouts, **{name: in_own_words(getattr(layouts, name)) for name in members(LayoutsCapability)}
)
