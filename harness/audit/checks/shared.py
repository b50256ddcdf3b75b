"""Faults every sample shares, named from the whole run with a chance model (``repeated_rows``'s
one-row shift, ``copied_layers``).

A per-sample check cannot see a fault that a whole batch carries the same way: one repeated row, or
two layers with the same routes, happen by chance in one sample. Across samples they do not: the
evidence is counted over the run (``state.SharedEvidence``) and judged once, at the end, against how
often the run's own rows coincide by chance. Two shapes (FACTS §4):

- **the one-row shift**: row 1 equal to row 0 in every MoE layer (their tokens differ), the first
  row duplicated and the last dropped, so every row holds the route of the token before. Chance is
  the run's rate of equal adjacent rows further on; samples that open with the same tokens share
  their first rows by construction, so they count once (an opening).
- **the copied layer**: a MoE layer whose route equals the previous MoE layer's at every captured
  row of a sample. Chance is the rate at which the two layers coincide one row apart, raised to
  the sample's count of distinct rows (rows that repeat add no evidence).

Either is named (a suspicion, as every detector) only when at least two independent pieces of
evidence show it and the Chernoff bound on so many by chance, ``exp(−μ)·(eμ/x)^x`` for ``x`` found
where ``μ`` are expected, is at most ``REPEAT_ALPHA`` (per layer pair, divided by their number). A
correct run never has so many: its rows coincide at the rate the bound assumes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import numpy as np
import numpy.typing as npt

from harness.audit.checks import shared_kernels
from harness.audit.checks.context import BatchContext
from harness.audit.checks.repeats import REPEAT_ALPHA
from harness.audit.checks.state import AuditState, Offender, SharedEvidence, Tally, first_offenders


def tail_bound(expected: float, found: int) -> float:
    """Chernoff's bound on P(X ≥ ``found``) for a sum X of independent indicators of mean ``expected``."""
    if found <= expected:
        return 1.0
    if expected <= 0:
        return 0.0
    return math.exp(-expected + found * (1 + math.log(expected) - math.log(found)))


