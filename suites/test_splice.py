"""Splice and truncation invariants (DESIGN §3.4), checked on the subject's ``splice`` and ``truncate``.

The oracle is the simulated engine of ``harness.schedules``: its route for position ``p`` under
weight version ``v`` is a known function of ``(p, v)``, distinct for every pair here (1024 experts),
so after a schedule is played through it its ``expected`` trace is the one a correct splice builds,
and a wrong row tells which position and which weights it really came from. Rows are judged by
position first: row ``i`` of the spliced trace must be row ``i`` of the attempt that owns position
``i``; content only names, in the message, where a wrong row came from. So the low-entropy routes
of ``route_tables`` (top-1, two experts, constant rows) can put equal rows across a seam, where a
splice that drops an equal row as a duplicate, or finds rows by content, goes wrong. Bug classes
(FACTS §4): duplication on resume (verl #5430), policy-version mixing (verl #6046), the ``[-0:]``
slice, lost on cancel (verl #5344), truncation (verl #6027/#6089), multi-turn staleness (verl
#6054), and a repeated row at a seam taken for a duplicate.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from harness.schedules import RouteTable, SimulatedEngine, simulate
from harness.strategies import attempt_schedules, route_tables
from harness.testing.asserts import differing_routes
from harness.testing.judge import Refusal, as_ids, refuses, route_sets
from harness.testing.suite import require
from reference_impl.engine import Rollout
from reference_impl.episode import AttemptPlan, Episode, Schedule
from reference_impl.splice import Attempt

LAYERS, TOP_K = 2, 2
NUM_EXPERTS = 1024  # 7p + 5v + 3l < 1024 here: every (position, version) has its own route


# --------------------------------------------------------------------------------------------------
# Schedules that reach each bug class on purpose (also used as explicit examples, whatever the seed)
# --------------------------------------------------------------------------------------------------


def A(tool: int, generated: int, update_weights: bool, finish_reason: str) -> AttemptPlan:
    """An attempt of ``tool`` tool tokens, then ``generated`` tokens (the simulated engine's whole budget)."""
    return AttemptPlan(generated, tuple(range(1, tool + 1)), update_weights, finish_reason)


def S(prompt_len: int, attempts: tuple[AttemptPlan, ...]) -> Schedule:
    """A schedule with a prompt of ``prompt_len`` tokens (their ids do not matter to the splice)."""
    return Schedule(tuple(range(1, prompt_len + 1)), attempts)


RESUMED_AFTER_UPDATE = S(4, (A(0, 3, False, "abort"), A(0, 2, True, "stop")))
"""A partial rollout aborted after 3 tokens and resumed under new weights."""
IDLE_IN_THE_MIDDLE = S(3, (A(0, 2, False, "abort"), A(0, 0, False, "abort"), A(0, 2, True, "stop")))
"""An attempt that adds no token between two that do (``payload[-0:]`` is the whole payload)."""
IDLE_FIRST = S(5, (A(0, 0, False, "abort"), A(0, 3, True, "stop")))
"""The first attempt aborted before it added a token; the resumed one owns the prompt rows."""
LENGTH_CUT = S(2, (A(0, 3, False, "abort"), A(0, 2, True, "length")))
"""Aborted, resumed under new weights, then cut by the length budget."""
MULTI_TURN = S(3, (A(0, 3, False, "stop"), A(2, 2, True, "stop"), A(1, 2, True, "stop")))
"""Three turns with tool tokens between them and a weight update before each later turn."""
TRAILING_TOOL_TURN = S(2, (A(0, 2, False, "stop"), A(3, 0, True, "stop")))
"""A last turn that only prefilled tool tokens, under new weights."""


class Sim(NamedTuple):
    """A schedule played through the simulated engine: the episode, the engine (its oracle), and the
    trace DESIGN §3.4 defines, read off the attempts' payloads by position before any splice ran."""

    episode: Episode[Rollout]
    engine: SimulatedEngine
    owned: torch.Tensor


def _simulate(schedule: Schedule, *, idle_payloads: bool = False, table: RouteTable | None = None) -> Sim:
    """``schedule`` played through the simulated engine (with ``table``: its low-entropy routes); with
    ``idle_payloads`` an attempt that added no token still returns the rows of the context it
    prefilled, which a correct splice ignores."""
    episode, engine = simulate(
        schedule,
        layers=LAYERS,
        top_k=TOP_K,
        num_experts=NUM_EXPERTS,
        idle_payloads=idle_payloads,
        table=table,
    )
    owned = _owned_rows(episode, (engine.layers, engine.top_k))
    assert torch.equal(route_sets(owned), route_sets(engine.expected)), (
        f"{schedule.describe()}: the simulated engine's payloads disagree with its own oracle"
    )
    return Sim(episode, engine, owned)


def _row_owner(episode: Episode[Rollout], row: int) -> int:
    """The attempt (1-based) that contributes ``row`` (DESIGN §3.4; prompt rows: the first adding tokens)."""
    end = episode.prompt_len - 1
    for j, attempt in enumerate(episode.attempts, 1):
        end += attempt.new_tokens
        if attempt.new_tokens and row < end:
            return j
    return len(episode.attempts)


def _owned_rows(episode: Episode[Rollout], row_shape: tuple[int, int]) -> torch.Tensor:
    """Row ``i`` of the payload of the attempt that owns position ``i``, for every fed position: the
    spliced trace by position, never by content, so rows that repeat are still told apart."""
    rows = [
        torch.as_tensor(episode.attempts[_row_owner(episode, i) - 1].routes)[i].clone()
        for i in range(len(episode.tokens) - 1)
    ]
    return torch.stack(rows) if rows else torch.zeros((0, *row_shape), dtype=torch.long)


def _identify(row: torch.Tensor, engine: SimulatedEngine, max_position: int, max_version: int) -> str:
    """Where ``row`` could have come from, in words: a hint for the message, never the judge."""
    if not bool(row.any()):
        return "zeros (filler)"
    target = torch.sort(row, dim=-1).values
    sources = [
        (position, version)
        for position in range(max_position)
        for version in range(max_version + 1)
        if torch.equal(torch.sort(engine.route_at(position, version), dim=-1).values, target)
    ]
    if not sources:
        return "a route the engine never computed"
    if engine.table is not None:
        return f"a route that repeats ({len(sources)} (position, weights) pairs computed it)"
    position, version = sources[0]
    return f"the route of position {position} under weights v{version}"


def _check_row_count(
    schedule: Schedule, episode: Episode[Rollout], got: Any, row_shape: tuple[int, int] = (LAYERS, TOP_K)
) -> torch.Tensor:
    expected = len(episode.tokens) - 1  # the simulated engine prefills every tool token
    if got is None and expected == 0:
        # No position was fed (P + Σa = 1): "no routes" is as true as an empty trace (verl returns None).
        return torch.zeros(0, *row_shape, dtype=torch.long)
    got = as_ids(got, f"{schedule.describe()}: spliced trace")
    assert got.dim() == 3, (
        f"{schedule.describe()}: spliced trace has shape {tuple(got.shape)}, expected [rows, layers, top_k]"
    )
    rows = got.shape[0]
    hint = ""
    if rows > expected:
        hint = (
            " (rows duplicated: whole payloads appended, "
            "or an attempt with no new token re-appended its payload)"
        )
    elif rows < expected:
        hint = (
            " (rows lost: an attempt's rows were dropped, "
            "or a row equal to the one before it taken for a duplicate)"
        )
    assert rows == expected, (
        f"{schedule.describe()}: spliced trace has {rows} rows, expected P + Σa − 1 = {expected}{hint}"
    )
    assert tuple(got.shape[1:]) == row_shape, (
        f"{schedule.describe()}: spliced rows are {tuple(got.shape[1:])}, "
        f"expected [layers, top_k] = {row_shape}"
    )
    return got


def _check_rows(schedule: Schedule, sim: Sim, got: Any) -> None:
    """Row ``i`` of the spliced trace is, as an expert set, row ``i`` of the attempt that owns position
    ``i`` (DESIGN §3.4): the route live when token ``i + 1`` was sampled. Judged by position first; what
    a wrong row holds is only identified by content in the message."""
    episode, engine, owned = sim
    got = _check_row_count(schedule, episode, got, (engine.layers, engine.top_k))
    got_sets, owned_sets = route_sets(got), route_sets(owned)
    wrong = differing_routes(got, owned, names=("spliced", "owner's row")).any(-1)
    wrong = wrong.nonzero().squeeze(1).tolist()
    if not wrong:
        return
    max_version = sum(plan.update_weights for plan in schedule.attempts)
    details = []
    for p in wrong[:3]:
        details.append(
            f"row {p} holds {got_sets[p].tolist()}, "
            f"{_identify(got_sets[p], engine, len(episode.tokens), max_version)}; expected row {p} of "
            f"attempt {_row_owner(episode, p)}'s payload, {owned_sets[p].tolist()}: the route of position "
            f"{p} under weights v{engine.version_of_row[p]}, live when token {p + 1} was sampled"
        )
    more = f"; and {len(wrong) - 3} more" if len(wrong) > 3 else ""
    where = schedule.describe() + (f", {engine.table.describe()}" if engine.table is not None else "")
    raise AssertionError(f"{where}: {len(wrong)} wrong row(s): " + "; ".join(details) + more)


def _splice(subject: Any, schedule: Schedule, attempts: list[Attempt]) -> Any:
    splice = require(subject, "splice")
    try:
        return splice(schedule.prompt_len, attempts)
    except Exception as err:  # a valid schedule must splice: say so, with the schedule
        raise AssertionError(
            f"{schedule.describe()}: splice raised {type(err).__name__}: {err} on a valid schedule"
        ) from err


# --------------------------------------------------------------------------------------------------
# Targeted strategies
# --------------------------------------------------------------------------------------------------


@st.composite
def schedules_with_idle_attempts(draw: st.DrawFn) -> Schedule:
    """A schedule with one or two attempts that add no token, anywhere, often after a contributing one."""
    specs = list(draw(attempt_schedules(max_attempts=4)).attempts)
    for _ in range(draw(st.integers(1, 2))):
        at = draw(st.one_of(st.integers(1, len(specs)), st.integers(0, len(specs))))
        idle = AttemptPlan(
            update_weights=draw(st.booleans()),
            finish_reason="length" if at == len(specs) else "abort",
        )
        specs.insert(at, idle)
    return S(draw(st.integers(1, 12)), tuple(specs))


@st.composite
def schedules_with_cut_attempts(draw: st.DrawFn) -> Schedule:
    """An attempt aborted mid-generation and resumed under new weights, and a last one cut by length."""
    specs = list(draw(attempt_schedules(max_attempts=4)).attempts)
    at = draw(st.integers(0, len(specs) - 1))
    aborted = A(
        0 if at == 0 else draw(st.integers(0, 3)),
        draw(st.integers(1, 6)),
        at > 0 and draw(st.booleans()),
        "abort",
    )
    specs.insert(at, aborted)
    specs[at + 1] = replace(specs[at + 1], update_weights=True)
    specs[-1] = replace(specs[-1], max_new_tokens=max(1, specs[-1].max_new_tokens), finish_reason="length")
    return S(draw(st.integers(1, 12)), tuple(specs))


@st.composite
def multi_turn_schedules(draw: st.DrawFn) -> Schedule:
    """Two to four turns, tool tokens before every later turn, the weights updated before at least one."""
    turns = draw(st.integers(2, 4))
    updates = [draw(st.booleans()) for _ in range(turns - 1)]
    updates[draw(st.integers(0, turns - 2))] = True
    specs = [A(0, draw(st.integers(1, 6)), False, "stop")]
    for j in range(1, turns):
        specs.append(
            A(
                draw(st.integers(1, 6)),
                draw(st.integers(0, 6)),
                updates[j - 1],
                "stop" if j < turns - 1 else draw(st.sampled_from(("stop", "length"))),
            )
        )
    return S(draw(st.integers(1, 12)), tuple(specs))


@st.composite
def resume_schedules(draw: st.DrawFn) -> Schedule:
    """One turn interrupted and resumed two to four times, the weights updated before at least one resume."""
    calls = draw(st.integers(2, 4))
    updates = [draw(st.booleans()) for _ in range(calls - 1)]
    updates[draw(st.integers(0, calls - 2))] = True
    specs = [
        AttemptPlan(
            max_new_tokens=draw(st.integers(1 if j == 0 else 0, 6)),
            update_weights=j > 0 and updates[j - 1],
            finish_reason="abort" if j < calls - 1 else draw(st.sampled_from(("stop", "length"))),
        )
        for j in range(calls)
    ]
    return S(draw(st.integers(1, 12)), tuple(specs))


@st.composite
def missing_payload_cases(draw: st.DrawFn) -> tuple[Schedule, int]:
    """A schedule and the index of an attempt with new tokens whose payload goes missing."""
    schedule = draw(attempt_schedules())
    adding = [j for j, plan in enumerate(schedule.attempts) if plan.tool_tokens or plan.max_new_tokens]
    return schedule, draw(st.sampled_from(adding))


# --------------------------------------------------------------------------------------------------
# Splice
# --------------------------------------------------------------------------------------------------


@pytest.mark.capability("splice")
@given(schedule=attempt_schedules(), idle_payloads=st.booleans())
@example(schedule=RESUMED_AFTER_UPDATE, idle_payloads=False)
@example(schedule=IDLE_IN_THE_MIDDLE, idle_payloads=True)
@example(schedule=IDLE_FIRST, idle_payloads=True)
@example(schedule=LENGTH_CUT, idle_payloads=False)
@example(schedule=MULTI_TURN, idle_payloads=False)
def test_spliced_trace_has_one_row_per_fed_position(
    subject: Any, schedule: Schedule, idle_payloads: bool
) -> None:
    """The spliced trace has P + Σa − 1 rows after any schedule (no duplicated or lost rows)."""
    note(f"counterexample: {schedule.describe()}")
    note(f"counterexample: idle_payloads={idle_payloads}")
    episode = _simulate(schedule, idle_payloads=idle_payloads).episode
    got = _splice(subject, schedule, list(episode.attempts))
    _check_row_count(schedule, episode, got)


@pytest.mark.capability("splice")
@given(schedule=attempt_schedules(), idle_payloads=st.booleans())
@example(schedule=RESUMED_AFTER_UPDATE, idle_payloads=False)
@example(schedule=IDLE_IN_THE_MIDDLE, idle_payloads=True)
@example(schedule=IDLE_FIRST, idle_payloads=True)
@example(schedule=LENGTH_CUT, idle_payloads=False)
@example(schedule=MULTI_TURN, idle_payloads=False)
@example(schedule=TRAILING_TOOL_TURN, idle_payloads=False)
def test_every_row_is_the_route_live_when_its_token_was_sampled(
    subject: Any, schedule: Schedule, idle_payloads: bool
) -> None:
    """Every spliced row is the route that was live when its token was sampled (no newer weights)."""
    note(f"counterexample: {schedule.describe()}")
    note(f"counterexample: idle_payloads={idle_payloads}")
    sim = _simulate(schedule, idle_payloads=idle_payloads)
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


@pytest.mark.capability("splice")
@given(schedule=schedules_with_idle_attempts())
@example(schedule=IDLE_IN_THE_MIDDLE)
@example(schedule=IDLE_FIRST)
@example(schedule=S(1, (A(0, 1, False, "abort"), A(0, 0, True, "abort"), A(0, 0, False, "length"))))
def test_attempt_with_no_new_tokens_contributes_nothing(subject: Any, schedule: Schedule) -> None:
    """An attempt that adds no token contributes no row, even when it returned a payload."""
    note(f"counterexample: {schedule.describe()}")
    sim = _simulate(schedule, idle_payloads=True)
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


@pytest.mark.capability("splice")
@given(schedule=schedules_with_cut_attempts())
@example(schedule=RESUMED_AFTER_UPDATE)
@example(schedule=LENGTH_CUT)
@example(schedule=S(3, (A(0, 2, False, "abort"), A(0, 1, True, "abort"), A(0, 2, True, "length"))))
def test_aborted_and_length_cut_attempts_keep_their_rows(subject: Any, schedule: Schedule) -> None:
    """Rows of attempts that were aborted or cut by the length budget are kept as they were computed."""
    note(f"counterexample: {schedule.describe()}")
    sim = _simulate(schedule, idle_payloads=False)
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


@pytest.mark.capability("splice")
@given(schedule=multi_turn_schedules())
@example(schedule=MULTI_TURN)
@example(schedule=TRAILING_TOOL_TURN)
def test_multi_turn_keeps_every_turns_rows(subject: Any, schedule: Schedule) -> None:
    """Each turn of a multi-turn episode (tool tokens too) keeps its own rows; later turns overwrite none.

    Every attempt after the first is a new turn (``Attempt.kind == "turn"``, its tool tokens counted in
    ``Attempt.tool_tokens``), with weight updates between turns: the multi-turn path, apart from resume.
    """
    note(f"counterexample: {schedule.describe()}")
    sim = _simulate(schedule, idle_payloads=False)
    assert all(a.kind == "turn" for a in sim.episode.attempts[1:]), "the schedule is not multi-turn"
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


@pytest.mark.capability("splice")
@given(schedule=resume_schedules())
@example(schedule=RESUMED_AFTER_UPDATE)
@example(schedule=S(2, (A(0, 2, False, "abort"), A(0, 0, True, "abort"), A(0, 1, True, "stop"))))
def test_resumed_attempts_keep_their_rows(subject: Any, schedule: Schedule) -> None:
    """A partial rollout aborted and resumed under newer weights keeps each call's rows (the resume path:
    ``Attempt.kind == "resume"``, no tool tokens), including a resume that adds 0 tokens."""
    note(f"counterexample: {schedule.describe()}")
    sim = _simulate(schedule, idle_payloads=True)
    assert all(a.kind == "resume" for a in sim.episode.attempts[1:]), "the schedule is not a resumed rollout"
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


def _omitting_cached_prefixes(sim: Sim, draw: st.DrawFn) -> list[Attempt]:
    """The episode's attempts as an engine that omits cached-prefix rows returns them: every attempt
    after the first that added tokens starts its payload at a drawn ``routes_start`` in the context it
    was given (at most its first own row), the rows before it cut off."""
    attempts, context, filled, owner_seen = list(sim.episode.attempts), sim.episode.prompt_len, 0, False
    for j, attempt in enumerate(attempts):
        context += attempt.new_tokens
        if owner_seen and attempt.routes is not None:
            start = draw(
                st.integers(0, min(filled, attempt.routes.shape[0])), label=f"attempt {j + 1} routes_start"
            )
            attempts[j] = replace(attempt, routes=attempt.routes[start:], routes_start=start)
        if attempt.new_tokens:
            filled, owner_seen = context - 1, True
    return attempts


@pytest.mark.capability("splice")
@given(schedule=attempt_schedules(), data=st.data())
def test_an_engine_omitted_cached_prefix_is_spliced_from_its_own_start(
    subject: Any, schedule: Schedule, data: st.DataObject
) -> None:
    """An engine that omits the rows of a cached prefix (vLLM ``--enable-omit-prefix-routed-experts``,
    #57966) starts each payload at ``Attempt.routes_start`` = ``max(start, num_cached_tokens)``, per
    request. Every row is still the route live when its token was sampled: the splice reads each payload
    from its own start, or refuses the attempts; it never takes row ``i`` of a payload for position
    ``i`` (a shift by the cached prefix)."""
    note(f"counterexample: {schedule.describe()}")
    sim = _simulate(schedule, idle_payloads=True)
    attempts = _omitting_cached_prefixes(sim, data.draw)
    starts = [a.routes_start for a in attempts]
    note(f"routes_start per attempt: {starts}")
    try:
        got = require(subject, "splice")(schedule.prompt_len, attempts)
    except Exception:  # refusing an engine feature it does not support is correct; shifting rows is not
        return
    _check_rows(schedule, sim, got)


CONSTANT_TOP1 = RouteTable(palette=(((1,),),))
"""Top-1, one layer, every row the same expert: every seam joins two equal rows."""
BOTH_EXPERTS_REORDERED = RouteTable(palette=(((0, 1), (1, 0)),), reorder=True)
"""Two experts, top-2: every route is {0, 1}, its ids in the other order at odd positions."""
RUNS_OF_TWO = RouteTable(palette=(((1,), (2,)), ((2,), (1,))), run=2)
"""Top-1 over three experts, two layers, runs of two equal rows; weight updates change nothing."""


@pytest.mark.capability("splice")
@given(
    schedule=st.one_of(attempt_schedules(), resume_schedules(), multi_turn_schedules()),
    table=route_tables(),
    idle_payloads=st.booleans(),
)
@example(schedule=RESUMED_AFTER_UPDATE, table=CONSTANT_TOP1, idle_payloads=False)
@example(schedule=MULTI_TURN, table=BOTH_EXPERTS_REORDERED, idle_payloads=False)
@example(schedule=IDLE_IN_THE_MIDDLE, table=RUNS_OF_TWO, idle_payloads=True)
@example(schedule=TRAILING_TOOL_TURN, table=CONSTANT_TOP1, idle_payloads=False)
def test_rows_that_repeat_across_a_seam_keep_their_positions(
    subject: Any, schedule: Schedule, table: RouteTable, idle_payloads: bool
) -> None:
    """Low-entropy routes (top-1, one or two experts, constant rows, one set in two id orders) put equal
    rows on both sides of resumes and turn boundaries; each is still the row of the attempt that owns
    its position. An equal row is not a duplicate, and content does not say where a row belongs."""
    note(f"counterexample: {schedule.describe()}")
    note(f"counterexample: {table.describe()}, idle_payloads={idle_payloads}")
    sim = _simulate(schedule, idle_payloads=idle_payloads, table=table)
    got = _splice(subject, schedule, list(sim.episode.attempts))
    _check_rows(schedule, sim, got)


@pytest.mark.capability("splice")
@given(
    schedule=attempt_schedules(),
    idle_payloads=st.booleans(),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.int16]),
)
@example(schedule=IDLE_FIRST, idle_payloads=False, dtype=torch.int16)
@example(schedule=S(1, (A(0, 1, False, "stop"),)), idle_payloads=False, dtype=torch.int64)
@example(schedule=S(1, (A(0, 0, False, "length"),)), idle_payloads=True, dtype=torch.int64)
def test_splice_accepts_every_valid_schedule(
    subject: Any, schedule: Schedule, idle_payloads: bool, dtype: torch.dtype
) -> None:
    """The splice does not raise on any valid schedule, whatever the payloads' integer dtype."""
    note(f"counterexample: {schedule.describe()}")
    note(f"counterexample: idle_payloads={idle_payloads}, dtype={dtype}")
    episode = _simulate(schedule, idle_payloads=idle_payloads).episode
    attempts = [replace(a, routes=None if a.routes is None else a.routes.to(dtype)) for a in episode.attempts]
    got = _splice(subject, schedule, attempts)
    _check_row_count(schedule, episode, got)


