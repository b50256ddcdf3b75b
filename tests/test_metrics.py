"""Tests of harness.metrics: hand-computed values, identities as properties, errors."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from harness.errors import MetricError
from harness.metrics.accumulator import LogprobGap, logprob_gap
from harness.metrics.batch import (
    extreme_fraction,
    gap_growth_bound,
    icepop_mask_rate,
    k1,
    k2,
    k3,
    max_abs_diff,
    mean_abs_diff,
    prob_diff_stats,
    prob_pearson,
)

# --------------------------------------------------------------------------------------------
# a tiny hand-computed example
# --------------------------------------------------------------------------------------------
# Four masked-in tokens and one masked-out token holding garbage (NaN and a positive "log-prob").
# Δ = train − infer = [-1 − (-1), -0.5 − (-1.5), -2 − (-1), -0.5 − (-1)] = [0, 1, -1, 0.5].
TRAIN = np.array([-1.0, -0.5, -2.0, -0.5, np.nan])
INFER = np.array([-1.0, -1.5, -1.0, -1.0, 3.0])
MASK = np.array([True, True, True, True, False])


def test_hand_computed_values() -> None:
    g = logprob_gap(TRAIN, INFER, MASK)
    assert g.n_tokens == 4
    # |Δ| = [0, 1, 1, 0.5]: mean 2.5 / 4, max 1
    assert g.mean_abs_diff == pytest.approx(2.5 / 4)
    assert g.max_abs_diff == pytest.approx(1.0)
    # k1 = mean(−Δ) = −(0 + 1 − 1 + 0.5) / 4
    assert g.k1 == pytest.approx(-0.5 / 4)
    # k2 = mean(½Δ²) = ½ (0 + 1 + 1 + 0.25) / 4 = 1.125 / 4
    assert g.k2 == pytest.approx(1.125 / 4)
    # k3 = mean(e^Δ − 1 − Δ) = [0 + (e − 2) + (e^-1 − 1 + 1) + (e^0.5 − 1.5)] / 4
    assert g.k3 == pytest.approx((0 + (math.e - 2) + math.exp(-1) + (math.exp(0.5) - 1.5)) / 4)
    # F(2): ln 2 ≈ 0.693 < |Δ| for Δ = ±1 only → 2 / 4
    assert g.extreme_fraction == pytest.approx(0.5)
    # e^Δ = [1, 2.718, 0.368, 1.649]; only e^-1 ∉ [0.5, 5] → 1 / 4
    assert g.icepop_mask_rate == pytest.approx(0.25)
    # |exp(lp_t) − exp(lp_i)| per token
    pd = [
        0.0,
        abs(math.exp(-0.5) - math.exp(-1.5)),
        abs(math.exp(-2.0) - math.exp(-1.0)),
        abs(math.exp(-0.5) - math.exp(-1.0)),
    ]
    assert g.mean_prob_diff == pytest.approx(sum(pd) / 4)
    assert g.max_prob_diff == pytest.approx(max(pd))
    # Pearson of p = exp(train), q = exp(infer), written out
    p = [math.exp(x) for x in (-1.0, -0.5, -2.0, -0.5)]
    q = [math.exp(x) for x in (-1.0, -1.5, -1.0, -1.0)]
    pm, qm = sum(p) / 4, sum(q) / 4
    cov = sum((a - pm) * (b - qm) for a, b in zip(p, q, strict=True))
    r = cov / math.sqrt(sum((a - pm) ** 2 for a in p) * sum((b - qm) ** 2 for b in q))
    assert g.prob_pearson == pytest.approx(r)
    assert all(isinstance(v, float) for k, v in g.as_dict().items() if k != "n_tokens")
    assert isinstance(g.n_tokens, int)


def test_extreme_fraction_other_taus() -> None:
    # ln 1.5 ≈ 0.405: |Δ| ∈ {1, 1, 0.5} exceed it → 3/4; ln 3 ≈ 1.099 exceeds every |Δ| → 0
    assert extreme_fraction(TRAIN, INFER, MASK, tau=1.5) == pytest.approx(0.75)
    assert extreme_fraction(TRAIN, INFER, MASK, tau=3.0) == 0.0
    # tau = 1: ln 1 = 0, so every token with Δ ≠ 0 counts → 3/4
    assert extreme_fraction(TRAIN, INFER, MASK, tau=1.0) == pytest.approx(0.75)


def test_icepop_is_directional() -> None:
    # Δ = +2 (ratio e² ≈ 7.39 > 5) is masked, Δ = −0.5 (ratio 0.61 ≥ 0.5) is kept → 1/2
    train = np.array([-0.5, -1.5])
    infer = np.array([-2.5, -1.0])
    assert icepop_mask_rate(train, infer) == pytest.approx(0.5)
    # swapping train and infer flips Δ: −2 (ratio 0.135 < 0.5) masked, +0.5 (1.65) kept → 1/2
    assert icepop_mask_rate(infer, train) == pytest.approx(0.5)
    # a custom band [0.1, 10] keeps both
    assert icepop_mask_rate(train, infer, low=0.1, high=10.0) == 0.0


def test_pearson_perfect_and_anti() -> None:
    p = np.log(np.array([0.1, 0.2, 0.3]))
    assert prob_pearson(p, np.log(np.array([0.2, 0.4, 0.6]))) == pytest.approx(1.0)
    assert prob_pearson(p, np.log(np.array([0.6, 0.4, 0.2]))) == pytest.approx(-1.0)


def test_pearson_undefined_is_nan() -> None:
    const = np.log(np.array([0.5, 0.5, 0.5]))
    assert math.isnan(prob_pearson(const, np.log(np.array([0.1, 0.2, 0.3]))))
    assert math.isnan(prob_pearson(np.array([-1.0]), np.array([-2.0])))


def test_individual_functions_match_logprob_gap() -> None:
    g = logprob_gap(TRAIN, INFER, MASK, tau=1.5)
    assert mean_abs_diff(TRAIN, INFER, MASK) == g.mean_abs_diff
    assert max_abs_diff(TRAIN, INFER, MASK) == g.max_abs_diff
    assert prob_diff_stats(TRAIN, INFER, MASK) == (g.mean_prob_diff, g.max_prob_diff)
    assert prob_pearson(TRAIN, INFER, MASK) == g.prob_pearson
    assert k1(TRAIN, INFER, MASK) == g.k1
    assert k2(TRAIN, INFER, MASK) == g.k2
    assert k3(TRAIN, INFER, MASK) == g.k3
    assert extreme_fraction(TRAIN, INFER, MASK, tau=1.5) == g.extreme_fraction
    assert icepop_mask_rate(TRAIN, INFER, MASK) == g.icepop_mask_rate


def test_logprob_gap_is_frozen_and_as_dict() -> None:
    g = logprob_gap(TRAIN, INFER, MASK)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.k3 = 0.0  # type: ignore[misc]
    d = g.as_dict()
    assert list(d) == [f.name for f in dataclasses.fields(LogprobGap)]
    assert d["k2"] == g.k2


def test_2d_int_mask_and_torch_variants() -> None:
    train = torch.tensor([[-1.0, -0.5], [-2.0, -0.5]], requires_grad=True)
    infer = torch.tensor([[-1.0, -1.5], [-1.0, -1.0]], dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1], [0, 1]])
    # masked-in Δ = [0, 1, 0.5] (the bf16 values are exact)
    assert mean_abs_diff(train, infer, mask) == pytest.approx(1.5 / 3)
    assert k1(train, infer, mask.numpy().astype(np.float32)) == pytest.approx(-1.5 / 3)


# --------------------------------------------------------------------------------------------
# empty mask
# --------------------------------------------------------------------------------------------


def test_empty_mask_gives_nan_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = logprob_gap(TRAIN, INFER, np.zeros(5, dtype=bool))
        empty = logprob_gap(np.zeros(0), np.zeros(0))
        singles = [
            mean_abs_diff(TRAIN, INFER, np.zeros(5, dtype=bool)),
            max_abs_diff(TRAIN, INFER, np.zeros(5, dtype=bool)),
            *prob_diff_stats(TRAIN, INFER, np.zeros(5, dtype=bool)),
            k3(TRAIN, INFER, np.zeros(5, dtype=bool)),
            extreme_fraction(TRAIN, INFER, np.zeros(5, dtype=bool)),
        ]
    for r in (g, empty):
        assert r.n_tokens == 0
        for name, value in r.as_dict().items():
            if name != "n_tokens":
                assert math.isnan(value), name
    assert all(math.isnan(v) for v in singles)


# --------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------

_LP = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False, allow_infinity=False)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=8))
    train = draw(hnp.arrays(np.float64, shape, elements=_LP))
    infer = draw(hnp.arrays(np.float64, shape, elements=_LP))
    mask = draw(hnp.arrays(np.bool_, shape))
    return train, infer, mask


def _delta(train: np.ndarray, infer: np.ndarray, mask: np.ndarray) -> list[float]:
    return [float(t - i) for t, i in zip(train[mask], infer[mask], strict=True)]


def _same(a: dict[str, float | int], b: dict[str, float | int]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@given(_batches())
def test_k3_nonnegative(batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    value = k3(*batch)
    assert math.isnan(value) if not batch[2].any() else value >= 0.0


@given(_batches())
def test_k1_k2_identities(batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    d = _delta(*batch)
    if not d:
        return
    assert k1(*batch) == pytest.approx(-math.fsum(d) / len(d), abs=1e-12)
    assert k2(*batch) == pytest.approx(0.5 * math.fsum(x * x for x in d) / len(d), abs=1e-12)
    assert mean_abs_diff(*batch) == pytest.approx(math.fsum(abs(x) for x in d) / len(d), abs=1e-12)
    assert max_abs_diff(*batch) == max(abs(x) for x in d)


@given(_batches())
def test_identical_inputs_give_zero_gap(batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    train, _, mask = batch
    g = logprob_gap(train, train.copy(), mask)
    assert g.n_tokens == int(mask.sum())
    if g.n_tokens == 0:
        return
    for name in (
        "mean_abs_diff",
        "max_abs_diff",
        "mean_prob_diff",
        "max_prob_diff",
        "k1",
        "k2",
        "k3",
        "extreme_fraction",
        "icepop_mask_rate",
    ):
        assert getattr(g, name) == 0.0, name
    assert math.isnan(g.prob_pearson) or g.prob_pearson == pytest.approx(1.0)
    assert extreme_fraction(train, train, mask, tau=1.0) == 0.0


@given(_batches(), st.floats(1.0, 50.0), st.floats(1.0, 50.0))
def test_extreme_fraction_monotone_in_tau(
    batch: tuple[np.ndarray, np.ndarray, np.ndarray], a: float, b: float
) -> None:
    if not batch[2].any():
        return
    lo, hi = min(a, b), max(a, b)
    assert extreme_fraction(*batch, tau=lo) >= extreme_fraction(*batch, tau=hi)


@given(_batches())
def test_numpy_and_torch_inputs_agree(batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    train, infer, mask = batch
    ref = logprob_gap(train, infer, mask).as_dict()
    assert _same(
        ref, logprob_gap(torch.from_numpy(train), torch.from_numpy(infer), torch.from_numpy(mask)).as_dict()
    )
    # float32 on both sides round the same way
    t32, i32 = train.astype(np.float32), infer.astype(np.float32)
    assert _same(
        logprob_gap(t32, i32, mask).as_dict(),
        logprob_gap(torch.from_numpy(t32), torch.from_numpy(i32), mask).as_dict(),
    )


@given(_batches(), st.sampled_from([np.nan, np.inf, -np.inf, 7.0, -3.0, 0.0]))
def test_masked_out_entries_change_nothing(
    batch: tuple[np.ndarray, np.ndarray, np.ndarray], junk: float
) -> None:
    train, infer, mask = batch
    ref = logprob_gap(train, infer, mask).as_dict()
    train2, infer2 = train.copy(), infer.copy()
    train2[~mask] = junk
    infer2[~mask] = -junk
    assert _same(ref, logprob_gap(train2, infer2, mask).as_dict())
    # None means "every token", i.e. the all-true mask
    assert _same(logprob_gap(train, infer).as_dict(), logprob_gap(train, infer, np.ones_like(mask)).as_dict())


@settings(max_examples=50)
@given(_batches())
def test_pearson_matches_numpy(batch: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    train, infer, mask = batch
    p, q = np.exp(train[mask]), np.exp(infer[mask])
    r = prob_pearson(train, infer, mask)
    if p.size < 2 or np.ptp(p) == 0 or np.ptp(q) == 0:
        assert math.isnan(r) or -1.0 <= r <= 1.0
        return
    if np.std(p) < 1e-6 or np.std(q) < 1e-6:  # ill-conditioned; only check the range
        assert -1.0 <= r <= 1.0
        return
    assert r == pytest.approx(float(np.corrcoef(p, q)[0, 1]), abs=1e-9)


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


def test_error_mask_shape() -> None:
    with pytest.raises(MetricError, match=r"mask has shape \(3,\), expected \(4,\) like train_logprobs"):
        logprob_gap(np.zeros(4) - 1, np.zeros(4) - 1, np.ones(3, dtype=bool))


def test_error_infer_shape() -> None:
    with pytest.raises(MetricError, match=r"infer_logprobs has shape \(2, 2\), expected \(4,\)"):
        k1(np.zeros(4) - 1, np.zeros((2, 2)) - 1)


@pytest.mark.parametrize(
    ("train", "infer", "match"),
    [
        (np.array([-1, -2]), np.array([-1.0, -2.0]), r"train_logprobs has dtype int64, expected a floating"),
        (
            np.array([-1.0, -2.0]),
            torch.tensor([-1, -2]),
            r"infer_logprobs has dtype torch.int64, expected a floating",
        ),
        (np.array([True, False]), np.array([-1.0, -2.0]), r"train_logprobs has dtype bool"),
        (np.array([-1.0, -2.0]), ["a", "b"], r"infer_logprobs has dtype <U1"),
    ],
)
def test_error_non_float(train: object, infer: object, match: str) -> None:
    assert issubclass(MetricError, ValueError)
    with pytest.raises(MetricError, match=match):
        logprob_gap(train, infer)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_error_non_finite_masked_in(bad: float) -> None:
    msg = r"train_logprobs has non-finite value .* index \(1,\).*expected finite"
    with pytest.raises(MetricError, match=msg):
        mean_abs_diff(np.array([-1.0, bad, -1.0]), np.array([-1.0, -1.0, -1.0]))
    with pytest.raises(MetricError, match=r"infer_logprobs has non-finite value"):
        k3(torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, bad]), torch.tensor([False, True]))


def test_error_positive_logprob() -> None:
    msg = (
        r"infer_logprobs has positive value 0\.5 at masked-in index \(0, 1\).*expected log-probabilities <= 0"
    )
    with pytest.raises(MetricError, match=msg):
        k2(np.full((2, 2), -1.0), np.array([[-1.0, 0.5], [-1.0, -1.0]]))
    # within the 1e-6 tolerance is accepted
    assert k2(np.array([5e-7]), np.array([-1.0])) == pytest.approx(0.5 * (1.0 + 5e-7) ** 2)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (np.array([0, 2, 1]), r"mask has value 2 at index \(1,\), expected bool or 0/1"),
        (np.array([0.0, 0.5, 1.0]), r"mask has value 0\.5 at index \(1,\), expected bool or 0/1"),
        (np.array(["a", "b", "c"]), r"mask has dtype <U1, expected bool or 0/1"),
    ],
)
def test_error_bad_mask_values(mask: np.ndarray, match: str) -> None:
    with pytest.raises(MetricError, match=match):
        k1(np.full(3, -1.0), np.full(3, -1.0), mask)


@pytest.mark.parametrize("tau", [0.5, 0.0, -2.0, math.nan, math.inf])
def test_error_bad_tau(tau: float) -> None:
    with pytest.raises(MetricError, match=r"tau is .*, expected a finite number >= 1"):
        extreme_fraction(np.full(2, -1.0), np.full(2, -1.0), tau=tau)
    with pytest.raises(MetricError, match=r"tau is"):
        logprob_gap(np.full(2, -1.0), np.full(2, -1.0), tau=tau)


@pytest.mark.parametrize(("low", "high"), [(0.0, 5.0), (6.0, 5.0), (-1.0, 5.0), (math.nan, 5.0)])
def test_error_bad_icepop_band(low: float, high: float) -> None:
    with pytest.raises(MetricError, match=r"expected 0 < low <= high"):
        icepop_mask_rate(np.full(2, -1.0), np.full(2, -1.0), low=low, high=high)


def test_gap_growth_bound_is_the_mean_before_plus_the_noise_of_the_pair() -> None:
    """Identical gaps: the bound is the mean exactly (no slack); a uniform growth has no noise, so
    any growth is beyond it; scattered per-token changes widen the bound by 3 standard errors."""
    before = np.array([0.1, 0.2, 0.3, 0.4])
    assert gap_growth_bound(before, before) == pytest.approx(0.25)
    grown = before + 1e-6
    assert grown.mean() > gap_growth_bound(before, grown)
    scattered = before + np.array([0.02, -0.02, 0.02, -0.02])
    se = np.std([0.02, -0.02, 0.02, -0.02], ddof=1) / 2
    assert gap_growth_bound(before, scattered) == pytest.approx(0.25 + 3 * se)
    with pytest.raises(ValueError, match="two equal non-empty token sets, got 4 and 3"):
        gap_growth_bound(before, before[:3])
