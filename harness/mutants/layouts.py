"""Layout mutants: routes sliced with other indices than their tokens (DESIGN §3.5–3.6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.mutants import Mutant, mutate, patched_module
from reference_impl import layouts


def stage_targets_by_ordinal(
    routes: torch.Tensor, moe_layers: Sequence[int], layer_range: range
) -> torch.Tensor:
    """A decoder-axis trace indexed by MoE ordinal: with dense-first layers each MoE layer gets a
    lower layer's (dense, zero) slot."""
    ordinals = [j for j, layer in enumerate(moe_layers) if layer in layer_range]
    return routes[:, torch.tensor(ordinals, dtype=torch.long)]


def stage_targets_offset_by_decoder_layers(
    routes: torch.Tensor, moe_layers: Sequence[int], layer_range: range
) -> torch.Tensor:
    """A MoE-ordinal trace sliced from the stage's first decoder layer instead of its first MoE ordinal."""
    count = sum(layer in layer_range for layer in moe_layers)
    return routes[:, layer_range.start : layer_range.start + count]


def merge_in_rank_order(
    per_stage: Mapping[tuple[int, int], torch.Tensor],
    ranges: Sequence[Sequence[range]],
    moe_layers: Any = None,
) -> torch.Tensor:
    """Stage recordings concatenated by (pp rank, vpp chunk): wrong as soon as vpp > 1."""
    return torch.cat([per_stage[key] for key in sorted(per_stage)], dim=1)


def place_prompt_rows_once_per_group(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
    *,
    by_content: bool = False,
) -> layouts.Placed:
    """Prompt rows stored once per group of samples with the same prompt tokens; every later sample
    of the group gets the stored rows. Keyed by the prompt alone (the bug), a sample whose own prompt
    routing differed receives the first sample's; keyed also by the rows (``by_content``, right) the
    store only deduplicates rows that really are equal."""
    if prompt_lens is None:
        return layouts.place_left_padded(samples, width, prompt_lens)
    stored: dict[tuple[object, ...], torch.Tensor] = {}
    shared = []
    for (tokens, routes), prompt_len in zip(samples, prompt_lens, strict=True):
        rows = routes[: max(int(prompt_len) - 1, 0)]
        key: tuple[object, ...] = (tuple(tokens[:prompt_len].tolist()),)
        if by_content:
            key += (tuple(rows.reshape(-1).tolist()),)
        rows = stored.setdefault(key, rows)
        shared.append((tokens, torch.cat([rows, routes[rows.shape[0] :]])))
    return layouts.place_left_padded(shared, width, prompt_lens)


SAMPLE_FIELDS = ("tokens", "attention_mask", "replay_mask", "response_mask")
"""The fields a trainer's dynamic-sampling code rebuilt its samples from: the routes are not among them."""


def select_samples_by_field_list(
    batches: Sequence[layouts.Placed], picks: Sequence[tuple[int, int]], *, repad: bool = False
) -> layouts.Placed:
    """Samples picked field by field from ``SAMPLE_FIELDS``, the routes left where they were: the
    batch keeps the first batch's routes, row for row, so a rejected sample's routes stay on its
    replacement (SkyRL #1908 bug 5). With ``repad`` (right): every picked sample read back whole
    (``unplace``) and placed again, left-padded to the longest picked one."""
    if repad:
        samples = [layouts.unplace(batches[b])[k] for b, k in picks]
        return layouts.place_left_padded(samples, max(t.shape[0] for t, _ in samples))
    picked = layouts.select_samples(batches, picks)
    kept = batches[0].routes
    rows = torch.stack([kept[k % kept.shape[0]] for k in range(len(picks))])
    fields = {f: getattr(picked, f) for f in SAMPLE_FIELDS}
    return layouts.Placed(routes=rows, **fields)


