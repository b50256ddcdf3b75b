"""``splice``: the partial-rollout resume loop, ``FullyAsyncLLMServerClient.generate`` (0.8.0:
``verl/experimental/fully_async_policy/fully_async_rollouter.py``, merging with ``torch.cat``;
0.9.x: ``verl/workers/rollout/llm_server.py``, merging with ``np.concatenate``, verl #6029). The
loop runs as released, without Ray; only the base client's ``generate`` (the HTTP call to the
engine server) is replaced by canned ``TokenOutput``s, one per attempt, whose ``routed_experts``
have the type that release's backend puts there: a numpy array from vLLM
(``CompletionOutput.routed_experts``, passed through by ``vllm_async_server.py``), a torch tensor
from 0.8.0's SGLang path with ``skip_tokenizer_init`` (``meta_info["routed_experts"]`` passed
through; 0.9.x calls ``.numpy()`` on it), ``None`` for an attempt the engine returned nothing for.
Every attempt but the last reports ``stop_reason="aborted"``, so the release's own loop resumes
through all of them (a resumed attempt's tool tokens arrive as the engine's new tokens).
A schedule with more than one turn (an engine call after one that ended: verl resumes every
aborted call) runs through the release's multi-turn entry point instead: ``ToolAgentLoop.run``
(``verl/experimental/agent_loop/tool_agent_loop.py``),
its state machine and its ``_handle_generating_state`` as released, with the same resume loop as
its ``server_manager`` (fully-async mode), so each turn's aborted attempts resume inside it. What
stands in for outside services: the chat template (the prompt is the schedule's ``P`` token ids),
the tool parser (a tool call after every turn but the last) and the tool step (the turn's tool
tokens appended to the context, masked out of the response, one user turn: what the release's
``_handle_processing_tools_state`` does with a tool response; a turn that generates nothing
gets its tool tokens from the engine call instead, since a call returns no token only when
aborted). 0.9.0 runs with Continuous Token off, its default; 0.9.1 has only that path, and its
merge of the assistant's tokens is the plain concatenation it performs for token-exact ids.
"""

from __future__ import annotations

import asyncio
import importlib
import types
from collections.abc import Sequence
from typing import Any
from unittest import mock

from harness.subjects.frameworks import require_release
from harness.subjects.frameworks.verl.payload import Payload, as_payload
from reference_impl.splice import Attempt


def client_class(version: str) -> type:
    """The release's ``FullyAsyncLLMServerClient`` (imported here: verl is optional)."""
    require_release("verl", version, f"verl-{version}")
    if version == "0.8.0":
        from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerClient
    else:
        from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient
    return FullyAsyncLLMServerClient


def _canned_client(version: str, outputs: list[Any]) -> Any:
    """A ``FullyAsyncLLMServerClient`` whose base ``generate`` (the engine call) pops ``outputs``.

    The canned base sits between the release's class and its own base in the MRO, so the release's
    ``super().generate(...)`` reaches it and nothing of the release is patched.
    """
    client_cls = client_class(version)
    base = client_cls.__mro__[1]

    async def engine_call(self: Any, request_id: Any, **kwargs: Any) -> Any:
        return outputs.pop(0)

    canned_base = type("CannedEngine", (base,), {"generate": engine_call})
    driver_cls = type("CannedFullyAsyncClient", (client_cls, canned_base), {})
    client: Any = object.__new__(driver_cls)
    # The only config the loop reads: resume aborted attempts (partial rollout on).
    client.config = types.SimpleNamespace(async_training=types.SimpleNamespace(partial_rollout=True))
    return client


