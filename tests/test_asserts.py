"""``harness.testing.asserts``: routes judged as sets, values within a tolerance, and failure messages
that name both sides, the count, the first index, both values and the tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.testing.asserts import assert_close_logprobs, assert_same_routes, differing_routes


def test_routes_equal_as_sets_pass_whatever_the_order_dtype_or_library() -> None:
    got = np.array([[[3, 1], [0, 7]], [[2, 5], [6, 4]]], dtype=np.uint8)
    expected = torch.tensor([[[1, 3], [7, 0]], [[5, 2], [4, 6]]], dtype=torch.int64)
    assert_same_routes(got, expected)
    assert_same_routes(got.astype(np.uint16).tolist(), expected.to(torch.int16))
    assert not differing_routes(got, expected).any()


def test_a_differing_route_names_both_sides_count_index_and_values() -> None:
    got = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]])
    expected = torch.tensor([[[2, 1], [3, 4]], [[5, 6], [1, 7]]])
    with pytest.raises(AssertionError) as info:
        assert_same_routes(
            got, expected, names=("engine", "trainer"), what="sample 0", axes=("position", "MoE ordinal")
        )
    assert str(info.value) == (
        "sample 0: 1 of 4 routes differ as sets between engine and trainer; first at position 1, "
        "MoE ordinal 1: engine [0, 7], trainer [1, 7]"
    )


def test_a_mask_restricts_the_comparison_to_its_rows() -> None:
    got = torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]]])
    expected = torch.tensor([[[1, 2]], [[0, 4]], [[6, 5]]])
    assert_same_routes(got, expected, mask=torch.tensor([True, False, True]))
    with pytest.raises(AssertionError, match=r"1 of 2 routes differ.*index \(1, 0\)"):
        assert_same_routes(got, expected, mask=torch.tensor([False, True, True]))


@pytest.mark.parametrize(
    ("got", "expected", "words"),
    [
        (torch.zeros(2, 1, 2, dtype=torch.long), torch.zeros(3, 1, 2, dtype=torch.long), ["shape (2, 1, 2)"]),
        (torch.zeros(2, 1, 2), torch.zeros(2, 1, 2, dtype=torch.long), ["integer ids", "float32"]),
    ],
    ids=["shape", "float-ids"],
)
def test_routes_of_another_shape_or_no_integers_fail_saying_so(
    got: torch.Tensor, expected: torch.Tensor, words: list[str]
) -> None:
    with pytest.raises(AssertionError) as info:
        assert_same_routes(got, expected)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_logprobs_within_tolerance_pass_and_bit_exact_is_the_default() -> None:
    expected = torch.tensor([-1.0, -2.0, -3.0])
    assert_close_logprobs(expected.clone(), expected)
    assert_close_logprobs(np.array([-1.0, -2.0 + 5e-6, -3.0]), expected, atol=1e-5)
    with pytest.raises(AssertionError, match="bit-exact"):
        assert_close_logprobs(expected + torch.tensor([0.0, 0.0, 1e-6]), expected)


def test_logprobs_out_of_tolerance_name_both_sides_count_first_index_values_and_tolerance() -> None:
    got = torch.tensor([[-1.0, -2.5], [-3.0, float("nan")]])
    expected = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    with pytest.raises(AssertionError) as info:
        assert_close_logprobs(
            got, expected, names=("tp2", "one process"), atol=1e-5, axes=("sample", "token")
        )
    assert str(info.value) == (
        "log-probs: 2 of 4 values differ between tp2 and one process (atol 1e-05, rtol 0); "
        "first at sample 0, token 1: tp2 -2.5, one process -2; greatest |Δ| nan at sample 1, token 1"
    )


def test_logprobs_under_a_mask_ignore_the_other_entries() -> None:
    got, expected = torch.tensor([0.0, 9.0, 2.0]), torch.tensor([0.0, 1.0, 2.0])
    assert_close_logprobs(got, expected, mask=torch.tensor([True, False, True]))
    with pytest.raises(AssertionError, match="1 of 1 values"):
        assert_close_logprobs(got, expected, mask=torch.tensor([False, True, False]))