def cp_shard_routes_contiguous(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Tokens (1-D) zig-zag, but routes (3-D) split into cp contiguous pieces."""
    if x.dim() == 1:
        return layouts.cp_zigzag_shard(x, cp, rank)
    padded, _ = layouts.cp_pad(x, cp)
    size = padded.shape[0] // cp
    return padded[rank * size : (rank + 1) * size]


def sp_shard_unpadded_routes(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Tokens padded to a multiple of tp before the split, routes not (hides when T % tp == 0)."""
    if x.dim() == 1:
        return layouts.sp_shard(x, tp, rank)
    size = -(-x.shape[0] // tp)
    return x[rank * size : (rank + 1) * size]


def place_replaying_last_row(samples: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int) -> Any:
    """The placement with each sample's last token marked replayable: its zero filler row is replayed."""
    placed = layouts.place_left_padded(samples, width)
    placed.replay_mask[:, -1] = True
    return placed


def _layouts(**functions: Any) -> Any:
    return patched_module(layouts, **functions)


MUTANTS = (
    Mutant(
        "routes-left-on-replacement",
        "routes detached from their sample",
        "SkyRL #1908 bug 5, NeMo-RL #2849/#3378: dynamic sampling rebuilt the kept samples from a fixed "
        "field list without the routes, so each slot keeps the routes of the sample it replaced (hides "
        "when nothing is filtered)",
        mutate(
            "routes-left-on-replacement",
            layouts=patched_module(layouts, select_samples=select_samples_by_field_list),
        ),
        killed_by="test_layouts.py::test_selected_samples_carry_their_own_routes",
    ),
    Mutant(
        "prompt-rows-keyed-by-prompt",
        "prompt rows of another sample",
        "a placement storing prompt rows once per GRPO group, keyed by the prompt tokens: every sample gets "
        "the first sample's prompt rows, right only on a real prefix hit (hides when the group's prompt "
        "routing agrees; differs after a bf16 prefill in another batch, an evicted block, a resume under "
        "new weights)",
        mutate(
            "prompt-rows-keyed-by-prompt",
            layouts=patched_module(layouts, place_left_padded=place_prompt_rows_once_per_group),
        ),
        killed_by="test_layouts.py::test_samples_of_a_group_keep_their_own_prompt_rows",
    ),
    Mutant(
        "dense-layer-shift",
        "dense-layer shift",
        "verl #5037 (DeepSeek-V3): MoE-ordinal indexing of a decoder-index trace shifts every MoE layer "
        "(hides without dense-first layers)",
        mutate("dense-layer-shift", layouts=_layouts(stage_targets=stage_targets_by_ordinal)),
        killed_by="test_layouts.py::test_stage_targets_give_each_stage_its_own_moe_layers",
    ),
    Mutant(
        "pp-offsets",
        "PP/VPP offsets",
        "verl #5452: PP stage offsets counted dense layers (hides unless pp >= 2 with dense-first layers)",
        mutate(
            "pp-offsets", layouts=_layouts(stage_targets_moe_ordinal=stage_targets_offset_by_decoder_layers)
        ),
        killed_by="test_layouts.py::test_stage_targets_from_moe_ordinal_trace_count_moe_layers",
    ),
    Mutant(
        "vpp-merge-order",
        "PP/VPP offsets",
        "verl #5452 (reorder_and_merge_vpp_layers): VPP chunks merged in rank order (hides unless vpp >= 2)",
        mutate("vpp-merge-order", layouts=_layouts(merge_stage_recordings=merge_in_rank_order)),
        killed_by="test_layouts.py::test_merging_stage_recordings_restores_model_layer_order",
    ),
    Mutant(
        "cp-layout",
        "CP layout",
        "verl #7297: routes sharded contiguously while tokens are zig-zagged across CP ranks",
        mutate("cp-layout", layouts=_layouts(cp_zigzag_shard=cp_shard_routes_contiguous)),
        killed_by="test_layouts.py::test_cp_zigzag_shards_tokens_and_rows_with_the_same_indices",
    ),
    Mutant(
        "fp8-padding",
        "FP8 padding",
        "verl #5989: tokens padded for alignment, routes not (hides when the length is already aligned)",
        mutate("fp8-padding", layouts=_layouts(sp_shard=sp_shard_unpadded_routes)),
        killed_by="test_layouts.py::test_sp_shards_are_contiguous_with_padding_never_replayed",
    ),
    Mutant(
        "filler-replayed",
        "filler replayed",
        "verl #6473: the last row of a sample (no route: the token was never fed) replayed as zeros",
        mutate("filler-replayed", layouts=_layouts(place_left_padded=place_replaying_last_row)),
        killed_by="test_layouts.py::test_placement_puts_each_row_at_its_tokens_column",
    ),
)
