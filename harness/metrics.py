"""Train–inference log-prob gap metrics (FACTS §5), with one sign convention.

Every metric here is a function of the per-token log-ratio on the *sampled* tokens::

    Δ = log π_train(y_t) − log π_infer(y_t)

restricted to the masked-in (response) tokens. ``train_logprobs`` are the trainer's recomputed
log-probs, ``infer_logprobs`` the inference engine's rollout log-probs. Positive Δ means the trainer
gives the sampled token more probability than the engine that sampled it.

Inputs may be numpy arrays, torch tensors (detached, moved to CPU) or array-likes of floats; all
arithmetic is float64 numpy and every result is a plain Python ``float`` (``int`` for counts).

Empty selection (the mask selects no token): ``n_tokens == 0`` and every mean, maximum and fraction
is ``nan``; no exception and no numpy warning. The Pearson correlation is ``nan`` whenever it is
undefined (fewer than two tokens, or either probability vector has zero variance).

Malformed input raises :class:`harness.errors.MetricError` naming the argument and the expected
value: shape mismatch, non-floating log-probs, a mask that is not bool or 0/1, NaN/inf in masked-in
entries, or masked-in log-probs above ``LOGPROB_TOLERANCE`` (not a log-probability). Masked-out
entries are never inspected, so padding may hold anything.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, TypeAlias

import numba
import numpy as np
import numpy.typing as npt

from harness.errors import MetricError

__all__ = [
    "LOGPROB_TOLERANCE",
    "ExactSum",
    "GapAccumulator",
    "GapTerms",
    "LogprobGap",
    "ProbDiffStats",
    "extreme_fraction",
    "gap_growth_bound",
    "icepop_mask_rate",
    "k1",
    "k2",
    "k3",
    "logprob_gap",
    "max_abs_diff",
    "mean_abs_diff",
    "prob_diff_stats",
    "prob_pearson",
]

FloatArray: TypeAlias = npt.NDArray[np.float64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]
#: numpy array, torch tensor (any device, any floating dtype) or nested sequence of floats.
LogprobsLike: TypeAlias = Any
#: bool or 0/1 array-like / torch tensor of the log-probs' shape; ``None`` selects every token.
MaskLike: TypeAlias = Any

#: A masked-in log-prob above this is rejected: it is not a log-probability.
LOGPROB_TOLERANCE = 1e-6

#: Headline threshold of the R3 paper's "extreme tokens" (arXiv 2510.11370): |Δ| > ln 2.
DEFAULT_TAU = 2.0
#: IcePop keeps tokens whose ratio π_train/π_infer lies in [0.5, 5].
ICEPOP_LOW = 0.5
ICEPOP_HIGH = 5.0


# --------------------------------------------------------------------------------------------
# input coercion and validation
# --------------------------------------------------------------------------------------------


def _torch_tensor_type() -> Any:
    """``torch.Tensor`` if torch is already imported, else ``None`` (the core never imports torch)."""
    torch = sys.modules.get("torch")
    return None if torch is None else getattr(torch, "Tensor", None)


def _to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """Array view of ``x`` (torch tensors detached and moved to CPU) and its dtype's name."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(x, tensor_type):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bool:
            return t.numpy(), str(t.dtype)
        if t.is_floating_point():
            return t.to(torch.float64).numpy(), str(t.dtype)
        if t.is_complex():
            return t.resolve_conj().numpy(), str(t.dtype)
        return t.to(torch.int64).numpy(), str(t.dtype)
    arr = np.asarray(x)
    return arr, str(arr.dtype)


def _as_float64(name: str, x: LogprobsLike) -> FloatArray:
    """``x`` as a float64 numpy array; raises MetricError unless it holds floating-point values."""
    arr, dtype_name = _to_numpy(x)
    if arr.dtype.kind != "f":
        raise MetricError(
            f"{name} has dtype {dtype_name}, expected a floating-point dtype (log-probabilities)"
        )
    return arr.astype(np.float64, copy=False)


def _as_mask(mask: MaskLike, shape: tuple[int, ...]) -> BoolArray:
    """``mask`` as a bool array of ``shape``; ``None`` selects everything."""
    if mask is None:
        return np.ones(shape, dtype=np.bool_)
    arr, dtype_name = _to_numpy(mask)
    if arr.shape != shape:
        raise MetricError(f"mask has shape {arr.shape}, expected {shape} like train_logprobs")
    if arr.dtype.kind == "b":
        return arr.astype(np.bool_, copy=False)
    if arr.dtype.kind not in "iuf":
        raise MetricError(f"mask has dtype {dtype_name}, expected bool or 0/1 values")
    is_one: BoolArray = arr == 1
    not_01 = ~(is_one | (arr == 0))
    if not_01.any():
        idx = tuple(int(i) for i in np.argwhere(not_01)[0])
        raise MetricError(f"mask has value {arr[idx].item()!r} at index {idx}, expected bool or 0/1 values")
    return is_one


