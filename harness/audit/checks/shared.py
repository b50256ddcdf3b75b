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

from harness.audit.checks.context import BatchContext
from harness.audit.checks.repeats import REPEAT_ALPHA
from harness.audit.state import AuditState, Offender, SharedEvidence, Tally, first_offenders


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
    """Count one batch's evidence for the run-wide detectors into ``ctx.state.shared``."""
    b, evidence = ctx.b, ctx.state.shared
    lo = ctx.engine.row_offsets[:-1]
    cover = np.where(ctx.engine.valid, np.clip(ctx.expected_rows, 0, ctx.engine_rows), 0)
    for s in np.flatnonzero(cover >= 1).tolist():
        routes = np.sort(ctx.engine.routes[lo[s] : lo[s] + cover[s]][:, ctx.moe], axis=-1)
        captured = ctx.captured[lo[s] : lo[s] + cover[s]]
        start = int(b.routes_start[s])
        full = b.tokens.values[b.tokens.offsets[s] : b.tokens.offsets[s + 1]]
        tokens = full[start : start + len(routes) + 1]
        evidence.checked += 1
        _opening(evidence, ctx, s, routes, captured, tokens, start)
        _layers(evidence, ctx, s, routes[captured])


def _opening(
    evidence: SharedEvidence,
    ctx: BatchContext,
    s: int,
    routes: npt.NDArray[np.generic],
    captured: npt.NDArray[np.bool_],
    tokens: npt.NDArray[np.generic],
    start: int,
) -> None:
    """Row 1 against row 0, and how often the sample's later adjacent rows repeat."""
    if len(routes) < 2 or len(tokens) < len(routes) + 1:
        return
    equal = (routes[1:] == routes[:-1]).all(axis=(1, 2))
    usable = captured[1:] & captured[:-1] & (tokens[1 : len(routes)] != tokens[: len(routes) - 1])
    evidence.adjacent[0] += int(usable[1:].sum())
    evidence.adjacent[1] += int((equal & usable)[1:].sum())
    if usable[0]:
        b = ctx.b
        full = b.tokens.values[b.tokens.offsets[s] : b.tokens.offsets[s + 1]]
        offender = None
        if equal[0]:
            offender = Offender(int(b.step[s]), b.sample_key[s], 1, -1, "", "", b.place(s, 1))
        evidence.opening(_digest(full[: start + 2]), bool(equal[0]), offender)


def _layers(evidence: SharedEvidence, ctx: BatchContext, s: int, routes: npt.NDArray[np.generic]) -> None:
    """Each adjacent MoE layer pair of the sample's captured rows: copied everywhere, and by chance."""
    if len(routes) == 0 or routes.shape[1] < 2:
        return
    distinct = 1 + int((routes[1:] != routes[:-1]).any(axis=(1, 2)).sum())
    same = (routes[:, 1:] == routes[:, :-1]).all(axis=2).all(axis=0)
    shifted = (routes[1:, 1:] == routes[:-1, :-1]).all(axis=2).sum(axis=0)
    b = ctx.b
    for i in range(1, routes.shape[1]):
        hist = evidence.layer_rows.setdefault(i, {})
        hist[distinct] = hist.get(distinct, 0) + 1
        pairs = evidence.misaligned.setdefault(i, [0, 0])
        pairs[0] += len(routes) - 1
        pairs[1] += int(shifted[i - 1])
        if same[i - 1]:
            evidence.layer_copied[i] = evidence.layer_copied.get(i, 0) + 1
            layer = int(b.moe_layers[i])
            found = Offender(int(b.step[s]), b.sample_key[s], 0, layer, "", "", b.place(s, 0))
            evidence.layer_offenders[i] = first_offenders([*evidence.layer_offenders.get(i, []), found])


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
    pairs = len(evidence.layer_rows)
    offenders: list[Offender] = []
    for i, hist in sorted(evidence.layer_rows.items()):
        found = evidence.layer_copied.get(i, 0)
        total, equal = evidence.misaligned.get(i, [0, 0])
        chance = (equal + 1) / (total + 1)
        expected = sum(count * chance**rows for rows, count in hist.items())
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
