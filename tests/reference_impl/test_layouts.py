"""The reference layouts (DESIGN §3.5) by hand, and their error texts.

The round-trip properties (bit-exact, tokens and rows together, for every generated batch) are
checked through the subject in ``suites/test_layouts.py``.

Routes are coded so that a row names its token: in a sample whose tokens are ``t``, the row of
position ``p`` holds ``t[p]`` in every slot. After any layout, ``routes[..., 0, 0] == tokens`` wherever
a row exists proves the rows moved with their tokens.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.layouts import (
    LayoutError,
    cp_pad,
    cp_valid_mask,
    cp_zigzag_indices,
    cp_zigzag_shard,
    ep_global_ids,
    ep_local_ids,
    merge_stage_recordings,
    pack,
    place_left_padded,
    plan_micro_batches,
    pp_layer_ranges,
    sp_gather,
    sp_pad,
    sp_shard,
    sp_valid_mask,
    stage_targets,
    stage_targets_moe_ordinal,
)

LAYERS, TOP_K = 3, 2


def coded_sample(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, routes)`` with the row of position p holding tokens[p]."""
    routes = tokens[:-1].view(-1, 1, 1).expand(-1, LAYERS, TOP_K).clone()
    return tokens, routes


def random_samples(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [coded_sample(torch.randint(1, 1000, (n,), generator=generator)) for n in lengths]


# --- 1. left padding -------------------------------------------------------------------------------


def test_place_left_padded_by_hand() -> None:
    placed = place_left_padded([coded_sample(torch.tensor([7, 8, 9]))], width=5)
    assert placed.tokens.tolist() == [[0, 0, 7, 8, 9]]
    assert placed.attention_mask.tolist() == [[False, False, True, True, True]]
    assert placed.replay_mask.tolist() == [[False, False, True, True, False]]
    assert placed.routes[0, :, 0, 0].tolist() == [0, 0, 7, 8, 0]
    assert placed.routes.shape == (1, 5, LAYERS, TOP_K)


def test_place_single_token_sample_has_no_row() -> None:
    placed = place_left_padded([coded_sample(torch.tensor([5]))], width=3)
    assert placed.attention_mask.tolist() == [[False, False, True]]
    assert not placed.replay_mask.any()


def test_place_rejects_width_too_small() -> None:
    samples = random_samples([3, 6], seed=0)
    with pytest.raises(LayoutError, match=r"sample 1: 6 tokens do not fit width 5; width >= 6"):
        place_left_padded(samples, width=5)


def test_place_rejects_wrong_row_count() -> None:
    tokens = torch.tensor([1, 2, 3])
    with pytest.raises(LayoutError, match=r"sample 0: routes has 3 rows, expected len\(tokens\) - 1 = 2"):
        place_left_padded([(tokens, torch.zeros(3, LAYERS, TOP_K))], width=4)


def test_place_rejects_mixed_route_shapes_and_empty_input() -> None:
    first = coded_sample(torch.tensor([1, 2]))
    other = (torch.tensor([1, 2]), torch.zeros(1, LAYERS + 1, TOP_K, dtype=torch.long))
    with pytest.raises(LayoutError, match="sample 1: routes is"):
        place_left_padded([first, other], width=4)
    with pytest.raises(LayoutError, match="samples is empty"):
        place_left_padded([], width=4)


# --- 2. packing ------------------------------------------------------------------------------------


def test_pack_by_hand() -> None:
    mask = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    packing = pack(mask)
    assert packing.indices.tolist() == [1, 2, 3, 4, 5, 8]
    assert packing.cu_seqlens.tolist() == [0, 2, 5, 6]
    assert packing.cu_seqlens.dtype == torch.int32
    assert packing.batch_shape == (3, 3)


def test_pack_rejects_wrong_shapes() -> None:
    packing = pack(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(LayoutError, match=r"batch shape \(2, 4\), expected \(2, 3\)"):
        packing.gather(torch.zeros(2, 4))
    with pytest.raises(LayoutError, match="y has 5 rows, expected N = 6"):
        packing.scatter(torch.zeros(5))
    with pytest.raises(LayoutError, match="attention_mask must be"):
        pack(torch.ones(3, dtype=torch.bool))


# --- 3. micro-batches ------------------------------------------------------------------------------


def test_plan_micro_batches_by_hand() -> None:
    # total 14, budget 7 -> 2 groups; longest first: 5->g0, 4->g1, 3->g1, 2->g0
    plan = plan_micro_batches([5, 3, 4, 2], 7)
    assert plan.groups == [[0, 3], [1, 2]]
    assert plan.order.tolist() == [0, 3, 1, 2]
    assert plan.inverse.tolist() == [0, 2, 3, 1]


def test_plan_adds_groups_when_greedy_overflows() -> None:
    # ceil(12 / 6) = 2 groups cannot hold 5, 5 and 2 within 6 each
    plan = plan_micro_batches([5, 5, 2], 6)
    assert len(plan.groups) == 3


def test_micro_batch_errors_name_the_field() -> None:
    with pytest.raises(LayoutError, match=r"sample 2: seq_len 9 outside \[0, max_tokens_per_micro_batch=8\]"):
        plan_micro_batches([3, 4, 9], 8)
    with pytest.raises(LayoutError, match="max_tokens_per_micro_batch must be >= 1"):
        plan_micro_batches([3], 0)
    plan = plan_micro_batches([5, 3, 4, 2], 7)
    with pytest.raises(LayoutError, match="x has 3 samples, expected B = 4"):
        plan.split(torch.zeros(3))
    with pytest.raises(LayoutError, match=r"micro-batch sizes \[2\], expected \[2, 2\]"):
        plan.merge([torch.zeros(2)])


# --- 4. SP/TP split --------------------------------------------------------------------------------


def test_sp_shard_by_hand() -> None:
    x = torch.arange(5)
    assert sp_pad(x, 2)[1] == 1
    assert sp_shard(x, 2, 0).tolist() == [0, 1, 2]
    assert sp_shard(x, 2, 1).tolist() == [3, 4, 0]
    assert sp_valid_mask(5, 2, 1).tolist() == [True, True, False]
    assert sp_valid_mask(5, 2, 0).tolist() == [True, True, True]


def test_sp_errors() -> None:
    with pytest.raises(LayoutError, match=r"rank must be in \[0, tp=2\), got 2"):
        sp_shard(torch.arange(4), 2, 2)
    with pytest.raises(LayoutError, match=r"shards must have equal lengths, got \[2, 1\]"):
        sp_gather([torch.arange(2), torch.arange(1)], 0)


# --- 5. CP zig-zag ---------------------------------------------------------------------------------


def test_cp_zigzag_by_hand() -> None:
    assert cp_zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(8)
    assert cp_zigzag_shard(x, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_zigzag_shard(x, 2, 1).tolist() == [2, 3, 4, 5]


def test_cp_pads_to_multiple_of_two_cp() -> None:
    x = torch.arange(1, 7)
    padded, pad_len = cp_pad(x, 2)
    assert pad_len == 2 and padded.tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert cp_zigzag_shard(x, 2, 0).tolist() == [1, 2, 0, 0]
    assert cp_valid_mask(6, 2, 0).tolist() == [True, True, False, False]
    assert cp_valid_mask(6, 2, 1).tolist() == [True, True, True, True]


def test_cp_routes_zigzagged_with_tokens_contiguous_is_detectable() -> None:
    # verl #7297: the rank holds tokens [0, 4) but rows of positions [0, 1, 6, 7]
    tokens, routes = coded_sample(torch.arange(10, 19))
    tokens = tokens[:-1]
    wrong_tokens = sp_shard(tokens, 2, 0)
    rows = cp_zigzag_shard(routes, 2, 0)
    assert not torch.equal(rows[..., 0, 0], wrong_tokens)
    assert torch.equal(rows[..., 0, 0], cp_zigzag_shard(tokens, 2, 0))


def test_cp_errors() -> None:
    with pytest.raises(LayoutError, match="padded_len 6 is not a multiple of 2\\*cp = 4"):
        cp_zigzag_indices(6, 2, 0)
    with pytest.raises(LayoutError, match=r"rank must be in \[0, cp=2\), got 3"):
        cp_zigzag_indices(8, 2, 3)


# --- 6. PP/VPP -------------------------------------------------------------------------------------


def decoder_trace(tokens: int, num_layers: int, moe_layers: list[int]) -> torch.Tensor:
    """Decoder-axis trace whose MoE slot l holds 100*l + position; dense slots hold 0."""
    trace = torch.zeros(tokens, num_layers, TOP_K, dtype=torch.long)
    for layer in moe_layers:
        trace[:, layer] = (100 * layer + torch.arange(tokens)).view(-1, 1)
    return trace


def test_pp_stage_targets_first_k_dense_by_hand() -> None:
    # 4 decoder layers, layer 0 dense (first_k_dense_replace = 1), pp = 2
    ranges = pp_layer_ranges(4, 2)
    assert ranges == [[range(0, 2)], [range(2, 4)]]
    moe_layers = [1, 2, 3]
    decoder = decoder_trace(3, 4, moe_layers)
    ordinal = decoder[:, moe_layers]

    stage0 = stage_targets(decoder, moe_layers, ranges[0][0])
    stage1 = stage_targets(decoder, moe_layers, ranges[1][0])
    assert (stage0[:, :, 0] // 100).tolist() == [[1]] * 3  # rank 0 routes layer 1 only
    assert (stage1[:, :, 0] // 100).tolist() == [[2, 3]] * 3

    assert torch.equal(stage_targets_moe_ordinal(ordinal, moe_layers, ranges[0][0]), stage0)
    assert torch.equal(stage_targets_moe_ordinal(ordinal, moe_layers, ranges[1][0]), stage1)

    # verl #5452/#5037: offsets counting decoder layers read the wrong MoE slots on rank 1
    wrong = ordinal[:, ranges[1][0].start : ranges[1][0].stop]
    assert wrong.shape[1] == 1 and not torch.equal(wrong, stage1[:, :1])
    # and a decoder-axis trace read as MoE-ordinal gives each MoE layer the previous layer's slot
    shifted = decoder[:, : len(moe_layers)]
    assert (shifted[0, :, 0] // 100).tolist() == [0, 1, 2]
    assert (ordinal[0, :, 0] // 100).tolist() == [1, 2, 3]


def test_pp_vpp_ranges_by_hand() -> None:
    assert pp_layer_ranges(8, 2, 2) == [
        [range(0, 2), range(4, 6)],
        [range(2, 4), range(6, 8)],
    ]


def test_merge_stage_recordings_orders_vpp_chunks_by_layer() -> None:
    ranges = pp_layer_ranges(8, 2, 2)
    moe_layers = [1, 2, 3, 4, 5, 6, 7]
    decoder = decoder_trace(2, 8, moe_layers)
    per_stage = {
        (rank, chunk): stage_targets(decoder, moe_layers, ranges[rank][chunk])
        for rank in range(2)
        for chunk in range(2)
    }
    merged = merge_stage_recordings(per_stage, ranges, moe_layers=moe_layers)
    assert torch.equal(merged, decoder[:, moe_layers])
    rank_order = torch.cat([per_stage[key] for key in sorted(per_stage)], dim=1)
    assert not torch.equal(rank_order, merged)  # merging VPP chunks in rank order is wrong


def test_pp_errors() -> None:
    with pytest.raises(LayoutError, match="num_layers 6 is not divisible by pp\\*vpp = 4"):
        pp_layer_ranges(6, 2, 2)
    ranges = pp_layer_ranges(4, 2)
    with pytest.raises(LayoutError, match=r"missing \[\(1, 0\)\]"):
        merge_stage_recordings({(0, 0): torch.zeros(1, 1, TOP_K)}, ranges)
    with pytest.raises(LayoutError, match=r"stage \(pp_rank=1, vpp_chunk=0\) has 1 MoE slots, expected 2"):
        merge_stage_recordings(
            {(0, 0): torch.zeros(1, 1, TOP_K), (1, 0): torch.zeros(1, 1, TOP_K)},
            ranges,
            moe_layers=[1, 2, 3],
        )
    with pytest.raises(LayoutError, match=r"MoE-ordinal \[T, n_moe=3, k\]"):
        stage_targets_moe_ordinal(torch.zeros(2, 4, TOP_K), [1, 2, 3], range(0, 2))
    with pytest.raises(LayoutError, match="num_layers >= 4"):
        stage_targets(torch.zeros(2, 3, TOP_K), [1, 2, 3], range(2, 4))
    with pytest.raises(LayoutError, match="strictly increasing"):
        stage_targets(torch.zeros(2, 4, TOP_K), [2, 1], range(0, 2))


# --- 7. EP ids -------------------------------------------------------------------------------------


def test_ep_local_ids_by_hand() -> None:
    ids = torch.tensor([0, 3, 4, 7], dtype=torch.uint8)
    local, owned = ep_local_ids(ids, num_experts=8, ep=2, rank=1)
    assert local.tolist() == [-1, -1, 0, 3]
    assert owned.tolist() == [False, False, True, True]
    assert ep_global_ids(local[owned], 8, 2, 1).tolist() == [4, 7]


def test_ep_errors() -> None:
    with pytest.raises(LayoutError, match=r"ids must be in \[0, num_experts=8\), got \[0, 8\]"):
        ep_local_ids(torch.tensor([0, 8]), 8, 2, 0)
    with pytest.raises(LayoutError, match="num_experts 8 is not divisible by ep = 3"):
        ep_local_ids(torch.tensor([0]), 8, 3, 0)
    with pytest.raises(LayoutError, match=r"local_ids must be in \[0, num_experts/ep=4\), got \[-1, 2\]"):
        ep_global_ids(torch.tensor([-1, 2]), 8, 2, 1)
    with pytest.raises(LayoutError, match=r"rank must be in \[0, ep=2\), got 2"):
        ep_local_ids(torch.tensor([0]), 8, 2, 2)


def test_prompt_lens_give_the_response_mask_not_the_replay_mask() -> None:
    tokens = torch.tensor([5, 6, 7, 8])
    routes = torch.arange(3 * 2).reshape(3, 1, 2)
    placed = place_left_padded([(tokens, routes)], width=6, prompt_lens=[2])
    assert placed.response_mask is not None
    assert placed.response_mask[0].tolist() == [False, False, False, False, True, True]
    assert placed.replay_mask[0].tolist() == [False, False, True, True, True, False]  # prompt rows too
    assert place_left_padded([(tokens, routes)], width=6).response_mask is None
    with pytest.raises(LayoutError, match="prompt_lens has 2 entries"):
        place_left_padded([(tokens, routes)], width=6, prompt_lens=[1, 2])
    with pytest.raises(LayoutError, match=r"prompt_lens\[0\] = 5"):
        place_left_padded([(tokens, routes)], width=6, prompt_lens=[5])