def _check_values(name: str, values: FloatArray, where: BoolArray) -> None:
    """Masked-in entries must be finite and ≤ LOGPROB_TOLERANCE."""
    bad = where & ~np.isfinite(values)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise MetricError(
            f"{name} has non-finite value {float(values[idx])} at masked-in index {idx} "
            f"({int(bad.sum())} such entries), expected finite log-probabilities"
        )
    bad = where & (values > LOGPROB_TOLERANCE)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise MetricError(
            f"{name} has positive value {float(values[idx])!r} at masked-in index {idx} "
            f"({int(bad.sum())} such entries), expected log-probabilities <= 0 "
            f"(tolerance {LOGPROB_TOLERANCE:g})"
        )


@dataclass(frozen=True)
class _Tokens:
    """The validated masked-in tokens, flattened: both log-probs and Δ = train − infer."""

    train: FloatArray
    infer: FloatArray
    delta: FloatArray


def _select(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike) -> _Tokens:
    """Validate the three inputs and return the masked-in tokens (1-D float64 arrays)."""
    train = _as_float64("train_logprobs", train_logprobs)
    infer = _as_float64("infer_logprobs", infer_logprobs)
    if infer.shape != train.shape:
        raise MetricError(
            f"infer_logprobs has shape {infer.shape}, expected {train.shape} like train_logprobs"
        )
    keep = _as_mask(mask, train.shape)
    _check_values("train_logprobs", train, keep)
    _check_values("infer_logprobs", infer, keep)
    t = train[keep]
    i = infer[keep]
    return _Tokens(train=t, infer=i, delta=t - i)


def _check_tau(tau: float) -> float:
    ok = (
        isinstance(tau, (int, float, np.floating, np.integer))
        and not isinstance(tau, bool)
        and math.isfinite(tau)
        and tau >= 1
    )
    if not ok:
        raise MetricError(f"tau is {tau!r}, expected a finite number >= 1 (threshold |Δ| > ln tau)")
    return float(tau)


def _check_band(low: float, high: float) -> tuple[float, float]:
    ok = (
        isinstance(low, (int, float, np.floating, np.integer))
        and isinstance(high, (int, float, np.floating, np.integer))
        and math.isfinite(low)
        and 0 < low <= high
    )
    if not ok:
        raise MetricError(
            f"low, high are {low!r}, {high!r}, expected 0 < low <= high (ratio band [low, high])"
        )
    return float(low), float(high)


# --------------------------------------------------------------------------------------------
# kernels on the selected tokens — each formula is written exactly once, here
# --------------------------------------------------------------------------------------------


def _mean(x: FloatArray) -> float:
    """Mean, ``nan`` for no tokens (no warning)."""
    if x.size == 0:
        return math.nan
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.mean(x))


def _max(x: FloatArray) -> float:
    """Maximum, ``nan`` for no tokens."""
    return math.nan if x.size == 0 else float(np.max(x))


def _abs_delta(tok: _Tokens) -> FloatArray:
    return np.abs(tok.delta)


def _prob_abs_diff(tok: _Tokens) -> FloatArray:
    # |exp(lp_t) − exp(lp_i)|; exp of a log-prob ≤ 1e-6 cannot overflow, underflow to 0 is silent.
    diff: FloatArray = np.abs(np.exp(tok.train) - np.exp(tok.infer))
    return diff


def _k1_terms(tok: _Tokens) -> FloatArray:
    return -tok.delta


def _k2_terms(tok: _Tokens) -> FloatArray:
    return 0.5 * np.square(tok.delta)


def _k3_terms(tok: _Tokens) -> FloatArray:
    # e^Δ − 1 − Δ (≥ 0 exactly; the clamp only removes rounding below 0); +inf for Δ ≳ 709.
    with np.errstate(over="ignore", invalid="ignore"):
        return np.maximum(np.expm1(tok.delta) - tok.delta, 0.0)


def _extreme_fraction(tok: _Tokens, tau: float) -> float:
    return _mean((np.abs(tok.delta) > math.log(tau)).astype(np.float64))


def _icepop_mask_rate(tok: _Tokens, low: float, high: float) -> float:
    # e^Δ ∉ [low, high]  ⇔  Δ < ln low  or  Δ > ln high  (compared in log space: no overflow).
    outside = (tok.delta < math.log(low)) | (tok.delta > math.log(high))
    return _mean(outside.astype(np.float64))


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------


