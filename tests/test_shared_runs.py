"""``harness.engines.shared_runs``: two runs compared over the rows both computed from one context."""

from __future__ import annotations

import numpy as np
import pytest

from harness.engines.shared_runs import compare_shared
from harness.errors import HarnessError
from harness.trace import RoutingTrace

E, LAYERS, K = 16, 3, 2


def _trace(rows: int, seed: int, start: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(rows * LAYERS)]).reshape(rows, LAYERS, K)
    return RoutingTrace(ids.astype(np.uint8), num_experts=E, start=start)


def _with_rows(trace: RoutingTrace, other: RoutingTrace, lo: int) -> RoutingTrace:
    """``trace``'s rows before position ``lo`` and ``other``'s from it."""
    ids = np.concatenate([trace.experts[: lo - trace.start], other.experts[lo - other.start :]])
    return RoutingTrace(ids, num_experts=E, start=trace.start)


PROMPT = tuple(range(10))


def test_runs_that_part_are_compared_only_before_the_first_divergence() -> None:
    a = _trace(10 + 8 - 1, seed=0)
    b = _with_rows(a, _trace(17, seed=1), lo=13)  # other routes from position 13 on
    shared = compare_shared(PROMPT, ((1, 2, 3, 4, 5, 6, 7, 8), a), ((1, 2, 3, 9, 9, 9, 9, 9), b))
    assert (shared.tokens, shared.lo, shared.hi, shared.diverged) == (3, 0, 13, True)
    assert shared.disagreement == 0.0, shared.describe()
    assert "parted at generated token 3" in shared.describe()


def test_routes_that_differ_before_the_divergence_are_counted() -> None:
    a = _trace(17, seed=0)
    b = _with_rows(a, _trace(17, seed=1), lo=5)  # other routes inside the shared context
    shared = compare_shared(PROMPT, ((1,) * 8, a), ((1,) * 8, b))
    assert (shared.tokens, shared.hi, shared.diverged) == (8, 17, False)
    assert shared.disagreement > 0.5, shared.describe()


def test_a_cropped_run_is_compared_from_its_first_row_and_a_shorter_one_up_to_its_last() -> None:
    full = _trace(17, seed=0)
    cropped = RoutingTrace(full.experts[12:13], num_experts=E, start=12)  # 4 tokens: P + 4 − 1 − 12 rows
    shared = compare_shared(PROMPT, ((1, 2, 3, 4), cropped), ((1, 2, 3, 4, 5, 6, 7, 8), full))
    assert (shared.lo, shared.hi, shared.rows, shared.disagreement) == (12, 13, 1, 0.0)


def test_runs_with_no_common_row_are_refused() -> None:
    with pytest.raises(HarnessError, match="share no computed row"):
        compare_shared(PROMPT, ((1,), _trace(2, 0, start=10)), ((2,), _trace(10, 0)))
