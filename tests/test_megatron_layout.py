"""The Megatron target layout (pure torch: runs without megatron-core)."""

from __future__ import annotations

import pytest
import torch

from harness.errors import MegatronReplayError
from harness.trace import RoutingTrace
from harness.trainers.megatron.layout import (
    MegatronLayout,
    batch_routes,
    expected_local_map,
    ids_to_map,
    merge_recordings,
    random_traces,
    rank_targets,
)

LAYOUT = MegatronLayout(
    num_layers=4, moe_layers=(1, 3), num_experts=8, top_k=2, seq_len=6, micro_batch=3, tp=2, ep=2, dp=2
)


def test_rank_targets_are_seq_major_sp_shards_of_the_moe_layers() -> None:
    traces = random_traces(LAYOUT, 0)
    routes = batch_routes(traces, LAYOUT)
    s_local = LAYOUT.seq_len // LAYOUT.tp
    for dp in range(LAYOUT.dp):
        for tp in range(LAYOUT.tp):
            targets = rank_targets(routes, LAYOUT, dp_rank=dp, tp_rank=tp, pp_rank=0)
            assert len(targets) == 2
            for j, layer in enumerate(LAYOUT.moe_layers):
                assert targets[j].shape == (LAYOUT.local_tokens, LAYOUT.top_k)
                for s in range(s_local):
                    for b in range(LAYOUT.micro_batch):
                        sample = traces[dp * LAYOUT.micro_batch + b].experts
                        expected = torch.from_numpy(sample[tp * s_local + s, layer].astype("int64"))
                        assert torch.equal(targets[j][s * LAYOUT.micro_batch + b], expected)


def test_merge_recordings_inverts_rank_targets() -> None:
    routes = batch_routes(random_traces(LAYOUT, 1), LAYOUT)
    per_rank = {
        (d, t, 0): rank_targets(routes, LAYOUT, dp_rank=d, tp_rank=t, pp_rank=0)
        for d in range(LAYOUT.dp)
        for t in range(LAYOUT.tp)
    }
    assert torch.equal(merge_recordings(per_rank, LAYOUT), routes[:, :, list(LAYOUT.moe_layers)])


def test_pipeline_stage_gets_only_its_moe_layers() -> None:
    layout = MegatronLayout(
        num_layers=4, moe_layers=(1, 3), num_experts=8, top_k=2, seq_len=6, micro_batch=1, pp=2
    )
    routes = batch_routes(random_traces(layout, 2), layout)
    assert layout.stage_moe_layers(0) == [1] and layout.stage_moe_layers(1) == [3]
    (second,) = rank_targets(routes, layout, dp_rank=0, tp_rank=0, pp_rank=1)
    assert torch.equal(second, routes[0, :, 3])


VPP = MegatronLayout(
    num_layers=4, moe_layers=(1, 2, 3), num_experts=8, top_k=2, seq_len=4, micro_batch=2, tp=2, pp=2, vpp=2
)


def test_a_ranks_vpp_chunks_are_interleaved_model_chunks() -> None:
    """PP = 2, VPP = 2: rank 0 builds layers 0 and 2 (chunk 0 dense), rank 1 layers 1 and 3."""
    assert [VPP.stage_moe_layers(0, c) for c in range(2)] == [[], [2]]
    assert VPP.rank_moe_layers(0) == [2] and VPP.rank_moe_layers(1) == [1, 3]
    routes = batch_routes(random_traces(VPP, 3), VPP)
    (chunk1,) = rank_targets(routes, VPP, dp_rank=0, tp_rank=0, pp_rank=0, vpp_chunk=1)
    assert torch.equal(chunk1, routes[:, :2, 2].transpose(0, 1).reshape(-1, 2))