@pytest.mark.capability("splice")
@given(case=missing_payload_cases())
@example(case=(RESUMED_AFTER_UPDATE, 1))
@example(case=(RESUMED_AFTER_UPDATE, 0))
def test_missing_payload_raises_a_value_error(subject: Any, case: tuple[Schedule, int]) -> None:
    """A missing payload for an attempt with new tokens raises a ValueError subclass, never a filled trace."""
    note(f"counterexample: {case[0].describe()}")
    note(f"counterexample: attempt {case[1] + 1} returns no payload")
    splice = require(subject, "splice")
    schedule, index = case
    attempts = list(_simulate(schedule).episode.attempts)
    attempts[index] = replace(attempts[index], routes=None)
    added = attempts[index].new_tokens
    where = f"{schedule.describe()}: attempt {index + 1} added {added} tokens but returned no payload"
    try:
        got = splice(schedule.prompt_len, attempts)
    except ValueError:
        return
    except Exception as err:
        raise AssertionError(
            f"{where}; splice raised {type(err).__name__}: {err}, expected a ValueError subclass"
        ) from err
    raise AssertionError(f"{where}; splice returned {tuple(np.shape(got))} instead of raising")


@pytest.mark.capability("splice", "truncate")
def test_bad_splice_and_truncate_input_is_refused(subject: Any, refused: Refusal = refuses) -> None:
    """Bad input raises, in the subject's own words, never returns a trace, and leaves the attempts'
    payloads as they were. The reference's own tests run these cases with ``raises_naming``: its errors
    name the field and the expected value."""
    splice, truncate = require(subject, "splice"), require(subject, "truncate")
    episode = _simulate(RESUMED_AFTER_UPDATE).episode
    payloads = [None if a.routes is None else torch.as_tensor(a.routes).clone() for a in episode.attempts]
    rows = len(episode.tokens) - 1
    good = list(episode.attempts)
    short = replace(good[1], routes=good[1].routes[:-1])  # type: ignore[index]
    refused(lambda: splice(4, [good[0], short]), f"{rows - 1} rows", str(rows))
    refused(lambda: splice(4, [good[0], replace(good[1], routes=good[1].routes[..., 0])]), "routes")  # type: ignore[index]
    wider = replace(good[1], routes=torch.cat([good[1].routes, good[1].routes], dim=1))  # type: ignore[list-item]
    refused(lambda: splice(4, [good[0], wider]), "layers")
    refused(lambda: splice(0, good), "prompt_len", "1")
    refused(lambda: splice(4, [replace(good[0], new_tokens=-1)]), "new_tokens", "0")
    refused(lambda: splice(3, [Attempt(0, None, "abort")]), "2 prompt rows")
    omitted = replace(good[0], routes=good[0].routes[1:], routes_start=1)  # type: ignore[index]
    refused(lambda: splice(4, [omitted, good[1]]), "routes_start = 1", "[0, 1)")
    tokens, routes = _coded_sample(6, 0, torch.int64)
    refused(lambda: truncate(tokens[None], routes, 2, 1), "tokens")
    refused(lambda: truncate(tokens, routes[:-1], 2, 1), "4 rows", "= 5")
    refused(lambda: truncate(tokens, routes, 7, 1), "prompt_len", "[1, 6]")
    refused(lambda: truncate(tokens, routes, 2, -1), "max_response_len", "0")
    kept = [
        p is None or torch.equal(torch.as_tensor(a.routes), p)
        for a, p in zip(episode.attempts, payloads, strict=True)
    ]
    assert all(kept), (
        f"refused splices changed the payloads of attempts {[i + 1 for i, k in enumerate(kept) if not k]}"
    )


