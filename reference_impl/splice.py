"""Building one sample's routing trace from its attempts (DESIGN §3.4).

A sample is produced by one or more *attempts*: the engine calls of a partial rollout (abort and
resume) or the turns of a multi-turn episode. Attempt ``j`` adds ``a_j`` tokens to the sample (the
tool/observation tokens it prefilled plus the tokens it generated) and returns a payload covering
every position it has seen as input: ``[0, P + a_0 + ... + a_j - 1)``.

The spliced trace has ``P + sum(a) - 1`` rows. Row ``p`` must be the routing that was live when
token ``p`` was fed to the model on the way to producing token ``p + 1``, so each row is taken from
the attempt that added token ``p + 1``: attempt ``j`` contributes exactly the rows of its own new
positions ``[P + sum(a[:j]) - 1, P + sum(a[:j + 1]) - 1)``, and the first attempt that adds tokens
also contributes the prompt rows ``[0, P - 1)``. Rows written by earlier attempts are never touched.

Two other policies exist in the wild:

* **Concatenating whole payloads is a bug** (verl #5430, fixed in #6029). Every payload starts at
  position 0, so appending payload ``j`` after payload ``j - 1`` duplicates the prompt and all
  earlier response rows: the result has ``sum_j (P + sum(a[:j + 1]) - 1)`` rows instead of
  ``P + sum(a) - 1``, and every row after the first payload is attached to the wrong position.
* **Replacing with the latest payload** (:func:`splice_replace`) has the right length but loses
  history (verl #6046): when the weights changed between attempts, the latest attempt re-prefilled
  the earlier positions under the *new* weights, so the rows of tokens sampled by earlier attempts
  are no longer the routing that produced them. It is a documented weaker policy, correct only when
  every attempt ran the same weights and prefill reproduces decode routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SpliceError(ValueError):
    """The attempts of a sample cannot be spliced: a payload is missing or has the wrong rows."""


ATTEMPT_KINDS = ("start", "resume", "turn")
"""The sample's first engine call, a resume after an abort, a new turn after tool tokens."""


@dataclass(frozen=True)
class Attempt:
    """One engine call of a sample.

    ``new_tokens`` is how many tokens this attempt added to the sample (tool tokens it prefilled
    plus tokens it generated; may be 0). ``routes`` is the engine payload ``[rows, layers, top_k]``
    covering positions ``[0, context_len_after_attempt - 1)``, or ``None`` when the engine returned
    nothing (e.g. it was aborted before any forward ran). ``finish_reason`` says how the call
    ended: ``"stop"`` (end of a turn or of the sample), ``"abort"`` (a partial rollout interrupted,
    to be resumed) or ``"length"`` (cut by the length budget). The correct splice treats them
    alike: an interrupted or cut attempt's rows are as real as any (verl #5344 lost them).

    What kind of engine call it was is explicit, because frameworks take different code paths for
    each: ``kind`` is ``"start"`` (the sample's first call), ``"resume"`` (continues a call that was
    aborted) or ``"turn"`` (a new turn after tool/observation tokens). ``tool_tokens`` says how many
    of ``new_tokens`` were tool tokens this call prefilled (the rest it generated), and
    ``weight_version`` which policy weights it ran under. The correct splice needs none of them —
    every attempt contributes the rows of its own new positions — but a subject's multi-turn path
    is only exercised apart from its resume path when they are told apart.

    ``routes_start`` is the context position of the payload's first row: 0 for a whole payload; an
    engine that omits the rows of a cached prefix starts there, per request (vLLM
    ``--enable-omit-prefix-routed-experts``: ``max(start, num_cached_tokens)``, #57966). The payload
    then covers ``[routes_start, context_len_after_attempt - 1)``; a splice that reads it as if it
    began at position 0 shifts every row it takes by ``routes_start``.
    """

    new_tokens: int
    routes: torch.Tensor | None
    finish_reason: str = "stop"
    kind: str = "start"
    tool_tokens: int = 0
    weight_version: int = 0
    routes_start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.routes_start, int) or self.routes_start < 0:
            raise SpliceError(f"Attempt.routes_start = {self.routes_start!r}: expected an int >= 0")
        if self.kind not in ATTEMPT_KINDS:
            raise SpliceError(f"Attempt.kind = {self.kind!r}: expected one of {ATTEMPT_KINDS}")
        if not 0 <= self.tool_tokens <= max(self.new_tokens, 0):
            raise SpliceError(
                f"Attempt.tool_tokens = {self.tool_tokens}: expected in [0, new_tokens = {self.new_tokens}]"
            )


