"""``prefix_agreement``: the prompt rows' digests of each sample, merged per (step, GRPO group)."""

from __future__ import annotations

import numpy as np

from harness.audit.checks.context import BatchContext
from harness.audit.checks.state import GroupDigests


def prefix_agreement(ctx: BatchContext) -> None:
    """Each grouped sample's prompt-row digests, merged into its (step, group) for ``prefix_agreement``."""
    b = ctx.b
    starts = ctx.engine.row_offsets
    for s in np.flatnonzero(ctx.engine.valid).tolist():
        group = b.group_key[s]
        if group is None:
            continue
        lo = int(starts[s])
        rows = int(ctx.prompt_rows[s])
        entry = GroupDigests.single(
            b.sample_key[s], ctx.digests[lo : lo + rows].copy(), b.where(s), b.path, int(b.file_rows[s])
        )
        key = (int(b.step[s]), group)
        if key in ctx.state.groups:
            ctx.state.groups[key].merge(entry)
        else:
            ctx.state.groups[key] = entry
    if not any(g is not None for g in b.group_key):
        ctx.state.note_missing("prefix_agreement", "group_key")
