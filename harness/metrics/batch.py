"""Each gap metric on its own, of one batch: mean/max |Δ|, probability differences and their Pearson
correlation, the KL estimators k1/k2/k3, the extreme-token fraction F(τ), the IcePop mask rate, and
``gap_growth_bound`` (has a per-token gap grown beyond the noise of the pair?).

Every figure is the one ``harness.metrics.accumulator.logprob_gap`` gives for the same batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from harness.metrics.accumulator import logprob_gap
from harness.metrics.inputs import (
    DEFAULT_TAU,
    ICEPOP_HIGH,
    ICEPOP_LOW,
    LogprobsLike,
    MaskLike,
    check_band,
    check_tau,
    select_tokens,
)
from harness.metrics.terms import (
    abs_delta,
    extreme_fraction_of,
    icepop_mask_rate_of,
    k1_terms,
    k2_terms,
    k3_terms,
    max_of,
    mean_of,
    prob_abs_diff,
)


def mean_abs_diff(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """mean |Δ| over masked-in tokens, Δ = log π_train − log π_infer (symmetric in direction).

    SkyRL's ``rollout_train_logprobs_abs_diff_mean``. ``nan`` when no token is selected.
    """
    return mean_of(abs_delta(select_tokens(train_logprobs, infer_logprobs, mask)))


def max_abs_diff(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """max |Δ| over masked-in tokens, Δ = log π_train − log π_infer (symmetric in direction).

    SkyRL's ``rollout_train_logprobs_abs_diff_max``. ``nan`` when no token is selected.
    """
    return max_of(abs_delta(select_tokens(train_logprobs, infer_logprobs, mask)))


def gap_growth_bound(before: LogprobsLike, after: LogprobsLike, *, sigmas: float = 3.0) -> float:
    """The largest mean of ``after`` that has not grown beyond the noise of the pair.

    ``before`` and ``after`` are per-token |Δ log-prob| of the same tokens under two trainer settings
    (no replay, R3). The bound is ``mean(before) + sigmas · SE``, with ``SE`` the standard error of
    the per-token differences ``after − before``: the tolerance comes from the run's own tokens, not
    from a constant that fits one CPU's bf16 kernels. When every token moved by the same amount (or
    none moved), ``SE`` is 0 and the bound is ``mean(before)`` exactly.
    """
    b = np.asarray(before, dtype=np.float64).reshape(-1)
    a = np.asarray(after, dtype=np.float64).reshape(-1)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(
            f"gap_growth_bound: expected two equal non-empty token sets, got {b.size} and {a.size}"
        )
    diff = a - b
    se = float(diff.std(ddof=1) / np.sqrt(diff.size)) if diff.size > 1 else 0.0
    return float(b.mean()) + sigmas * se


class ProbDiffStats(NamedTuple):
    """Mean and max of |exp(lp_train) − exp(lp_infer)| over masked-in tokens."""

    mean_prob_diff: float
    max_prob_diff: float


def prob_diff_stats(
    train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None
) -> ProbDiffStats:
    """(mean, max) of |π_train − π_infer| = |exp(lp_train) − exp(lp_infer)| on sampled tokens.

    verl's ``training/rollout_probs_diff_mean`` / ``_max``; symmetric in direction. Both ``nan``
    when no token is selected.
    """
    d = prob_abs_diff(select_tokens(train_logprobs, infer_logprobs, mask))
    return ProbDiffStats(mean_prob_diff=mean_of(d), max_prob_diff=max_of(d))


def prob_pearson(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """Pearson correlation of π_train = exp(lp_train) and π_infer = exp(lp_infer) over tokens.

    r = Σ(p−p̄)(q−q̄) / sqrt(Σ(p−p̄)² · Σ(q−q̄)²), clipped to [−1, 1]; symmetric (verl's
    ``training/rollout_probs_pearson``-style figure). ``nan`` when undefined: fewer than two
    tokens or either probability vector with zero variance.
    """
    return logprob_gap(train_logprobs, infer_logprobs, mask).prob_pearson


def k1(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """k1 = mean(−Δ) = mean(log π_infer − log π_train) over masked-in tokens.

    Unbiased (may be negative) estimator of KL(π_infer ‖ π_train) under rollout sampling: tokens
    are drawn from the inference policy and the log-ratio is r = log π_train/π_infer = Δ.
    ``nan`` when no token is selected.
    """
    return mean_of(k1_terms(select_tokens(train_logprobs, infer_logprobs, mask)))


def k2(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """k2 = mean(½ Δ²), Δ = log π_train − log π_infer, over masked-in tokens.

    Low-variance, biased, non-negative estimator of KL(π_infer ‖ π_train) under rollout sampling
    (samples from the inference policy, log-ratio log π_train/π_infer). ``nan`` for no tokens.
    """
    return mean_of(k2_terms(select_tokens(train_logprobs, infer_logprobs, mask)))


def k3(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """k3 = mean(e^Δ − 1 − Δ) ≥ 0, Δ = log π_train − log π_infer, over masked-in tokens.

    Unbiased, non-negative estimator of KL(π_infer ‖ π_train) under rollout sampling (samples
    from the inference policy, ratio π_train/π_infer = e^Δ). ``+inf`` if some Δ overflows e^Δ;
    ``nan`` when no token is selected.
    """
    return mean_of(k3_terms(select_tokens(train_logprobs, infer_logprobs, mask)))


def extreme_fraction(
    train_logprobs: LogprobsLike,
    infer_logprobs: LogprobsLike,
    mask: MaskLike = None,
    *,
    tau: float = DEFAULT_TAU,
) -> float:
    """F(τ) = fraction of masked-in tokens with |Δ| > ln τ, i.e. ratio outside [1/τ, τ].

    The R3 paper's "extreme tokens" (arXiv 2510.11370), τ = 2 headline. Symmetric in direction;
    non-increasing in τ; ``tau`` must be ≥ 1. ``nan`` when no token is selected.
    """
    tau = check_tau(tau)
    return extreme_fraction_of(select_tokens(train_logprobs, infer_logprobs, mask), tau)


def icepop_mask_rate(
    train_logprobs: LogprobsLike,
    infer_logprobs: LogprobsLike,
    mask: MaskLike = None,
    *,
    low: float = ICEPOP_LOW,
    high: float = ICEPOP_HIGH,
) -> float:
    """Fraction of masked-in tokens IcePop would mask: ratio π_train/π_infer = e^Δ ∉ [low, high].

    Directional (Δ = log π_train − log π_infer; default band [0.5, 5]). Evaluated in log space
    (Δ < ln low or Δ > ln high), so it never overflows. ``nan`` when no token is selected.
    """
    low, high = check_band(low, high)
    return icepop_mask_rate_of(select_tokens(train_logprobs, infer_logprobs, mask), low, high)
