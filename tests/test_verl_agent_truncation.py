"""verl 0.9.1's multi-turn agent loop under a response budget that cuts mid-turn (``ToolAgentLoop.run``,
``harness.subjects.frameworks.verl.truncation``), and the mutant that proves the check would catch
routes left uncut (``harness.mutants.verl``).

Both run verl's own loop, so they need verl 0.9.1: they run in ``tox -e verl-0.9.1`` and skip,
naming the env, elsewhere. The schedule arithmetic (``turns``) is checked without verl.
"""

from __future__ import annotations

import pytest

from harness.check.suites import run_suites, suites_dir
from harness.subjects.frameworks import installed_version
from harness.subjects.frameworks.verl.truncation import turns

INVARIANT = "test_splice.py::test_truncation_cuts_tokens_and_rows_together"
needs_verl = pytest.mark.skipif(
    installed_version("verl") != "0.9.1", reason="needs verl 0.9.1 (run it in its env: tox -e verl-0.9.1)"
)


def _outcomes(spec: str) -> dict[str, str]:
    outcomes, log = run_suites(
        spec, paths=[str(suites_dir() / INVARIANT)], extra=["--hypothesis-profile", "ci"]
    )
    assert outcomes, f"no test ran for {spec}:\n{log[-2000:]}"
    return {o.nodeid: o.outcome for o in outcomes}


@pytest.mark.parametrize(
    ("response_len", "budget", "expected"),
    [
        (6, 3, (1, 1, 4)),  # tool tokens inside the budget push the last turn past it
        (12, 7, (3, 3, 6)),
        (6, 9, (3, 2, 1)),  # no cut: the response's turns as they are
        (6, 2, (6, 0, 0)),  # no room for a tool turn before the cut: one turn, cut mid-turn
        (2, 5, (2, 0, 0)),
        (3, 0, (3, 0, 0)),
    ],
)
def test_the_budget_falls_inside_the_last_engine_turn(
    response_len: int, budget: int, expected: tuple[int, int, int]
) -> None:
    first, tool, last = turns(response_len, budget)
    assert (first, tool, last) == expected
    assert first + tool + last == response_len
    if tool:
        assert first >= 1 and last >= 1 and first + tool < min(budget, response_len)


@needs_verl
def test_verl_agent_loop_cuts_routes_with_its_tokens() -> None:
    outcomes = _outcomes("harness.subjects.frameworks.verl:VERL_0_9_1")
    assert set(outcomes.values()) == {"passed"}, outcomes


@needs_verl
def test_agent_loop_with_unsliced_routes_is_killed() -> None:
    outcomes = _outcomes("harness.mutants.verl:AGENT_LOOP_UNSLICED_ROUTES")
    assert "failed" in outcomes.values(), f"the unsliced-routes mutant survived {INVARIANT}: {outcomes}"
