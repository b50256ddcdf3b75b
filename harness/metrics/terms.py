"""The per-token terms of every gap metric and their reductions, on the masked-in tokens.

Each formula is written exactly once, here: the metrics of one batch (``harness.metrics.batch``) and
the accumulator (``harness.metrics.accumulator``) both evaluate these kernels.
"""

from __future__ import annotations

import math

import numpy as np

from harness.metrics.inputs import FloatArray, Tokens


def mean_of(x: FloatArray) -> float:
    """Mean, ``nan`` for no tokens (no warning)."""
    if x.size == 0:
        return math.nan
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.mean(x))


def max_of(x: FloatArray) -> float:
    """Maximum, ``nan`` for no tokens."""
    return math.nan if x.size == 0 else float(np.max(x))


def abs_delta(tok: Tokens) -> FloatArray:
    """|Δ| per token."""
    return np.abs(tok.delta)


def prob_abs_diff(tok: Tokens) -> FloatArray:
    """|π_train − π_infer| per token."""
    # |exp(lp_t) − exp(lp_i)|; exp of a log-prob ≤ 1e-6 cannot overflow, underflow to 0 is silent.
    diff: FloatArray = np.abs(np.exp(tok.train) - np.exp(tok.infer))
    return diff


def k1_terms(tok: Tokens) -> FloatArray:
    """−Δ per token (k1's terms)."""
    return -tok.delta


def k2_terms(tok: Tokens) -> FloatArray:
    """½Δ² per token (k2's terms)."""
    return 0.5 * np.square(tok.delta)


def k3_terms(tok: Tokens) -> FloatArray:
    """e^Δ − 1 − Δ per token (k3's terms)."""
    # e^Δ − 1 − Δ (≥ 0 exactly; the clamp only removes rounding below 0); +inf for Δ ≳ 709.
    with np.errstate(over="ignore", invalid="ignore"):
        return np.maximum(np.expm1(tok.delta) - tok.delta, 0.0)


def extreme_fraction_of(tok: Tokens, tau: float) -> float:
    """Fraction of the tokens with |Δ| > ln ``tau``."""
    return mean_of((np.abs(tok.delta) > math.log(tau)).astype(np.float64))


def icepop_mask_rate_of(tok: Tokens, low: float, high: float) -> float:
    """Fraction of the tokens with e^Δ outside ``[low, high]``."""
    # e^Δ ∉ [low, high]  ⇔  Δ < ln low  or  Δ > ln high  (compared in log space: no overflow).
    outside = (tok.delta < math.log(low)) | (tok.delta > math.log(high))
    return mean_of(outside.astype(np.float64))
