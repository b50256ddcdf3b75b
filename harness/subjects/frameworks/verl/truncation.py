"""``truncate``: the response budget of verl's multi-turn agent loop, ``ToolAgentLoop.run``
(``verl/experimental/agent_loop/tool_agent_loop.py``, 0.9.1), as released. Its state machine stops
once the response, tool tokens included, reaches ``rollout.response_length``; its last step hands the
trainer ``response_ids[:response_length]`` and ``routed_experts[:len(prompt_ids) + response_length]``.

The sample becomes one episode: its prompt, then its response as two engine turns with a tool turn
between them (the stand-ins for the chat template, the tool parser and the tool step are
``splice.tool_agent_loop``'s). The tool turn lies inside the budget, so its tokens push the response
past ``response_length`` during the last turn, which the budget cuts mid-turn. A budget or response
below 3 tokens leaves no room for a tool turn: one turn, cut mid-turn where the budget says. Each
engine call returns the routes of every position it forwarded (its context and its new tokens but
the last): rows of the sample's routes, in the release's payload type.

Two cases are not run through the loop, each because no episode produces it:

- A response of no token. An engine call always returns at least one token, so the sample comes
  back as it is.
- A budget inside a tool turn. 0.9.1 then ends the episode without that turn
  (``_handle_processing_tools_state`` returns ``TERMINATED`` before it appends the tokens). The
  response is shorter than the budget rather than cut to it, which ``truncate`` 's contract (the
  first ``P + min(R, budget)`` tokens) does not describe. So no schedule here puts the budget there.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from harness.subjects.frameworks import require_release
from harness.subjects.frameworks.verl.payload import Payload, as_payload
from harness.subjects.frameworks.verl.splice import tool_agent_loop
from reference_impl.splice import check_truncation


class _Engine:
    """The agent loop's ``server_manager``: one canned ``TokenOutput`` per call, each for the context
    the call must come with (a call with another context is an error: the episode went elsewhere)."""

    def __init__(self, calls: list[tuple[list[int], Any]]) -> None:
        self.calls = calls

    async def generate(self, request_id: Any, *, prompt_ids: list[int], **kwargs: Any) -> Any:
        if not self.calls:
            raise RuntimeError("ToolAgentLoop called the engine more often than the episode has turns")
        context, output = self.calls.pop(0)
        if list(prompt_ids) != context:
            raise RuntimeError(
                f"ToolAgentLoop sent a context of {len(prompt_ids)} tokens, the episode's turn has "
                f"{len(context)}"
            )
        return output


def turns(response_len: int, budget: int) -> tuple[int, int, int]:
    """``(first, tool, last)``: tokens of the first engine turn, the tool turn and the last engine
    turn. The first two end before ``min(budget, response_len)``, so the loop reaches the last turn
    and the budget (when it cuts) falls inside it; ``(response_len, 0, 0)`` when there is no room."""
    room = min(budget, response_len) - 1
    if room < 2:
        return response_len, 0, 0
    first = (room + 1) // 2
    return first, room - first, response_len - room


def truncate(
    version: str, payload: Payload, tokens: torch.Tensor, routes: Any, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and routes the release's ``ToolAgentLoop`` hands the trainer for the sample's
    episode under a response budget of ``max_response_len`` tokens."""
    routes = torch.as_tensor(routes)
    check_truncation(tokens, routes, prompt_len, max_response_len)
    if tokens.shape[0] == prompt_len:
        return tokens, routes
    output, _ = episode(version, payload, tokens, routes, prompt_len, max_response_len)
    kept = torch.tensor(list(output.prompt_ids) + list(output.response_ids), dtype=torch.long)
    return kept, torch.as_tensor(np.asarray(output.routed_experts))


def episode(
    version: str, payload: Payload, tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, budget: int
) -> tuple[Any, list[Any]]:
    """Run the sample's episode (at least one response token) through the release's ``ToolAgentLoop``
    with ``rollout.response_length = budget``: its ``AgentLoopOutput``, and the ``TokenOutput`` s of
    the engine calls it made, in order."""
    require_release("verl", version, f"verl-{version}")
    from verl.workers.rollout.replica import TokenOutput

    ids = [int(t) for t in tokens]
    first, tool, last = turns(len(ids) - prompt_len, budget)
    ends = [prompt_len + first] + ([len(ids)] if last else [])
    starts = [prompt_len] + ([prompt_len + first + tool] if last else [])
    calls = [
        (
            ids[:start],
            TokenOutput(
                token_ids=ids[start:end],
                routed_experts=as_payload(routes[: end - 1], payload),
                stop_reason="completed",
            ),
        )
        for start, end in zip(starts, ends, strict=True)
    ]
    engine = _Engine(list(calls))
    tool_ids = [ids[prompt_len + first : prompt_len + first + tool]] if tool else []
    loop = tool_agent_loop(version, engine, ids[:prompt_len], tool_ids, budget)
    output = asyncio.run(loop.run({}, raw_prompt=[{"role": "user", "content": "canned"}]))
    return output, [made for _, made in calls[: len(calls) - len(engine.calls)]]