def test_merge_recordings_inverts_rank_targets_across_vpp_chunks() -> None:
    """Each rank records its chunks' routers in turn; the merge puts every chunk at its model layers."""
    routes = batch_routes(random_traces(VPP, 4), VPP)
    per_rank = {
        (0, t, p): [
            target
            for c in range(VPP.vpp)
            for target in rank_targets(routes, VPP, dp_rank=0, tp_rank=t, pp_rank=p, vpp_chunk=c)
        ]
        for t in range(VPP.tp)
        for p in range(VPP.pp)
    }
    assert torch.equal(merge_recordings(per_rank, VPP), routes[:, :, [1, 2, 3]])
    per_rank[(0, 0, 1)] = per_rank[(0, 0, 1)][:1]
    with pytest.raises(MegatronReplayError, match=r"recordings\[\(0, 0, 1\)\]: 1 routers, expected 2"):
        merge_recordings(per_rank, VPP)


def test_expected_local_map_splits_global_ids_by_ep_rank() -> None:
    ids = torch.tensor([[0, 5], [3, 4], [6, 7]])
    assert expected_local_map(ids, LAYOUT, 0).tolist() == [
        [True, False, False, False],
        [False, False, False, True],
        [False] * 4,
    ]
    assert expected_local_map(ids, LAYOUT, 1).tolist() == [
        [False, True, False, False],
        [True, False, False, False],
        [False, False, True, True],
    ]
    full = torch.cat([expected_local_map(ids, LAYOUT, r) for r in range(2)], dim=1)
    assert torch.equal(full, ids_to_map(ids, 8))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seq_len": 5}, "multiple of tp"),
        ({"dp": 1}, "etp·ep"),
        ({"num_experts": 6, "ep": 4, "dp": 4}, "divisible by ep"),
    ],
)
def test_layouts_megatron_cannot_run_are_rejected(change: dict[str, int], message: str) -> None:
    kwargs = dict(
        num_layers=4, moe_layers=(1, 3), num_experts=8, top_k=2, seq_len=6, micro_batch=3, tp=2, ep=2, dp=2
    )
    kwargs.update(change)
    with pytest.raises(MegatronReplayError, match=message):
        MegatronLayout(**kwargs)  # type: ignore[arg-type]


def test_traces_that_do_not_cover_every_input_position_are_rejected() -> None:
    traces = random_traces(LAYOUT, 0)
    short = RoutingTrace(traces[0].experts[:-1], num_experts=8, moe_layers=(1, 3))
    with pytest.raises(MegatronReplayError, match="rows, expected seq_len"):
        batch_routes([short, *traces[1:]], LAYOUT)
    wrong_moe = RoutingTrace(traces[0].experts, num_experts=8, moe_layers=(1,))
    with pytest.raises(MegatronReplayError, match="moe_layers"):
        batch_routes([wrong_moe, *traces[1:]], LAYOUT)


def test_a_packed_alignment_is_read_off_cu_seqlens_padded() -> None:
    """The rows follow ``cu_seqlens_padded``: its alignment is read off it (any multiple of ``tp``),
    and padding that is not each sample rounded up to one multiple is refused."""
    from harness.trainers.megatron import packed as thd

    cu = thd.cu_seqlens([5, 6])
    assert thd.check_cu_seqlens([5, 6], cu, thd.cu_seqlens([8, 8]), 1) == 8
    assert thd.check_cu_seqlens([5, 6], cu, thd.cu_seqlens([6, 6]), 2) == 6
    assert thd.check_cu_seqlens([5, 6], cu, cu, 1) == 1
    layout = MegatronLayout(
        num_layers=3,
        moe_layers=(1, 2),
        num_experts=4,
        top_k=2,
        seq_len=8,
        micro_batch=2,
        lengths=(5, 6),
        align=4,
    )
    assert thd.packed_slots([5, 6], layout.packing_align)[5:8, 0].tolist() == [-1, -1, -1]
    assert thd.packed_slots([5, 6], layout.packing_align)[8, 0] == 1
    for bad in ([8, 7], [5, 8], [4, 8]):
        with pytest.raises(MegatronReplayError, match="cu_seqlens_q_padded"):
            thd.check_cu_seqlens([5, 6], cu, thd.cu_seqlens(bad), 1)
    with pytest.raises(MegatronReplayError, match="multiple of tp"):
        thd.check_cu_seqlens([5, 6], cu, thd.cu_seqlens([5, 6]), 2)
    with pytest.raises(MegatronReplayError, match="align = 3"):
        MegatronLayout(
            num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2, seq_len=8, micro_batch=2, tp=2, align=3
        )