# --------------------------------------------------------------------------------------------------
# Truncation
# --------------------------------------------------------------------------------------------------


@st.composite
def truncation_cases(draw: st.DrawFn) -> tuple[int, int, int, int, torch.dtype, RouteTable | None]:
    """``(prompt_len, response_len, budget, seed, dtype, table)``; the budget is often below the
    response. ``table`` (half the cases) draws the rows from the splice suite's low-entropy routes
    (``route_tables``: constant rows, runs of equal rows, one set in two id orders), where rows
    repeat; ``None`` codes each row with its own index."""
    prompt_len = draw(st.integers(1, 12))
    response_len = draw(st.integers(0, 12))
    budget = draw(st.one_of(st.integers(0, max(response_len - 1, 0)), st.just(0), st.integers(0, 16)))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))
    table = draw(st.one_of(st.none(), route_tables()))
    return prompt_len, response_len, budget, seed, dtype, table


def _coded_sample(length: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, and ``length − 1`` rows each carrying a distinct marker of its row index."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(0, 50_000, size=length))
    lanes = np.arange(LAYERS * TOP_K).reshape(LAYERS, TOP_K)
    offset = int(rng.integers(0, 1000))
    rows = (
        np.stack([offset + 10 * i + lanes for i in range(length - 1)])
        if length > 1
        else np.zeros((0, LAYERS, TOP_K))
    )
    return tokens, torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(dtype)


def _table_sample(
    length: int, seed: int, dtype: torch.dtype, table: RouteTable
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, and ``length − 1`` rows of ``table``'s low-entropy routes (rows repeat)."""
    tokens, _ = _coded_sample(length, seed, dtype)
    shape = (0, table.layers, table.top_k)
    rows = torch.stack([table(p, 0) for p in range(length - 1)]) if length > 1 else torch.zeros(shape)
    return tokens, rows.to(dtype)


def _row_count_message(got: int, keep: int, allowed: tuple[int, ...]) -> str:
    """What a wrong row count after truncation means: rows counted, rows expected, and which way."""
    expected = " or ".join(str(n) for n in allowed)
    why = (
        "the last kept token's row is real, either count is right"
        if len(allowed) == 2
        else "one row per token but the last"
    )
    if got > max(allowed):
        return (
            f"{got} rows after truncation for {keep} tokens, expected {expected} ({why}): "
            f"{got - max(allowed)} more — a row for a cut token is a route for a position that no "
            "longer exists"
        )
    return (
        f"{got} rows after truncation for {keep} tokens, expected {expected} ({why}): "
        f"{min(allowed) - got} fewer — rows of kept positions were lost (equal rows dropped as "
        "duplicates, or cut one token too early)"
    )


@pytest.mark.capability("truncate")
@given(case=truncation_cases())
@example(case=(4, 6, 3, 0, torch.int64, None))
@example(case=(1, 3, 0, 1, torch.int16, None))
@example(case=(5, 2, 7, 2, torch.int32, None))
@example(case=(3, 1, 1, 3, torch.int64, None))  # a one-token response, not cut
@example(case=(2, 1, 0, 4, torch.int64, None))  # a one-token response cut to nothing
def test_truncation_cuts_tokens_and_rows_together(
    subject: Any, case: tuple[int, int, int, int, torch.dtype, RouteTable | None]
) -> None:
    """Truncating the response to the budget keeps the first P + R′ tokens, each row still its token's row.

    After a cut the last kept token was forwarded (a later token was sampled from it), so its row is
    real: ``P + R′`` rows or ``P + R′ − 1`` are both correct (DESIGN §3.1); without a cut exactly
    ``len(tokens) − 1`` rows exist. Any integer dtype and array type that hold the ids will do. Rows
    drawn from low-entropy routes repeat: an equal row is still its own position's row, never a
    duplicate to drop. Rows are judged as sets (kernels order top-k differently).
    """
    prompt_len, response_len, budget, seed, dtype, table = case
    rows_from = "coded rows" if table is None else table.describe()
    note(
        f"counterexample: prompt of {prompt_len} tokens, response of {response_len}, budget {budget}, "
        f"seed={seed}, dtype={dtype}, {rows_from}"
    )
    truncate = require(subject, "truncate")
    if table is None:
        tokens, routes = _coded_sample(prompt_len + response_len, seed, dtype)
    else:
        tokens, routes = _table_sample(prompt_len + response_len, seed, dtype, table)
    where = f"prompt of {prompt_len} tokens, response of {response_len}, budget {budget} ({rows_from})"
    cut_tokens, cut_routes = truncate(tokens.clone(), routes.clone(), prompt_len, budget)
    cut_tokens, cut_routes = as_ids(cut_tokens, "truncated tokens"), as_ids(cut_routes, "truncated routes")
    keep = prompt_len + min(response_len, budget)
    assert cut_tokens.shape[0] == keep, (
        f"{where}: {cut_tokens.shape[0]} tokens after truncation, expected {keep} "
        f"(P + min(R, budget) = {prompt_len} + {min(response_len, budget)})"
    )
    assert torch.equal(cut_tokens, tokens[:keep].long()), (
        f"{where}: truncated tokens are not the first {keep} tokens"
    )
    allowed = (keep - 1, keep) if keep < tokens.shape[0] else (keep - 1,)
    assert cut_routes.shape[0] in allowed, f"{where}: " + _row_count_message(
        cut_routes.shape[0], keep, allowed
    )
    got_sets, want_sets = route_sets(cut_routes), route_sets(routes.long()[: cut_routes.shape[0]])
    moved = [i for i in range(cut_routes.shape[0]) if not torch.equal(got_sets[i], want_sets[i])]
    assert not moved, f"{where}: rows {moved[:5]} changed by truncation; row i must stay the row of token i"
