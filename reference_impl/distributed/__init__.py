"""The reference MoE LM sharded over real ``torch.distributed`` process groups.

Routing replay has to survive every way a trainer splits a model: the routers of a rank see only
its tokens (SP/TP contiguous shards, CP zig-zag chunks), a rank holds only its layers (PP, VPP
chunks in Megatron's interleaved order) and its experts (EP, reached by an all-to-all dispatch),
and activation recompute re-runs a stage's routers in backward. This package runs the reference
model that way, on gloo (CPU) or NCCL (GPU) process groups, so "record in a layout, gather back"
and "slice a global trace for a layout, replay" can be compared with the single-process model.

Read in order: `topology` (which rank holds what; process groups), `model` (`ShardedMoELM`: one
rank's share of the forward, and what is and is not sharded), `pipeline` (point-to-point stages,
forward-only and 1F1B with recompute), `routes` (slicing global traces for a rank and gathering
recordings back, with any ``layouts``), `collectives` (the differentiable collectives used).
Pure torch; nothing here imports the harness.
"""

from .model import ShardedMoEBlock, ShardedMoELM
from .pipeline import pipeline_forward, pipeline_train_step
from .routes import (
    gather_recordings,
    gather_token_values,
    merge_sequence,
    next_token_labels,
    rank_rows,
    rank_targets,
    rank_tokens,
    router_rows,
    stage_moe_counts,
    token_logprobs,
)
from .topology import ParallelSpec, ProcessGroups, RankPlace, TopologyError, new_groups

__all__ = [
    "ParallelSpec",
    "ProcessGroups",
    "RankPlace",
    "ShardedMoEBlock",
    "ShardedMoELM",
    "TopologyError",
    "gather_recordings",
    "gather_token_values",
    "merge_sequence",
    "new_groups",
    "next_token_labels",
    "pipeline_forward",
    "pipeline_train_step",
    "rank_rows",
    "rank_targets",
    "rank_tokens",
    "router_rows",
    "stage_moe_counts",
    "token_logprobs",
]