def splice(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """Splice a sample's trace: each attempt contributes only the rows of its own new positions.

    Returns ``[P + sum(a) - 1, layers, top_k]``. The prompt rows come from the first attempt that
    adds tokens (it is the one whose prefill the first response token was sampled from); a sample
    of total length 1 has 0 rows, and one with ``P > 1`` where no attempt adds tokens raises, since
    no attempt owns its prompt rows. An attempt with 0 new tokens contributes nothing,
    whatever its payload (verl's partial-rollout client ``FullyAsyncLLMServerClient.generate``
    guards this case, because ``payload[-0:]`` is the *whole* payload, not an empty slice).
    Raises :class:`SpliceError` when a contributing payload is ``None`` or does not have exactly
    the rows its context needs from its ``routes_start`` on, or when it omitted rows of the attempt's
    own positions (a prefix cached from *another* request: no payload of this sample holds them);
    nothing is ever padded.
    """
    _total_len(prompt_len, attempts)  # validates the schedule
    pieces: list[torch.Tensor] = []
    filled = 0  # rows [0, filled) are final
    context_len = prompt_len
    for index, attempt in enumerate(attempts):
        context_len += attempt.new_tokens
        if attempt.new_tokens == 0:
            continue
        start = attempt.routes_start
        if start > filled:
            raise SpliceError(
                f"attempt {index}: its payload starts at position routes_start = {start}, but rows "
                f"[{filled}, {start}) are its own (no earlier attempt wrote them): the engine omitted "
                "a prefix cached from another request, which no payload of this sample holds"
            )
        payload = _checked_payload(index, attempt.routes, rows_needed=context_len - 1 - start)
        pieces.append(payload[filled - start : context_len - 1 - start])
        filled = context_len - 1
    if not pieces:
        if prompt_len > 1:
            raise SpliceError(f"no attempt added tokens, so no attempt owns the {prompt_len - 1} prompt rows")
        return _empty_like_any_payload(attempts)  # total length 1: 0 rows
    _check_consistent(pieces)
    return torch.cat(pieces, dim=0)


def splice_replace(prompt_len: int, attempts: Sequence[Attempt]) -> torch.Tensor:
    """The weaker policy: the latest payload, checked to cover the whole sample.

    Correct in length, but rows of positions sampled by earlier attempts come from the latest
    attempt's re-prefill, under whatever weights it ran (verl #6046). Raises :class:`SpliceError`
    when no attempt returned a payload or the latest one has the wrong row count.
    """
    total_len = _total_len(prompt_len, attempts)
    for index in reversed(range(len(attempts))):
        if attempts[index].routes is not None:
            if attempts[index].routes_start:
                raise SpliceError(
                    f"attempt {index}: routes_start = {attempts[index].routes_start}: the latest payload "
                    "omitted a cached prefix, and replacing needs a whole payload (routes_start 0)"
                )
            return _checked_payload(index, attempts[index].routes, rows_needed=total_len - 1)
    raise SpliceError(f"no attempt returned routes; rows needed: {total_len - 1}")


def truncate(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut the response to ``max_response_len`` tokens and the routes with it.

    After truncation ``routes`` still has ``len(tokens) - 1`` rows: cutting tokens but not rows
    (verl #6027, fixed in #6089) leaves rows for positions that no longer exist, and every later
    layout step then misaligns them.
    """
    check_truncation(tokens, routes, prompt_len, max_response_len)
    keep = min(tokens.shape[0], prompt_len + max_response_len)
    return tokens[:keep], routes[: keep - 1]


def check_truncation(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> None:
    """Raise :class:`SpliceError` naming the argument unless :func:`truncate` 's arguments fit together."""
    if tokens.dim() != 1 or tokens.shape[0] < 1:
        raise SpliceError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
    if routes.shape[0] != tokens.shape[0] - 1:
        raise SpliceError(
            f"routes has {routes.shape[0]} rows, expected len(tokens) - 1 = {tokens.shape[0] - 1}"
        )
    if not 1 <= prompt_len <= tokens.shape[0]:
        raise SpliceError(f"prompt_len must be in [1, {tokens.shape[0]}], got {prompt_len}")
    if max_response_len < 0:
        raise SpliceError(f"max_response_len must be >= 0, got {max_response_len}")


def _total_len(prompt_len: int, attempts: Sequence[Attempt]) -> int:
    """Validate the attempt schedule and return the sample's total length ``P + sum(a)``."""
    if prompt_len < 1:
        raise SpliceError(f"prompt_len must be >= 1, got {prompt_len}")
    for index, attempt in enumerate(attempts):
        if attempt.new_tokens < 0:
            raise SpliceError(f"attempt {index}: new_tokens must be >= 0, got {attempt.new_tokens}")
    return prompt_len + sum(attempt.new_tokens for attempt in attempts)


def _checked_payload(index: int, routes: torch.Tensor | None, rows_needed: int) -> torch.Tensor:
    """Return ``routes`` if it is a ``[rows_needed, layers, top_k]`` tensor, else raise."""
    if routes is None:
        raise SpliceError(f"attempt {index}: routes is None (0 rows); rows needed: {rows_needed}")
    if routes.dim() != 3:
        raise SpliceError(
            f"attempt {index}: routes must be [rows, layers, top_k], got shape {tuple(routes.shape)}"
        )
    if routes.shape[0] != rows_needed:
        raise SpliceError(f"attempt {index}: routes has {routes.shape[0]} rows; rows needed: {rows_needed}")
    return routes


def _check_consistent(pieces: list[torch.Tensor]) -> None:
    """All contributing payloads must agree on ``[layers, top_k]`` and dtype."""
    first = pieces[0]
    for piece in pieces[1:]:
        if piece.shape[1:] != first.shape[1:] or piece.dtype != first.dtype:
            raise SpliceError(
                f"payloads disagree: [layers, top_k] {tuple(piece.shape[1:])} {piece.dtype} "
                f"vs {tuple(first.shape[1:])} {first.dtype}"
            )


def _empty_like_any_payload(attempts: Sequence[Attempt]) -> torch.Tensor:
    """A 0-row trace shaped like the first payload present (its ``[layers, top_k]``, its dtype)."""
    for attempt in attempts:
        if attempt.routes is not None:
            return attempt.routes[:0]
    raise SpliceError("sample has 0 rows and no attempt returned routes to give [layers, top_k]")
