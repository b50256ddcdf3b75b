"""Splice mutants: how frameworks have built a sample's trace from its attempts wrongly (FACTS §4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.mutants import Mutant, mutate
from reference_impl.splice import Attempt, splice, splice_replace, truncate


def concatenate_payloads(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """Every attempt's whole payload, concatenated: each resume duplicates the rows before it."""
    return torch.cat([a.routes for a in attempts if a.routes is not None])


def append_last_rows_unguarded(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """The first payload, then each later payload's last ``new_tokens`` rows — without the 0 guard."""
    payloads = [a for a in attempts if a.routes is not None]
    rows = [payloads[0].routes] + [a.routes[-a.new_tokens :] for a in payloads[1:]]  # type: ignore[index]
    return torch.cat(rows)  # type: ignore[arg-type]


def splice_dropping_cancelled(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """Each position's row from the first payload that covers it, ignoring aborted or cut attempts."""
    kept = [a.routes for a in attempts if a.routes is not None and a.finish_reason == "stop"]
    rows = max((r.shape[0] for r in kept), default=0)
    return torch.stack([next(r[p] for r in kept if r.shape[0] > p) for p in range(rows)])


def splice_restarting_each_turn(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """The correct splice on the resume path, but on the multi-turn path (an attempt of kind "turn") the
    new turn's payload overwrites every earlier row."""
    turn_start = max((i for i, a in enumerate(attempts) if a.kind == "turn"), default=0)
    earlier = sum(a.new_tokens for a in attempts[:turn_start])
    merged = Attempt(earlier + attempts[turn_start].new_tokens, attempts[turn_start].routes)
    return splice(prompt_len, [merged, *attempts[turn_start + 1 :]])


def splice_dropping_repeated_seam_rows(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """The correct splice, except at each resume or turn boundary: a new attempt's first row equal (as a
    set) to the last row already kept is taken for the overlap row the engine sent again, and dropped.

    Random routes over many experts never meet an equal row there; top-1 or two-expert routes do.
    """
    trace = splice(prompt_len, attempts)
    seams, context_len, first = set(), prompt_len, True
    for attempt in attempts:
        if attempt.new_tokens and not first:
            seams.add(context_len - 1)  # the new attempt's first own row
        first = first and not attempt.new_tokens
        context_len += attempt.new_tokens
    sets = torch.sort(trace, dim=-1).values
    keep = [p for p in range(trace.shape[0]) if not (p in seams and torch.equal(sets[p], sets[p - 1]))]
    return trace[keep]


def splice_finding_seam_by_content(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """The first contributing attempt's payload, then each later attempt's rows taken from just after
    the last kept row's route, found by content in its payload when it occurs there exactly once (the
    overlap row the engine sent again), else from the position the rows count gives.

    Right while every route is distinct (it sits where the position says), and while routes repeat so
    often that none is unique (it falls back to the position); wrong when a weight update moved the
    routes, so the last kept route reappears once, one position away.
    """
    trace: torch.Tensor | None = None
    context_len = prompt_len
    for attempt in attempts:
        context_len += attempt.new_tokens
        if not attempt.new_tokens:
            continue
        if attempt.routes is None:
            raise ValueError(f"an attempt added {attempt.new_tokens} tokens but returned no routes")
        rows = torch.as_tensor(attempt.routes)
        if trace is None:
            trace = rows[: context_len - 1]
            continue
        start = trace.shape[0]
        last = torch.sort(trace[-1], dim=-1).values
        hits = [i for i in range(rows.shape[0]) if torch.equal(torch.sort(rows[i], dim=-1).values, last)]
        if len(hits) == 1:
            start = hits[0] + 1
        trace = torch.cat([trace, rows[start : start + attempt.new_tokens]])
    return splice(prompt_len, attempts) if trace is None else trace


def truncate_tokens_only(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the response to the budget but keep every row."""
    return tokens[: prompt_len + max_response_len], routes


def truncate_collapsing_repeated_rows(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct cut, then ``unique_consecutive`` over the kept rows to drop the overlap row a
    resume sent twice (the verl #5430/#6029 de-duplication shape): equal routes at neighbouring
    positions are not duplicates, and each one collapsed shifts every later row up by one.

    Random routes over many experts never repeat a row; top-1 or few-expert routes do.
    """
    cut_tokens, cut_routes = truncate(tokens, routes, prompt_len, max_response_len)
    return cut_tokens, torch.unique_consecutive(cut_routes, dim=0)


def splice_with_turn_placeholders(
    prompt_len: int, attempts: Sequence[Attempt], *, fill: bool = False
) -> torch.Tensor:
    """Multi-turn as verifiers and prime-rl built it: each turn's trace padded to its full length with
    a placeholder row (zeros) for its last token, which the engine never forwarded, and the next turn
    appended from ``prefix_len``: row ``prefix_len − 1`` keeps the placeholder although the next
    payload holds its real route. ``fill``: the placeholder replaced from that payload (right). The
    resume path (an attempt of another kind) appends from the last filled row, as it should."""
    trace: torch.Tensor | None = None
    context_len = prompt_len
    for attempt in attempts:
        before, context_len = context_len, context_len + attempt.new_tokens
        if not attempt.new_tokens:
            continue
        if attempt.routes is None:
            raise ValueError(f"an attempt added {attempt.new_tokens} tokens but returned no routes")
        rows = torch.as_tensor(attempt.routes)
        if rows.shape[0] != context_len - 1:
            raise ValueError(f"a payload of {rows.shape[0]} rows; its context needs {context_len - 1}")
        if trace is None:
            trace = rows
        elif attempt.kind == "turn":
            placeholder = rows[before - 1 : before] if fill else torch.zeros_like(rows[:1])
            trace = torch.cat([trace, placeholder, rows[before : context_len - 1]])
        else:
            trace = torch.cat([trace, rows[trace.shape[0] : context_len - 1]])
    if trace is None:
        return splice(prompt_len, attempts)  # no attempt added tokens: the reference's answer
    return trace


def splice_assuming_rows_from_position_zero(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """Each attempt's own rows read by absolute position, ``payload[filled : context − 1]``, as if every
    payload began at the caller's prompt start: a payload whose engine omitted a cached prefix
    (``routes_start`` > 0, vLLM #57966) gives rows shifted by that prefix, and too few."""
    pieces, filled, context_len = [], 0, prompt_len
    for attempt in attempts:
        context_len += attempt.new_tokens
        if attempt.new_tokens and attempt.routes is not None:
            pieces.append(torch.as_tensor(attempt.routes)[filled : context_len - 1])
            filled = context_len - 1
    return torch.cat(pieces) if pieces else splice(prompt_len, attempts)


MUTANTS = (
    Mutant(
        "omitted-prefix-read-from-zero",
        "engine-omitted cached prefix",
        "vLLM #57966: with --enable-omit-prefix-routed-experts each payload starts at "
        "max(start, num_cached_tokens); a splice reading row i as position i shifts every row by the cached "
        "prefix (hides without prefix-cache hits)",
        mutate("omitted-prefix-read-from-zero", splice=splice_assuming_rows_from_position_zero),
        killed_by="test_splice.py::test_an_engine_omitted_cached_prefix_is_spliced_from_its_own_start",
    ),
    Mutant(
        "duplication-on-resume",
        "duplication on resume",
        "verl #5430 (fixed #6029): partial-rollout resume concatenated every attempt's payload",
        mutate("duplication-on-resume", splice=concatenate_payloads),
        killed_by="test_splice.py::test_spliced_trace_has_one_row_per_fed_position",
    ),
    Mutant(
        "policy-version-mixing",
        "policy-version mixing",
        "verl #6046: the latest payload replaces the trace; earlier rows re-prefilled under newer weights "
        "(hides unless weights change between attempts)",
        mutate("policy-version-mixing", splice=splice_replace),
        killed_by="test_splice.py::test_every_row_is_the_route_live_when_its_token_was_sampled",
    ),
    Mutant(
        "minus-zero-slice",
        "[-0:] slice",
        "verl FullyAsyncLLMServerClient before its guard: payload[-0:] is the whole payload "
        "(hides unless an attempt adds 0 tokens but returns a payload)",
        mutate("minus-zero-slice", splice=append_last_rows_unguarded),
        killed_by="test_splice.py::test_spliced_trace_has_one_row_per_fed_position",
    ),
    Mutant(
        "lost-on-cancel",
        "lost on cancel",
        "verl #5344 review: routes not saved when an attempt is aborted or cut by the length budget",
        mutate("lost-on-cancel", splice=splice_dropping_cancelled),
        killed_by="test_splice.py::test_spliced_trace_has_one_row_per_fed_position",
    ),
    Mutant(
        "multi-turn-staleness",
        "multi-turn staleness",
        "verl #6054: each turn overwrites earlier turns' rows (hides unless weights change between turns)",
        mutate("multi-turn-staleness", splice=splice_restarting_each_turn),
        killed_by="test_splice.py::test_multi_turn_keeps_every_turns_rows",
    ),
    Mutant(
        "turn-boundary-placeholder",
        "turn-boundary placeholder",
        "verifiers #2616, prime-rl #1807: turn t padded to full length, turn t+1 appended from prefix_len, "
        "so row prefix_len − 1 keeps its placeholder (hides unless a turn follows another)",
        mutate("turn-boundary-placeholder", splice=splice_with_turn_placeholders),
        killed_by="test_splice.py::test_multi_turn_keeps_every_turns_rows",
    ),
    Mutant(
        "repeated-row-at-seam",
        "repeated row at a seam",
        "issue 25's blind spot (no framework release known): at a resume or turn boundary a row equal to "
        "the one before it is dropped as a duplicate (hides unless two equal rows meet at a seam: top-1, "
        "few experts)",
        mutate("repeated-row-at-seam", splice=splice_dropping_repeated_seam_rows),
        killed_by="test_splice.py::test_rows_that_repeat_across_a_seam_keep_their_positions",
    ),
    Mutant(
        "seam-found-by-content",
        "repeated row at a seam",
        "issue 34's blind spot (no framework release known): each later attempt's rows start after the "
        "last kept route, found by content in the new payload when it occurs there once (hides unless a "
        "weight update moves a repeating route one position: distinct or constant routes hide it)",
        mutate("seam-found-by-content", splice=splice_finding_seam_by_content),
        killed_by="test_splice.py::test_rows_that_repeat_across_a_seam_keep_their_positions",
    ),
    Mutant(
        "truncation",
        "truncation",
        "verl #6027 (fixed #6089): response truncated to the budget but rows not",
        mutate("truncation", truncate=truncate_tokens_only),
        killed_by="test_splice.py::test_truncation_cuts_tokens_and_rows_together",
    ),
    Mutant(
        "truncation-collapses-repeated-rows",
        "truncation",
        "verl #5430/#6029's de-duplication shape in a truncation: unique_consecutive over the kept rows "
        "collapses equal routes at neighbouring positions (hides unless two kept rows repeat: top-1, "
        "few experts, constant rows)",
        mutate("truncation-collapses-repeated-rows", truncate=truncate_collapsing_repeated_rows),
        killed_by="test_splice.py::test_truncation_cuts_tokens_and_rows_together",
    ),
)
