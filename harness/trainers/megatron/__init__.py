"""The Megatron-core trainer backend: canonical traces → ``RouterReplay`` targets, and replay.

- ``layout``: pure torch; a canonical trace batch → per-rank, per-router targets in Megatron's
  layout (DP split, seq-major tokens, SP shard, PP stage routers, EP global ids) and back.
- ``replay``: ``MegatronReplay`` (RECORD / REPLAY_FORWARD / REPLAY_BACKWARD through
  ``RouterReplay.set_replay_data``, instance and FIFO checks), ``check_no_bypass``.
- ``subject``: the reference subject's Megatron capability (driver + data movement).
- ``model``: tiny GPT MoE configs (local specs, no Transformer Engine).

The per-rank checks run against a subject (live, RECORD → canonical, replay own recording with
bit-exact gradients, foreign targets, two micro-batches) load the subject, so they are suite code:
``suites/megatron_checks.py``.

megatron-core is imported lazily (extra ``megatron``); ``layout`` never needs it. On a machine
without CUDA the test-support patches of ``harness.testing.megatron_cpu`` must be applied first;
library code never applies them.
"""

from harness.trainers.megatron.layout import (
    MegatronLayout,
    batch_routes,
    expected_local_map,
    ids_to_map,
    merge_recordings,
    rank_targets,
)
from harness.trainers.megatron.replay import MegatronReplay, check_no_bypass, model_routers

__all__ = [
    "MegatronLayout",
    "MegatronReplay",
    "batch_routes",
    "check_no_bypass",
    "expected_local_map",
    "ids_to_map",
    "merge_recordings",
    "model_routers",
    "rank_targets",
]
