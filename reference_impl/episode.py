"""Episodes: one sample built by several attempts, and the one schedule that plans them.

An *attempt* (DESIGN §2) is one engine call of a partial rollout or one turn of a multi-turn
episode. RL frameworks build a sample the same way whatever the engine: every attempt resubmits the
whole context so far — prompt ⊕ earlier responses ⊕ this attempt's tool tokens — as a new prompt
(SGLang: "resume is the client's job"; verl's ``FullyAsyncLLMServerClient.generate``), so each
attempt's payload re-prefills every earlier position under the weights live at that attempt.
`reference_impl.splice.splice` then keeps, for every position, the row of the attempt that actually
consumed it (DESIGN §3.4).

* `Schedule` is the plan of one episode: its prompt and one `AttemptPlan` per attempt (tool tokens
  to prefill, a generation budget, a weight update before the call, how the call ends). The same
  schedule drives every engine: the reference `RolloutEngine`, the harness's simulated engine, a
  transformers KV cache and the real vLLM / SGLang adapters.
* `run_episode` plays a schedule through any engine call ``generate(context, max_new_tokens)`` and
  records, per attempt, the `Attempt` the splice consumes.
* `Episode` is what it returns: the sample's tokens and log-probs, its attempts and the engine
  calls themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from .splice import Attempt

FINISH_REASONS = ("stop", "abort", "length")
"""How an attempt ends: its turn ended, it was aborted to be resumed, or the length budget cut it."""


class EpisodeError(ValueError):
    """A schedule is invalid, or an engine call did not answer the request the episode made."""


@dataclass(frozen=True)
class AttemptPlan:
    """One attempt of a schedule: prefill ``tool_tokens``, then generate up to ``max_new_tokens``.

    ``tool_tokens`` are the ids appended to the context before the call (an observation or tool
    result of a multi-turn episode). ``max_new_tokens`` is the call's generation budget (a partial
    rollout is cut by it and resumed by the next attempt; 0: the call is aborted before it samples).
    ``update_weights``: the policy weights change before the call (fully-async RL).
    ``finish_reason`` is how the call ends when it uses its whole budget: ``"abort"`` (interrupted,
    resumed by the next attempt), ``"stop"`` (its turn ends) or ``"length"`` (the sample's length
    budget); an engine that samples its stop token first ends with ``"stop"`` whatever the plan.
    """

    max_new_tokens: int = 0
    tool_tokens: tuple[int, ...] = ()
    update_weights: bool = False
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise EpisodeError(f"AttemptPlan.max_new_tokens = {self.max_new_tokens!r}: expected an int >= 0")
        if self.finish_reason not in FINISH_REASONS:
            raise EpisodeError(
                f"AttemptPlan.finish_reason = {self.finish_reason!r}: expected one of {FINISH_REASONS}"
            )


@dataclass(frozen=True)
class Schedule:
    """The plan of one episode: the prompt's token ids and the attempts that extend it."""

    prompt: tuple[int, ...]
    attempts: tuple[AttemptPlan, ...]

    def __post_init__(self) -> None:
        if not self.prompt:
            raise EpisodeError("Schedule.prompt = (): expected at least one token id")
        if not self.attempts:
            raise EpisodeError("Schedule.attempts = (): expected at least one attempt")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def kind(self, index: int) -> str:
        """What engine call attempt ``index`` is (`reference_impl.splice.ATTEMPT_KINDS`): ``"start"``
        (the first), ``"turn"`` (it prefills tool tokens, or the call before it ended its turn with
        ``"stop"``) or ``"resume"`` (it continues an aborted or cut call)."""
        if index == 0:
            return "start"
        plan = self.attempts[index]
        return "turn" if plan.tool_tokens or self.attempts[index - 1].finish_reason == "stop" else "resume"

    def describe(self) -> str:
        """The schedule in plain words, for failure messages."""
        parts = [f"prompt of {self.prompt_len} tokens"]
        for j, a in enumerate(self.attempts, 1):
            words = (
                f"attempt {j} ({self.kind(j - 1)}): {len(a.tool_tokens)} tool + {a.max_new_tokens} "
                f"generated ({a.finish_reason})"
            )
            parts.append(("weights updated; " if a.update_weights else "") + words)
        return "; ".join(parts)


class EngineCall(Protocol):
    """What `run_episode` reads from one engine call: the reference `Rollout`, or an adapter's.

    ``tokens`` the ids it generated, ``logprobs`` theirs (None when the engine returned none),
    ``routes`` its payload ``[rows, layers, top_k]`` for positions ``[start, prompt_len + len(tokens)
    - 1)`` or None when no forward ran, ``finish_reason`` ``"length"`` when the budget ran out.
    """

    @property
    def prompt_len(self) -> int: ...

    @property
    def tokens(self) -> Sequence[int] | Tensor: ...

    @property
    def logprobs(self) -> Sequence[float] | Tensor | None: ...

    @property
    def routes(self) -> Tensor | None: ...

    @property
    def start(self) -> int: ...

    @property
    def finish_reason(self) -> str: ...


C = TypeVar("C", bound=EngineCall)