class _NoWait:
    """``asyncio`` for the release's module with a zero back-off: the loop sleeps 1 s between
    attempts (a pause for the server, no part of the splice)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(delay: float, result: Any = None) -> Any:
        return result


def _turns(attempts: Sequence[Attempt]) -> list[list[Attempt]]:
    """The schedule's engine calls grouped by the turn verl runs them in: verl resumes every aborted
    call (partial rollout), so a call after an aborted one continues its turn whatever the schedule
    calls it; a new turn starts after a call that ended (``"stop"`` or ``"length"``)."""
    turns: list[list[Attempt]] = []
    for attempt in attempts:
        if not turns or turns[-1][-1].finish_reason != "abort":
            turns.append([])
        turns[-1].append(attempt)
    return turns


def _engine_outputs(payload: Payload, turns: list[list[Attempt]], engine_tokens: Any) -> list[Any]:
    """One canned ``TokenOutput`` per engine call: every call of a turn but its last aborted (so the
    release's loop resumes it), the last ending as the schedule says; ``engine_tokens(attempt)`` are
    the token ids the engine returns for that call."""
    from verl.workers.rollout.replica import TokenOutput

    outputs: list[Any] = []
    for turn in turns:
        for index, attempt in enumerate(turn):
            outputs.append(
                TokenOutput(
                    token_ids=engine_tokens(attempt),
                    routed_experts=as_payload(attempt.routes, payload),
                    stop_reason=attempt.finish_reason if index == len(turn) - 1 else "aborted",
                    extra_fields={"global_steps": len(outputs)},
                )
            )
    return outputs


def _token_ids(start: int) -> Any:
    """Fresh token ids ``start, start + 1, …``: ``take(n)`` hands out the next ``n``."""
    counter = iter(range(start, 1 << 30))

    def take(n: int) -> list[int]:
        return [next(counter) for _ in range(n)]

    return take


def splice(version: str, payload: Payload, prompt_len: int, attempts: Sequence[Attempt]) -> Any:
    """Run the release's resume loop (or, with new turns, its multi-turn agent loop around it) over
    canned engine outputs, one per attempt; the routes it keeps."""
    client_cls = client_class(version)
    module: Any = importlib.import_module(client_cls.__module__)
    turns, take = _turns(attempts), _token_ids(prompt_len)
    multi_turn = len(turns) > 1
    # In the agent loop a new turn's tool tokens come from the tool step, the engine returns the
    # rest. A turn whose engine calls generate nothing delivers them as the engine's tokens instead:
    # an engine call that returns no token is an aborted one, which verl always resumes.
    # (by position in the schedule: a schedule may hold the same Attempt object twice)
    by_tool_step = [any(a.new_tokens > a.tool_tokens for a in turn) for turn in turns[1:]]
    tool_tokens = [
        take(t[0].tool_tokens if own else 0) for t, own in zip(turns[1:], by_tool_step, strict=True)
    ]
    engine_tokens = iter(
        [
            take(a.new_tokens - (a.tool_tokens if j == 0 and t > 0 and by_tool_step[t - 1] else 0))
            for t, turn in enumerate(turns)
            for j, a in enumerate(turn)
        ]
    )
    # _engine_outputs walks the calls in schedule order, the order these were handed out in
    outputs = _engine_outputs(payload, turns, lambda attempt: next(engine_tokens))
    client = _canned_client(version, outputs)
    # A budget no schedule reaches: the loop ends on the last attempt's stop reason.
    sampling = {"max_tokens": prompt_len + sum(a.new_tokens for a in attempts) + 1}
    with mock.patch.object(module, "asyncio", _NoWait()):
        if multi_turn:
            loop = tool_agent_loop(
                version, client, list(range(prompt_len)), tool_tokens, sampling["max_tokens"]
            )
            final = asyncio.run(loop.run(sampling, raw_prompt=[{"role": "user", "content": "canned"}]))
        else:
            final = asyncio.run(
                client.generate("sample", prompt_ids=list(range(prompt_len)), sampling_params=sampling)
            )
    if outputs:
        raise RuntimeError(f"the release's loop stopped with {len(outputs)} attempt(s) not consumed")
    return final.routed_experts


def tool_agent_loop(
    version: str, server: Any, prompt_ids: list[int], tool_tokens: list[list[int]], response_length: int
) -> Any:
    """The release's ``ToolAgentLoop`` over ``server`` with ``rollout.response_length``
    ``response_length``, with canned stand-ins for the chat template (the prompt is ``prompt_ids``),
    the tool parser and the tool step (module docstring); ``tool_tokens[j]`` open turn ``j + 1``."""
    from verl.experimental.agent_loop.tool_agent_loop import AgentState, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    pending = list(tool_tokens)

    class ToolParser:
        stop_token_ids: tuple[int, ...] = ()  # none added: each turn ends where the schedule says

        @staticmethod
        async def extract_tool_calls(response_ids: list[int], tools: Any) -> tuple[str, list[Any]]:
            return "", [FunctionCall(name="tool", arguments="{}")] if pending else []

    class CannedToolAgentLoop(ToolAgentLoop):  # type: ignore[misc, valid-type]
        async def _handle_pending_state(self, agent_data: Any, sampling_params: Any) -> Any:
            agent_data.prompt_ids = list(prompt_ids)
            return AgentState.GENERATING

        async def _handle_processing_tools_state(self, agent_data: Any) -> Any:
            tokens = pending.pop(0)
            agent_data.prompt_ids += tokens
            agent_data.response_mask += [0] * len(tokens)
            agent_data.user_turns += 1
            return AgentState.GENERATING

        async def ct_merge_assistant_token(
            self,
            runtime_token_ids: list[int],
            assistant_token_ids: list[int],
            response_mask: list[int],
            response_logprobs: Any = None,
            assistant_logprobs: Any = None,
        ) -> tuple[Any, list[int], Any]:
            merged = types.SimpleNamespace(token_ids=runtime_token_ids + assistant_token_ids)
            return merged, response_mask + [1] * len(assistant_token_ids), response_logprobs

    loop: Any = object.__new__(CannedToolAgentLoop)
    loop.server_manager = server
    loop.processor = None
    loop.mm_processor_kwargs = None
    loop.rollout_config = types.SimpleNamespace(
        full_determinism=False, prompt_length=len(prompt_ids), response_length=response_length
    )
    loop.prompt_length, loop.response_length = len(prompt_ids), response_length
    loop.tools, loop.tool_schemas = {}, []
    loop.tool_parser, loop.tool_parser_name = ToolParser(), "canned"
    loop.max_user_turns = loop.max_assistant_turns = None
    loop.max_parallel_calls = 1
    loop.enable_continuous_token = False  # 0.9.0's default; 0.9.1 has no other path (stand-in above)
    return loop
