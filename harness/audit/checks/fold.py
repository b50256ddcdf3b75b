"""The driver of the audit's checks: ``fold_batch`` runs each family of invariants on one decoded
batch, in the order their shared figures need, and ``fold_shards`` folds a batch of shard rows;
``AuditOptions`` says which rows an audit reads (``sample_hash``: the same ones every time).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.audit.checks import coverage, ids, load, logprobs, prefix, repeats, replay, shared, tokens
from harness.audit.checks.context import BatchContext
from harness.audit.checks.state import AuditState, SampleFigure
from harness.audit.layout.batch import Batch


@dataclass(frozen=True)
class AuditOptions:
    """What to audit: a step filter and a hash-selected fraction of samples (sampling for huge runs)."""

    steps: frozenset[int] | None = None
    every: int = 1
    samples: float = 1.0


def sample_hash(step: int, key: str) -> float:
    """A number in [0, 1) fixed by (step, sample key): two audits of one run sample the same rows."""
    import hashlib

    digest = hashlib.blake2b(f"{step}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def fold_batch(batch: Batch, state: AuditState) -> None:
    """Check one decoded batch and fold its figures into ``state``."""
    state.rows_read += batch.size
    state.sources.update(batch.source)
    if batch.size and not state.moe_layers:
        state.moe_layers = batch.moe_layers
    if batch.size:
        state.num_experts = state.num_experts or batch.num_experts
    for s in range(batch.size):
        state.see(int(batch.step[s]), batch.sample_key[s], batch.where(s))
    ctx = BatchContext(batch, state)
    coverage.coverage(ctx)
    ids.ids(ctx)
    repeats.repeated_rows(ctx)
    shared.shared(ctx)  # run-wide evidence: judged once, at the end (AuditResult.of)
    tokens.tokens_match(ctx)
    logprobs.logprobs_valid(ctx)  # the flat response tokens and log-probs logprob_gap reads
    replay.replay(ctx)  # row_differs and each sample's disagreement
    coverage.splice_consistency(ctx)
    logprobs.logprob_gap(ctx)
    load.fallback_and_load(ctx)  # the prompt rows' digests
    prefix.prefix_agreement(ctx)
    _sample_figures(ctx)


def _sample_figures(ctx: BatchContext) -> None:
    """Each sample's figures (rows, gap, disagreement, violations), for the worst-samples tables."""
    b = ctx.b
    for s in range(b.size):
        step = int(b.step[s])
        ctx.state.step(step).samples += 1
        ctx.state.samples.append(
            SampleFigure(
                step, b.sample_key[s], b.group_key[s] or "", int(ctx.engine_rows[s]),
                int(b.response_len[s]), float(ctx.sample_gap[s]), float(ctx.sample_disagreement[s]),
                int(ctx.uncaptured[s]), int(ctx.violations[s]), b.where(s),
            )
        )  # fmt: skip


def fold_shards(batch: Batch, state: AuditState) -> None:
    """Fold a batch of shard rows (layout v2: a CP/SP rank's part of a sample) into ``state``'s
    shard covers (``coverage.shard_union``)."""
    state.rows_read += batch.size
    state.sources.update(batch.source)
    coverage.shard_union(batch, state)