def mean_abs_diff(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """mean |Δ| over masked-in tokens, Δ = log π_train − log π_infer (symmetric in direction).

    SkyRL's ``rollout_train_logprobs_abs_diff_mean``. ``nan`` when no token is selected.
    """
    return _mean(_abs_delta(_select(train_logprobs, infer_logprobs, mask)))


def max_abs_diff(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """max |Δ| over masked-in tokens, Δ = log π_train − log π_infer (symmetric in direction).

    SkyRL's ``rollout_train_logprobs_abs_diff_max``. ``nan`` when no token is selected.
    """
    return _max(_abs_delta(_select(train_logprobs, infer_logprobs, mask)))


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
    d = _prob_abs_diff(_select(train_logprobs, infer_logprobs, mask))
    return ProbDiffStats(mean_prob_diff=_mean(d), max_prob_diff=_max(d))


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
    return _mean(_k1_terms(_select(train_logprobs, infer_logprobs, mask)))


def k2(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """k2 = mean(½ Δ²), Δ = log π_train − log π_infer, over masked-in tokens.

    Low-variance, biased, non-negative estimator of KL(π_infer ‖ π_train) under rollout sampling
    (samples from the inference policy, log-ratio log π_train/π_infer). ``nan`` for no tokens.
    """
    return _mean(_k2_terms(_select(train_logprobs, infer_logprobs, mask)))


def k3(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> float:
    """k3 = mean(e^Δ − 1 − Δ) ≥ 0, Δ = log π_train − log π_infer, over masked-in tokens.

    Unbiased, non-negative estimator of KL(π_infer ‖ π_train) under rollout sampling (samples
    from the inference policy, ratio π_train/π_infer = e^Δ). ``+inf`` if some Δ overflows e^Δ;
    ``nan`` when no token is selected.
    """
    return _mean(_k3_terms(_select(train_logprobs, infer_logprobs, mask)))


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
    tau = _check_tau(tau)
    return _extreme_fraction(_select(train_logprobs, infer_logprobs, mask), tau)


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
    low, high = _check_band(low, high)
    return _icepop_mask_rate(_select(train_logprobs, infer_logprobs, mask), low, high)


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
        tok = _Tokens(train=train, infer=infer, delta=self.delta)
        with np.errstate(over="ignore", invalid="ignore"):
            self.terms = {
                "abs_diff": _abs_delta(tok),
                "prob_diff": _prob_abs_diff(tok),
                "k1": _k1_terms(tok),
                "k2": _k2_terms(tok),
                "k3": _k3_terms(tok),
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
        self.tau = _check_tau(tau)
        self.n_tokens = 0
        self.sums = {name: ExactSum() for name in _GAP_SUMS}
        self.max_abs_diff = -math.inf
        self.max_prob_diff = -math.inf
        self.n_extreme = 0
        self.n_icepop = 0
        self.moments: list[tuple[int, float, float, float, float, float]] = []

    def add(self, train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike = None) -> None:
        """Fold in the masked-in tokens of one batch (validated as by :func:`logprob_gap`)."""
        tok = _select(train_logprobs, infer_logprobs, mask)
        self._fold(tok, np.zeros(1, dtype=np.int64))

    def add_segments(
        self, tok_train: FloatArray, tok_infer: FloatArray, starts: npt.NDArray[np.int64]
    ) -> None:
        """Fold in already-selected tokens, summed per segment (``starts``: each segment's first index).

        For callers that validated the tokens themselves (the audit: one segment per sample, so a
        sample's sums do not depend on which batch it was read in).
        """
        self.add_terms(GapTerms(tok_train, tok_infer), slice(None), starts)

    def _fold(self, tok: _Tokens, starts: npt.NDArray[np.int64]) -> None:
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

    Validates the inputs once and evaluates the same kernels as :func:`mean_abs_diff`,
    :func:`max_abs_diff`, :func:`prob_diff_stats`, :func:`prob_pearson`, :func:`k1`, :func:`k2`,
    :func:`k3` (KL(π_infer ‖ π_train) estimators under rollout sampling),
    :func:`extreme_fraction` (``tau``) and :func:`icepop_mask_rate` (band [0.5, 5]), through
    :class:`GapAccumulator`. Empty selection: ``n_tokens == 0`` and every other field ``nan``.
    """
    acc = GapAccumulator(tau=tau)
    acc.add(train_logprobs, infer_logprobs, mask)
    return acc.result()
