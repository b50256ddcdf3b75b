"""The gap metrics as a mergeable accumulator, and ``logprob_gap``: every metric of a batch at once.

``ExactSum`` keeps sums exactly, so merging the same batches in any order gives the same figures to
the last bit; ``GapAccumulator`` folds tokens into such sums, counts and maxima, and its result is a
``LogprobGap``. The lab, the gate and the audit all compute the gap through this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from harness.errors import MetricError
from harness.metrics.inputs import (
    DEFAULT_TAU,
    ICEPOP_HIGH,
    ICEPOP_LOW,
    FloatArray,
    LogprobsLike,
    MaskLike,
    Tokens,
    check_tau,
    select_tokens,
)
from harness.metrics.terms import abs_delta, k1_terms, k2_terms, k3_terms, prob_abs_diff


@dataclass(frozen=True)
class LogprobGap:
    """Every §5 gap metric of one batch, Δ = log π_train − log π_infer on masked-in tokens.

    With ``n_tokens == 0`` every other field is ``nan``.
    """

    n_tokens: int
    #: mean |Δ| (SkyRL ``rollout_train_logprobs_abs_diff_mean``)
    mean_abs_diff: float
    #: max |Δ| (SkyRL ``rollout_train_logprobs_abs_diff_max``)
    max_abs_diff: float
    #: mean |exp(lp_t) − exp(lp_i)| (verl ``training/rollout_probs_diff_mean``)
    mean_prob_diff: float
    #: max |exp(lp_t) − exp(lp_i)| (verl ``training/rollout_probs_diff_max``)
    max_prob_diff: float
    #: Pearson correlation of the two probabilities (``nan`` if undefined)
    prob_pearson: float
    #: mean(−Δ), KL(π_infer ‖ π_train) estimator
    k1: float
    #: mean(½Δ²), KL(π_infer ‖ π_train) estimator
    k2: float
    #: mean(e^Δ − 1 − Δ) ≥ 0, KL(π_infer ‖ π_train) estimator
    k3: float
    #: F(τ): fraction with |Δ| > ln τ
    extreme_fraction: float
    #: fraction with e^Δ ∉ [0.5, 5]
    icepop_mask_rate: float

    def as_dict(self) -> dict[str, float | int]:
        """Field name → value, for logging."""
        return asdict(self)


class ExactSum:
    """A sum of floats kept exactly (Shewchuk's non-overlapping partials, as ``math.fsum``).

    Adding the same numbers in any order, or merging two sums in any order, gives the same
    value to the last bit: what makes the audit's figures identical for any split of a run.
    Infinities and NaN are summed apart (they have no exact partials).
    """

    __slots__ = ("partials", "special")

    def __init__(self) -> None:
        self.partials: list[float] = []
        self.special = 0.0

    def add(self, x: float) -> None:
        if not math.isfinite(x):
            self.special += x
            return
        partials, i = self.partials, 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]

    def merge(self, other: ExactSum) -> None:
        for x in other.partials:
            self.add(x)
        self.special += other.special

    @property
    def value(self) -> float:
        return math.fsum(self.partials) + self.special

    def __reduce__(self) -> tuple[Any, ...]:
        return (_exact_sum, (list(self.partials), self.special))


def _exact_sum(partials: list[float], special: float) -> ExactSum:
    out = ExactSum()
    out.partials, out.special = partials, special
    return out


_GAP_SUMS = ("abs_diff", "prob_diff", "k1", "k2", "k3")


@numba.njit(cache=True, nogil=True)
def _exact_partials(values, out):  # type: ignore[no-untyped-def]
    """Shewchuk's partials of the exact sum of the finite ``values`` (``ExactSum.add`` over each in
    turn) into ``out``; returns how many. Non-overlapping partials of doubles number fewer than 40
    (the exponent range over 53 bits), so ``out`` of 64 always holds them."""
    n = 0
    for v in values:
        x = v
        if not np.isfinite(x):
            continue
        i = 0
        for j in range(n):
            y = out[j]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo != 0.0:
                out[i] = lo
                i += 1
            x = hi
        out[i] = x
        n = i + 1
    return n


class GapTerms:
    """The per-token terms of every gap metric, computed once for tokens that several accumulators
    fold in part (the audit splits a batch's tokens by step and by whether their routes agreed)."""

    def __init__(self, train: FloatArray, infer: FloatArray) -> None:
        self.delta = train - infer
        tok = Tokens(train=train, infer=infer, delta=self.delta)
        with np.errstate(over="ignore", invalid="ignore"):
            self.terms = {
                "abs_diff": abs_delta(tok),
                "prob_diff": prob_abs_diff(tok),
                "k1": k1_terms(tok),
                "k2": k2_terms(tok),
                "k3": k3_terms(tok),
            }
        self.p, self.q = np.exp(train), np.exp(infer)


class GapAccumulator:
    """The §5 gap metrics as a mergeable accumulator: exact sums, counts and maxima.

    ``add`` folds in the masked-in tokens of a batch, ``add_segments`` those of many samples at
    once, ``merge`` another accumulator (of the same ``tau``). Each batch's (or segment's) sums
    are added exactly (``ExactSum``), so merging the same batches in any order gives the same
    figures to the last bit. The lab, the gate and the audit all compute the gap through this
    class: one figure, one code path. The Pearson correlation is built from the exact power sums.
    """

    def __init__(self, tau: float = DEFAULT_TAU) -> None:
        self.tau = check_tau(tau)
        self.n_tokens = 0
        self.sums = {name: ExactSum() for name in _GAP_SUMS}
        self.max_abs_diff = -math.inf
        self.max_prob_diff = -math.inf
        self.n_extreme = 0
        self.n_icepop = 0
        self.moments: list[tuple[int, float, float, float, float, float]] = []

    def add(self, train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> None:
        """Fold in the masked-in tokens of one batch (validated as by :func:`logprob_gap`)."""
        tok = select_tokens(train_logprobs, infer_logprobs, mask)
        self._fold(tok, np.zeros(1, dtype=np.int64))

    def add_segments(
        self, tok_train: FloatArray, tok_infer: FloatArray, starts: npt.NDArray[np.int64]
    ) -> None:
        """Fold in already-selected tokens, summed per segment (``starts``: each segment's first index).

        For callers that validated the tokens themselves (the audit: one segment per sample, so a
        sample's sums do not depend on which batch it was read in).
        """
        self.add_terms(GapTerms(tok_train, tok_infer), slice(None), starts)

    def _fold(self, tok: Tokens, starts: npt.NDArray[np.int64]) -> None:
        self.add_terms(GapTerms(tok.train, tok.infer), slice(None), starts)

    def add_terms(self, tokens: GapTerms, which: Any, starts: npt.NDArray[np.int64]) -> None:
        """Fold in the tokens ``which`` (an index array or a slice) of ``tokens``, one segment from each
        of ``starts`` (indices into the selection).

        Each segment's sums are added exactly: the partials of their exact total, found by a compiled
        loop (``_exact_partials``), go into the ``ExactSum``s, so no Python step runs per segment and
        the figures do not depend on how the tokens were split into calls. Each segment's centred
        co-moments (for Pearson's r) are kept as they are.
        """
        delta = tokens.delta[which]
        n = int(delta.size)
        if n == 0:
            return
        terms = {name: values[which] for name, values in tokens.terms.items()}
        bounds = np.append(starts, n)
        keep = bounds[:-1][np.diff(bounds) > 0]
        scratch = np.empty(64, dtype=np.float64)
        for name, values in terms.items():
            sums = np.add.reduceat(values, keep)
            total = self.sums[name]
            for x in scratch[: _exact_partials(sums, scratch)].tolist():
                total.add(x)
            for x in sums[~np.isfinite(sums)].tolist():
                total.add(x)
        counts = np.diff(np.append(keep, n))
        p, q = tokens.p[which], tokens.q[which]
        mean_p, mean_q = np.add.reduceat(p, keep) / counts, np.add.reduceat(q, keep) / counts
        pc, qc = p - np.repeat(mean_p, counts), q - np.repeat(mean_q, counts)
        self.moments.extend(
            zip(
                counts.tolist(), mean_p.tolist(), mean_q.tolist(), np.add.reduceat(pc * pc, keep).tolist(),
                np.add.reduceat(qc * qc, keep).tolist(), np.add.reduceat(pc * qc, keep).tolist(), strict=True,
            )
        )  # fmt: skip
        abs_delta, prob_diff = terms["abs_diff"], terms["prob_diff"]
        self.n_tokens += n
        self.max_abs_diff = max(self.max_abs_diff, float(abs_delta.max()))
        self.max_prob_diff = max(self.max_prob_diff, float(prob_diff.max()))
        self.n_extreme += int(np.count_nonzero(abs_delta > math.log(self.tau)))
        outside = (delta < math.log(ICEPOP_LOW)) | (delta > math.log(ICEPOP_HIGH))
        self.n_icepop += int(np.count_nonzero(outside))

    def merge(self, other: GapAccumulator) -> None:
        """Fold ``other`` (same ``tau``) into this accumulator."""
        if other.tau != self.tau:
            raise MetricError(f"tau: accumulators differ ({self.tau} vs {other.tau}); expected equal")
        self.n_tokens += other.n_tokens
        for name in _GAP_SUMS:
            self.sums[name].merge(other.sums[name])
        self.max_abs_diff = max(self.max_abs_diff, other.max_abs_diff)
        self.max_prob_diff = max(self.max_prob_diff, other.max_prob_diff)
        self.n_extreme += other.n_extreme
        self.n_icepop += other.n_icepop
        self.moments.extend(other.moments)

    def result(self) -> LogprobGap:
        """The figures of every token folded in so far (every field ``nan`` with no token)."""
        n = self.n_tokens
        if n == 0:
            return LogprobGap(0, *([math.nan] * 10))
        s = {name: total.value for name, total in self.sums.items()}
        return LogprobGap(
            n_tokens=n,
            mean_abs_diff=s["abs_diff"] / n,
            max_abs_diff=self.max_abs_diff,
            mean_prob_diff=s["prob_diff"] / n,
            max_prob_diff=self.max_prob_diff,
            prob_pearson=self._pearson(),
            k1=s["k1"] / n,
            k2=s["k2"] / n,
            k3=s["k3"] / n,
            extreme_fraction=self.n_extreme / n,
            icepop_mask_rate=self.n_icepop / n,
        )

    def _pearson(self) -> float:
        """Pearson's r of the two probabilities: the segments' co-moments combined in sorted order."""
        if self.n_tokens < 2:
            return math.nan
        n, mean_p, mean_q, m2_p, m2_q, c_pq = 0, 0.0, 0.0, 0.0, 0.0, 0.0
        for nb, mp, mq, m2p, m2q, cpq in sorted(self.moments):
            total = n + nb
            dp, dq = mp - mean_p, mq - mean_q
            m2_p += m2p + dp * dp * n * nb / total
            m2_q += m2q + dq * dq * n * nb / total
            c_pq += cpq + dp * dq * n * nb / total
            mean_p += dp * nb / total
            mean_q += dq * nb / total
            n = total
        denom = math.sqrt(m2_p * m2_q)
        return max(-1.0, min(1.0, c_pq / denom)) if denom > 0.0 else math.nan


def logprob_gap(
    train_logprobs: LogprobsLike,
    infer_logprobs: LogprobsLike,
    mask: MaskLike = None,
    *,
    tau: float = DEFAULT_TAU,
) -> LogprobGap:
    """All gap metrics at once, Δ = log π_train − log π_infer on masked-in (response) tokens.

    Validates the inputs once and evaluates the same kernels (``harness.metrics.terms``) as
    ``harness.metrics.batch``'s ``mean_abs_diff``, ``max_abs_diff``, ``prob_diff_stats``,
    ``prob_pearson``, ``k1``, ``k2``, ``k3`` (KL(π_infer ‖ π_train) estimators under rollout
    sampling), ``extreme_fraction`` (``tau``) and ``icepop_mask_rate`` (band [0.5, 5]), through
    :class:`GapAccumulator`. Empty selection: ``n_tokens == 0`` and every other field ``nan``.
    """
    acc = GapAccumulator(tau=tau)
    acc.add(train_logprobs, infer_logprobs, mask)
    return acc.result()