def _digest(tokens: npt.NDArray[np.generic]) -> int:
    """A digest of a token prefix that every process computes alike (Python's ``hash`` does not)."""
    data = np.ascontiguousarray(tokens, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def shared(ctx: BatchContext) -> None:
    """Count one batch's evidence for the run-wide detectors into ``ctx.state.shared``: one compiled
    pass over the rows (``shared_kernels.shared_evidence``), then a Python step only per opening and per
    copied sample."""
    b, evidence = ctx.b, ctx.state.shared
    cover = np.where(ctx.engine.valid, np.clip(ctx.expected_rows, 0, ctx.engine_rows), 0)
    owner = ctx.row_owner
    local = np.arange(owner.size) - ctx.engine.row_offsets[:-1][owner]
    kept = (local < cover[owner]) & ctx.captured
    evidence.checked += int((cover >= 1).sum())
    if not kept.any() or ctx.moe.size == 0:
        return
    repeats_prior, rows, distinct, unequal, coincide, pairs = shared_kernels.shared_evidence(
        ctx.engine.routes, ctx.moe, owner, kept, b.size
    )
    _openings(evidence, ctx, repeats_prior[1:], owner, local, kept)
    _layers(evidence, ctx, rows, distinct, unequal, coincide, pairs)


def _openings(
    evidence: SharedEvidence,
    ctx: BatchContext,
    equal_next: npt.NDArray[np.bool_],
    owner: npt.NDArray[np.int64],
    local: npt.NDArray[np.int64],
    kept: npt.NDArray[np.bool_],
) -> None:
    """Row 1 against row 0 of each sample, and how often later adjacent rows repeat (pairs of
    captured rows of one sample whose tokens differ; ``equal_next[r]``: row r + 1 equals row r)."""
    b = ctx.b
    offsets, values = b.tokens.offsets, b.tokens.values
    if values.size == 0:
        return  # no tokens in the batch: no pair can be told apart from a repeated text
    position = b.routes_start[owner] + local
    has_tokens = position + 1 < np.diff(offsets)[owner]
    here = values[np.where(has_tokens, offsets[:-1][owner] + position, 0)]
    after = values[np.where(has_tokens, offsets[:-1][owner] + position + 1, 0)]
    usable = (owner[1:] == owner[:-1]) & kept[1:] & kept[:-1] & has_tokens[:-1] & (here[:-1] != after[:-1])
    equal = usable & equal_next
    later = local[:-1] >= 1
    evidence.adjacent[0] += int((usable & later).sum())
    evidence.adjacent[1] += int((equal & later).sum())
    for r in np.flatnonzero(usable & ~later).tolist():
        s = int(owner[r])
        tokens = values[offsets[s] : offsets[s] + int(b.routes_start[s]) + 2]
        offender = None
        if equal[r]:
            offender = Offender(int(b.step[s]), b.sample_key[s], 1, -1, "", "", b.place(s, 1))
        evidence.opening(_digest(tokens), bool(equal[r]), offender)


def _layers(
    evidence: SharedEvidence,
    ctx: BatchContext,
    rows: npt.NDArray[np.int64],
    distinct: npt.NDArray[np.int64],
    unequal: npt.NDArray[np.int64],
    coincide: npt.NDArray[np.int64],
    pairs: int,
) -> None:
    """Each adjacent MoE layer pair: the samples whose kept rows all have it equal, and how often it
    coincides one row apart (``shared_kernels.shared_evidence``'s counts)."""
    if unequal.shape[1] == 0:
        return
    for count, samples in zip(*np.unique(distinct[rows > 0], return_counts=True), strict=True):
        evidence.layer_rows[int(count)] = evidence.layer_rows.get(int(count), 0) + int(samples)
    b = ctx.b
    for i in range(1, unequal.shape[1] + 1):
        held = evidence.misaligned.setdefault(i, [0, 0])
        held[0] += pairs
        held[1] += int(coincide[i - 1])
        copied = np.flatnonzero((rows > 0) & (unequal[:, i - 1] == 0))
        if copied.size == 0:
            continue
        evidence.layer_copied[i] = evidence.layer_copied.get(i, 0) + int(copied.size)
        layer = int(b.moe_layers[i])
        found = [
            Offender(int(b.step[s]), b.sample_key[s], 0, layer, "", "", b.place(int(s), 0)) for s in copied
        ]
        evidence.layer_offenders[i] = first_offenders([*evidence.layer_offenders.get(i, []), *found])


def shifted_openings(state: AuditState) -> Tally | None:
    """The one-row shift's samples as ``repeated_rows`` names them, or None when chance explains them."""
    evidence = state.shared
    repeated = [d for d, (repeats, _) in evidence.openings.items() if repeats]
    found, openings = len(repeated), len(evidence.openings)
    pairs, equal = evidence.adjacent
    chance = (equal + 1) / (pairs + 1)
    bound = tail_bound(openings * chance, found)
    if found < 2 or bound > REPEAT_ALPHA:
        return None
    samples = sum(evidence.openings[d][1] for d in repeated)
    actual = (
        f"row 1 repeats row 0 in every MoE layer, as in {found} of {openings} prompt openings of the run "
        f"(by chance at most {bound:.1e}: adjacent rows repeat at {chance:.1e}): the first row duplicated, "
        "every later row the route of the token before (a one-row shift)"
    )
    offenders = [
        replace(o, expected="row 1 routed anew (its token differs from row 0's)", actual=actual)
        for d in repeated
        for o in evidence.opening_offenders.get(d, [])
    ]
    return Tally(0, samples, first_offenders(offenders))


def copied_layers(state: AuditState) -> Tally:
    """``copied_layers``: the samples whose MoE layer equals the previous one at every captured row, in
    more samples than chance allows (per layer pair)."""
    evidence = state.shared
    tally = Tally(checked=evidence.checked)
    pairs = len(evidence.misaligned)
    offenders: list[Offender] = []
    for i in sorted(evidence.misaligned):
        found = evidence.layer_copied.get(i, 0)
        total, equal = evidence.misaligned.get(i, [0, 0])
        chance = (equal + 1) / (total + 1)
        expected = sum(count * chance**rows for rows, count in evidence.layer_rows.items())
        bound = tail_bound(expected, found)
        if found < 2 or bound > REPEAT_ALPHA / max(pairs, 1):
            continue
        tally.violated = max(tally.violated, found)  # samples (one may copy several layers)
        for o in evidence.layer_offenders.get(i, []):
            before = int(state.moe_layers[i - 1]) if i - 1 < len(state.moe_layers) else i - 1
            offenders.append(
                replace(
                    o,
                    expected=f"MoE layer {o.layer} routed on its own",
                    actual=(
                        f"every captured row of layer {o.layer} equals layer {before}'s, as in {found} "
                        f"samples of the run (by chance at most {bound:.1e}): the layer copied from the one "
                        "before"
                    ),
                )
            )
    tally.offenders = first_offenders(offenders)
    return tally