@dataclass(frozen=True)
class Episode(Generic[C]):
    """A sample built by several engine calls.

    ``tokens`` [L] int64 is the full sequence prompt ⊕ everything added (tool and generated
    tokens); ``attempts`` holds, per call, how many tokens it added, its payload and how it ended —
    the input of `reference_impl.splice.splice`; ``calls`` the engine calls as they answered. Over
    the response positions ``[P, L)``, ``response_logprobs`` [L - P] float32 is the inference
    log-prob of each generated token (NaN where the engine returned none) and 0 at tool tokens,
    which were not sampled; ``sampled_mask`` [L - P] bool says which is which.
    """

    prompt_len: int
    tokens: Tensor
    attempts: tuple[Attempt, ...]
    response_logprobs: Tensor
    sampled_mask: Tensor
    calls: tuple[C, ...]

    @property
    def response_len(self) -> int:
        return int(self.tokens.shape[0]) - self.prompt_len


def run_episode(
    generate: Callable[[tuple[int, ...], int], C],
    schedule: Schedule,
    *,
    update_weights: Callable[[int], None] | None = None,
) -> Episode[C]:
    """Play ``schedule``: each attempt resubmits the whole context to ``generate(context, budget)``.

    Before an attempt whose plan says so, ``update_weights(version)`` changes the engine's weights
    (versions 1, 2, … in order). Attempt ``j`` counts as new tokens the tool tokens not yet fed plus
    the tokens it generated, when it ran a forward (returned a payload or generated a token); its
    payload covers ``[0, context_after_attempt - 1)``. Tool tokens are counted by the attempt that
    prefills them (DESIGN §3.4): an engine that runs no forward for a call with no budget returns
    no payload, so that call's tool tokens are counted by the next attempt that runs, and tool
    tokens that no later attempt prefills are in ``tokens`` but in no attempt (they have no row,
    DESIGN §3.6). An attempt that used its whole budget ends as its plan says; one that sampled
    its stop token ends with ``"stop"``. Every call must answer the context it was given with at
    most its budget of tokens and a payload from position 0 (the splice needs whole payloads),
    else `EpisodeError`.
    """
    if update_weights is None and any(plan.update_weights for plan in schedule.attempts):
        raise EpisodeError("the schedule updates the weights between attempts: pass update_weights")
    tokens = list(schedule.prompt)
    logprobs: list[float] = []
    sampled: list[bool] = []
    attempts: list[Attempt] = []
    calls: list[C] = []
    unfed_tool_tokens = 0  # tool tokens appended since the last forward
    version = 0
    for index, plan in enumerate(schedule.attempts):
        if plan.update_weights and update_weights is not None:  # None only without updates: checked above
            version += 1
            update_weights(version)
        tokens.extend(plan.tool_tokens)
        logprobs.extend([0.0] * len(plan.tool_tokens))
        sampled.extend([False] * len(plan.tool_tokens))
        unfed_tool_tokens += len(plan.tool_tokens)
        call = generate(tuple(tokens), plan.max_new_tokens)
        generated = [int(token) for token in call.tokens]
        routes, call_logprobs = call.routes, call.logprobs
        _check_call(index, call, routes, len(tokens), len(generated), plan.max_new_tokens)
        tokens.extend(generated)
        if call_logprobs is None:
            logprobs.extend([float("nan")] * len(generated))
        else:
            logprobs.extend(float(lp) for lp in call_logprobs)
        sampled.extend([True] * len(generated))
        new_tokens, tool = 0, 0
        if routes is not None or generated:  # a forward ran
            tool = unfed_tool_tokens
            new_tokens, unfed_tool_tokens = unfed_tool_tokens + len(generated), 0
        finish_reason = plan.finish_reason if call.finish_reason == "length" else call.finish_reason
        attempts.append(Attempt(new_tokens, routes, finish_reason, schedule.kind(index), tool, version))
        calls.append(call)
    return Episode(
        schedule.prompt_len,
        torch.tensor(tokens, dtype=torch.int64),
        tuple(attempts),
        torch.tensor(logprobs, dtype=torch.float32),
        torch.tensor(sampled, dtype=torch.bool),
        tuple(calls),
    )


def _check_call(
    index: int, call: EngineCall, routes: Tensor | None, context_len: int, generated: int, budget: int
) -> None:
    """The call answered the request: the context it was given, within budget, a whole payload."""
    where = f"attempt {index + 1}"
    if call.prompt_len != context_len:
        raise EpisodeError(
            f"{where}: the engine answered a prompt of {call.prompt_len} tokens, expected {context_len}"
        )
    if generated > budget:
        raise EpisodeError(
            f"{where}: {generated} tokens generated, expected at most max_new_tokens = {budget}"
        )
    if routes is not None and call.start != 0:
        raise EpisodeError(
            f"{where}: payload starts at position start = {call.start}, expected 0 "
            "(the splice needs whole payloads)"
        )
    if call.logprobs is not None and len(call.logprobs) != generated:
        raise EpisodeError(f"{where}: {len(call.logprobs)} log-probs for {generated} generated tokens")
