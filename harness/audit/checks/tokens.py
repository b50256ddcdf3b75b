"""``tokens_match``: the tokens the trainer consumed equal the engine's, sample by sample."""

from __future__ import annotations

import numpy as np

from harness.audit.checks.context import BatchContext, Offenders, offsets, owned


def tokens_match(ctx: BatchContext) -> None:
    """``tokens_match``: each sample's first token where the trainer's tokens differ from the engine's."""
    b = ctx.b
    found = Offenders(b, ctx.order)
    trainer = b.trainer_tokens
    checked = int(trainer.valid.sum())
    if not checked:
        ctx.state.note_missing("tokens_match", "trainer_tokens")
    else:
        # Both lists have prompt_len + response_len entries (checked on decoding): compare them
        # flat, the engine's entries of the samples whose trainer list is not null.
        kept = np.flatnonzero(trainer.valid)
        mine = b.tokens.values[owned(b.tokens, trainer.valid)]
        theirs = trainer.values[owned(trainer, trainer.valid)]
        differ = np.flatnonzero(mine != theirs)
        if differ.size:
            starts = offsets(b.tokens.lengths()[kept])
            owner = np.searchsorted(starts, differ, side="right") - 1
            first = np.flatnonzero(np.diff(owner, prepend=-1))  # each sample's first difference
            for i, j in zip(differ[first].tolist(), owner[first].tolist(), strict=True):
                found.one(
                    int(kept[j]), f"engine token {int(mine[i])}",
                    f"trainer token {int(theirs[i])} at position {i - int(starts[j])}",
                )  # fmt: skip
    ctx.finish("tokens_match", found, checked)
