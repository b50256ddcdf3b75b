"""One validity rule (DESIGN §3.2), two implementations that must agree on every route.

The rule is written once readably in the specification, ``reference_impl.routers.RouterReplay``
(replay targets, torch; the transformers backend uses it too), and once as the trace kernel,
``harness.trace.validate_routes`` (numpy, word-parallel, for traces of hundreds of millions of ids;
the reference must not import the harness and the kernel is no specification). Here the kernel is
held to the specification: on any routes ``[rows, layers, top_k]`` whose slots are all MoE slots,
the trace rejects exactly what some layer's replay targets reject.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.errors import TraceError
from harness.trace import validate_routes
from reference_impl.routers import ReplayError, RouterReplay


@st.composite
def routes(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Small routes with ids drawn around the valid range, so repeats and out-of-range ids are common."""
    experts = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(experts, 4)))
    rows, layers = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    ids = draw(st.lists(st.integers(-1, experts), min_size=rows * layers * k, max_size=rows * layers * k))
    return np.array(ids, dtype=np.int64).reshape(rows, layers, k), experts


def _spec_rejects(array: np.ndarray, experts: int) -> bool:
    state = RouterReplay("decoder layer 0", experts, array.shape[2])
    try:
        for layer in range(array.shape[1]):
            state.checked(torch.from_numpy(array[:, layer, :]))
    except ReplayError:
        return True
    return False


def _kernel_rejects(array: np.ndarray, experts: int) -> bool:
    try:
        validate_routes(array, experts)
    except TraceError:
        return True
    return False


@given(routes())
def test_trace_kernel_rejects_exactly_what_the_specification_rejects(case: tuple[np.ndarray, int]) -> None:
    array, experts = case
    assert _kernel_rejects(array, experts) == _spec_rejects(array, experts), (
        f"routes {array.tolist()} with {experts} experts: trace kernel rejects "
        f"{_kernel_rejects(array, experts)}, specification rejects {_spec_rejects(array, experts)}"
    )


@pytest.mark.parametrize(
    "route, experts, invalid",
    [
        ([[[0, 1]]], 2, False),
        ([[[3, 0], [1, 2]]], 4, False),
        ([[[1, 1]]], 4, True),  # a repeated id
        ([[[0, 4]]], 4, True),  # id == num_experts
        ([[[-1, 2]]], 4, True),
        ([[[3, 0], [2, 2]]], 4, True),  # the second layer repeats
    ],
)
def test_both_judge_examples_by_hand(route: list[list[list[int]]], experts: int, invalid: bool) -> None:
    array = np.array(route, dtype=np.int64)
    assert _kernel_rejects(array, experts) is invalid
    assert _spec_rejects(array, experts) is invalid
