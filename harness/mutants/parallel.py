"""Parallel-layout mutants: bugs that show once the model really runs sharded (suites/test_distributed.py).

Each is the reference with one capability replaced — the ``layouts`` the trainer slices targets and
merges recordings with, or the ``install_replay`` handle that drives each rank's routers — and is
killed by the distributed suite on real process groups (several also by suites/test_layouts.py or
suites/test_replay.py, on their own terms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from harness.mutants import Mutant, mutate, patched_module
from harness.subjects.reference import ReferenceReplay
from reference_impl import MoELM, layouts


def cp_merge_in_rank_order(shards: Sequence[Tensor], pad_len: int) -> Tensor:
    """CP shards concatenated in rank order, as if each rank held one contiguous piece: the routes
    recorded on zig-zag ranks land on other positions (verl #7297, the gather direction)."""
    full = torch.cat(list(shards), dim=0)
    return full[: full.shape[0] - pad_len]


def pp_layer_ranges_contiguous(num_layers: int, pp: int, vpp: int = 1) -> list[list[range]]:
    """Each rank's virtual chunks taken as *consecutive* model chunks (rank r: chunks r·vpp … r·vpp+vpp−1)
    instead of Megatron's interleaved c·pp + r: identical unless vpp ≥ 2 (verl #5452)."""
    size = num_layers // (pp * vpp)
    return [[range((r * vpp + c) * size, (r * vpp + c + 1) * size) for c in range(vpp)] for r in range(pp)]


def stage_targets_from_stage_start(routes: Tensor, moe_layers: Sequence[int], layer_range: range) -> Tensor:
    """A stage's MoE slots counted from its first decoder layer: a stage that begins with dense layers
    takes their (zero) slots and every MoE layer after them is shifted (verl #5037 under PP)."""
    count = sum(layer in layer_range for layer in moe_layers)
    return routes[:, layer_range.start : layer_range.start + count]


def sp_shard_strided(x: Tensor, tp: int, rank: int) -> Tensor:
    """Round-robin SP split (position p on rank p % tp) where Megatron's sequence parallelism holds
    contiguous S/tp shards (FACTS §2): each rank's routes belong to other tokens."""
    padded, _ = layouts.sp_pad(x, tp)
    return padded[rank::tp]


def ep_local_ids_in_place(ids: Tensor, num_experts: int, ep: int, rank: int) -> tuple[Tensor, Tensor]:
    """Global → local ids computed *in place*: the dispatch rewrites the router's own ids tensor, so
    the recorded trace holds local ids (ids must stay global logical ids: FACTS §2 EP)."""
    per_rank = num_experts // ep
    ids = ids.long()  # no copy when the ids already are int64: the caller's tensor
    owned = ids // per_rank == rank
    ids[owned] -= rank * per_rank
    return torch.where(owned, ids, torch.full_like(ids, -1)), owned


class FifoClearedPerMicroBatch(ReferenceReplay):
    """Every ``replay`` first clears the recompute FIFO (Megatron's ``clear_global_indices`` called per
    micro-batch instead of per step): with two micro-batches in flight, as on PP stage 0 under 1F1B,
    the first backward recomputes with the second micro-batch's targets."""

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        for router in self.model.routers():
            router.replay.backward_targets.clear()
        super().replay(targets, mask)


def _installer(handle: type[ReferenceReplay]) -> Callable[[MoELM], ReferenceReplay]:
    def install_replay(model: MoELM) -> ReferenceReplay:
        return handle(model)

    return install_replay


def _layouts(**functions: object) -> object:
    return patched_module(layouts, **functions)


MUTANTS = (
    Mutant(
        "cp-merge-contiguous",
        "CP layout",
        "verl #7297: CP recordings merged as contiguous pieces while the ranks held zig-zag chunks "
        "(hides unless cp >= 2)",
        mutate("cp-merge-contiguous", layouts=_layouts(cp_zigzag_merge=cp_merge_in_rank_order)),
        killed_by="test_layouts.py::test_cp_zigzag_shards_tokens_and_rows_with_the_same_indices",
    ),
    Mutant(
        "vpp-chunks-contiguous",
        "PP/VPP offsets",
        "verl #5452: VPP chunks assigned as consecutive model chunks per rank instead of Megatron's "
        "interleaved order (hides unless vpp >= 2)",
        mutate("vpp-chunks-contiguous", layouts=_layouts(pp_layer_ranges=pp_layer_ranges_contiguous)),
        killed_by="test_layouts.py::test_pp_layer_ranges_cover_every_layer_once",
    ),
    Mutant(
        "stage-dense-shift",
        "dense-layer shift",
        "verl #5037 (DeepSeek-V3) under PP: a stage's MoE slots counted from its first decoder layer, so a "
        "stage starting with dense layers replays their zero slots (hides without dense-first layers)",
        mutate("stage-dense-shift", layouts=_layouts(stage_targets=stage_targets_from_stage_start)),
        killed_by="test_layouts.py::test_stage_targets_give_each_stage_its_own_moe_layers",
    ),
    Mutant(
        "sp-shard-strided",
        "SP slicing",
        "Megatron SP routes contiguous S/tp shards (FACTS §2); routes split round-robin instead, the SP form "
        "of verl #7297's sharding mismatch (hides unless tp >= 2)",
        mutate("sp-shard-strided", layouts=_layouts(sp_shard=sp_shard_strided)),
        killed_by="test_layouts.py::test_sp_shards_are_contiguous_with_padding_never_replayed",
    ),
    Mutant(
        "ep-local-ids-in-place",
        "EP local/global ids",
        "EP dispatch maps global → local expert ids in place, so traces record local ids (as vLLM 0.14 "
        "recorded post-remap physical ids, fixed by #33013; hides unless ep >= 2)",
        mutate("ep-local-ids-in-place", layouts=_layouts(ep_local_ids=ep_local_ids_in_place)),
        killed_by="test_layouts.py::test_ep_local_ids_round_trip_and_traces_keep_global_ids",
    ),
    Mutant(
        "recompute-fifo-cleared",
        "recompute drift",
        "Megatron RouterReplay: clear_global_indices() called per micro-batch, emptying the recompute "
        "FIFO while an earlier micro-batch still awaits its backward (hides unless two are in flight, "
        "as under PP)",
        mutate("recompute-fifo-cleared", install_replay=_installer(FifoClearedPerMicroBatch)),
        killed_by="test_replay.py::test_recompute_replays_each_forwards_targets[reference-softmax_topk-fp32]",
    ),
)

_BY_NAME = {m.name: m for m in MUTANTS}


def __getattr__(name: str) -> object:
    """``parallel.<mutant-name>`` is that mutant's subject, so ``--rr-subject
    harness.mutants.parallel:<name>`` loads it (as ``harness.mutants.registry:<name>`` does)."""
    if name in _BY_NAME:
        return _BY_NAME[name].subject
    raise AttributeError(name)
