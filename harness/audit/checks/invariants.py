"""The names of the audit's invariants, in report order, and the columns each reads (DESIGN §7)."""

from __future__ import annotations

STRICT = (
    "unique_sample",
    "coverage",
    "ids_valid",
    "dense_empty",
    "moe_layer_nonzero",
    "wrapped_ids",
    "repeated_rows",
    "copied_layers",
    "tokens_match",
    "logprobs_valid",
    "replay_fidelity",
    "splice_consistency",
    "shard_union",
)
"""Every strict invariant and detector, in report order. ``wrapped_ids``, ``repeated_rows`` and
``copied_layers`` are the ``DETECTORS``."""

DETECTORS = ("wrapped_ids", "repeated_rows", "copied_layers")
"""Detectors of what a dump alone shows (``harness.audit.result.findings``; ``harness.audit.checks.repeats``;
``harness.audit.checks.shared``, faults every sample shares, judged across the run): each
names a fault only under conditions that make it implausible on a correct dump, but what it names is a
**suspicion** (kind ``suspicion``, status ``suspect``, printed ``SUSPECT``), never a broken invariant: it
does not make ``rrh audit`` exit 1, nor stop ``--strict``, nor count among a sample's violations."""

METRICS = ("fallback", "agreement", "logprob_gap", "prefix_agreement", "expert_load")

NEEDS: dict[str, tuple[str, ...]] = {
    "coverage": ("engine_routes",),
    "ids_valid": ("engine_routes",),
    "dense_empty": ("engine_routes",),
    "moe_layer_nonzero": ("engine_routes",),
    "wrapped_ids": ("group_key",),
    "repeated_rows": ("engine_routes",),
    "copied_layers": ("engine_routes",),
    "tokens_match": ("trainer_tokens",),
    "logprobs_valid": ("engine_logprobs",),
    "replay_fidelity": ("trainer_routes", "replay"),
    "splice_consistency": ("attempt payloads",),
    "shard_union": ("shard positions",),
    "agreement": ("engine_routes", "trainer_routes"),
    "logprob_gap": ("engine_logprobs", "trainer_logprobs"),
    "prefix_agreement": ("engine_routes", "group_key"),
    "fallback": ("engine_routes",),
    "expert_load": ("engine_routes",),
}
"""The columns each invariant reads: when no sample of a run has them, it is not checkable."""
