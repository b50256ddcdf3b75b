"""verl releases under test (PyPI ``verl`` 0.8.0, 0.9.0, 0.9.1), one ``Subject`` per release line.

Capabilities, each a thin adapter over the release's own code:

- ``splice``: the partial-rollout resume loop, ``FullyAsyncLLMServerClient.generate`` (0.8.0:
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
- ``layouts.place_left_padded``: the agent loop's placement,
  ``AgentLoopWorker._agent_loop_postprocess`` per sample (prompt left-padded to
  ``rollout.prompt_length``, response right-padded to ``rollout.response_length``, the rows written
  from the prompt's first column) and ``_postprocess`` into one batch, driven without Ray on a
  worker holding only what they read (a real transformers tokenizer for ``pad``, no processor, no
  reward workers, no teacher). Each sample's ``len − 1`` rows arrive in the subject's payload type.
  The replay mask is the one the release's Megatron engine applies to that batch: from 0.9.0
  ``build_r3_replay_mask`` (every row of a sample with a response but its last); 0.8.0 has none
  (``set_router_replay_data(…, None, …)`` replays every position, the attention mask).
- ``layouts.pack`` / ``layouts.unplace`` (0.9.1 only): the trainer's no-padding layout,
  ``left_right_2_no_padding`` (``verl/workers/utils/padding.py``) and ``pad_input``
  (``verl/utils/attention_utils.py``). 0.8.0 and 0.9.0 import them from ``flash_attn.bert_padding``,
  a CUDA-only package, so on CPU they are absent (the suite's skip names them); 0.9.1 falls back to
  pure torch. The other layout functions (micro-batches, SP/CP, PP/VPP, EP) are not wrapped.
- ``install_megatron_replay`` / ``megatron_data``: Megatron R2/R3 through
  ``verl/utils/megatron/router_replay_patch.py`` (``apply_router_replay_patch``: on Megatron-core
  0.16.1 verl's own ``RouterReplay`` and ``routing`` on every ``TopKRouter``; the engine's
  RECORD / REPLAY_FORWARD / REPLAY_BACKWARD actions) and ``router_replay_utils.py``
  (``set_router_replay_data``, ``merge_router_topk_indices`` then ``pp_gather``; from 0.9.0 on the
  forwarded model's own routers), fed the jagged batch verl's engine holds. The harness's Megatron
  model takes a padded ``[B, S]`` micro-batch, which is verl's ``bshd`` data format
  (``engine.use_remove_padding=False``); verl's default ``thd`` format packs the model input into
  one sequence, which the harness's Megatron model does not take, so that path is not checked.
  ``align_r3_router_replay_data`` and ``build_r3_replay_mask`` are not called there: the suite's
  traces have a row for every position (R2's replay, which verl also uses), and the R3 mask is
  checked through ``layouts``.
- ``install_hf_replay``: the VeOmni engine's router replay on a transformers model,
  ``VeOmniRouterReplay`` (``verl/utils/veomni/router_replay.py``), driven with the lifecycle of the
  release's ``verl/workers/engine/veomni/transformer_impl.py``. VeOmni itself (its patched
  ``SparseMoeBlock.forward`` calling ``maybe_replay_indices``) is not installed: the harness's
  router hooks are the tap, calling the controller's ``on_router_forward`` with the router's logits
  and top-k and dispatching the ids it returns, with the family's own gate weights at them. Targets
  arrive as the engine hands them over, one slot per decoder layer (dense slots 0), matched to
  routers by fire order. 0.9.1: ``begin_microbatch(targets=…)`` / ``take_recorded`` per forward, no
  replay mask (a row without a target arrives all-zero; the controller routes rows with a repeated
  id natively). 0.8.0 and 0.9.0: ``set_microbatch_targets(per_layer, replay_mask)``,
  ``advance_record_microbatch`` and ``collect_recorded``, the mask passed through. Every family
  the harness builds is tapped; which ones VeOmni wires (at verl #6325: ``qwen3_moe``,
  ``qwen3_5_moe``) depends on the VeOmni build and is not checked.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import types
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal
from unittest import mock

import torch

from harness.subjects import Subject
from harness.subjects.frameworks import check_placement_arguments, require_release
from harness.trainers.hf.replay import HFReplay, find_routers
from reference_impl.layouts import Placed
from reference_impl.routers import RoutingMode
from reference_impl.splice import Attempt

Payload = Literal["numpy", "tensor"]
"""How the engine hands ``routed_experts`` to verl: ``numpy`` (vLLM; SGLang from 0.9.0), ``tensor``
(verl 0.8.0's SGLang path with ``skip_tokenizer_init``)."""


def _client_class(version: str) -> type:
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
    client_cls = _client_class(version)
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


def _as_payload(routes: torch.Tensor | None, payload: Payload) -> Any:
    if routes is None:
        return None
    return routes.numpy().copy() if payload == "numpy" else routes.clone()


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
                    routed_experts=_as_payload(attempt.routes, payload),
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
    client_cls = _client_class(version)
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
            loop = _tool_agent_loop(version, client, prompt_len, tool_tokens, sampling["max_tokens"])
            final = asyncio.run(loop.run(sampling, raw_prompt=[{"role": "user", "content": "canned"}]))
        else:
            final = asyncio.run(
                client.generate("sample", prompt_ids=list(range(prompt_len)), sampling_params=sampling)
            )
    if outputs:
        raise RuntimeError(f"the release's loop stopped with {len(outputs)} attempt(s) not consumed")
    return final.routed_experts


def _tool_agent_loop(
    version: str, server: Any, prompt_len: int, tool_tokens: list[list[int]], response_length: int
) -> Any:
    """The release's ``ToolAgentLoop`` over ``server``, with canned stand-ins for the chat template,
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
            agent_data.prompt_ids = list(range(prompt_len))
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
        full_determinism=False, prompt_length=prompt_len, response_length=response_length
    )
    loop.prompt_length, loop.response_length = prompt_len, response_length
    loop.tools, loop.tool_schemas = {}, []
    loop.tool_parser, loop.tool_parser_name = ToolParser(), "canned"
    loop.max_user_turns = loop.max_assistant_turns = None
    loop.max_parallel_calls = 1
    loop.enable_continuous_token = False  # 0.9.0's default; 0.9.1 has no other path (stand-in above)
    return loop


# --- placement: the agent loop's padded batch, the trainer's no-padding layout -------------------


def _tokenizer() -> Any:
    """A real transformers tokenizer whose pad id is 0: the agent loop pads token ids with its
    ``pad`` (a word-level vocabulary of the pad token alone; ids are never decoded)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")


def _agent_loop_worker(version: str, prompt_width: int, response_width: int) -> Any:
    """The release's ``AgentLoopWorker`` with only what its postprocess reads: a text-only model (no
    processor), no reward workers, no distillation teacher, the rollout's prompt/response widths."""
    require_release("verl", version, f"verl-{version}")
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker: Any = object.__new__(AgentLoopWorker)
    worker.tokenizer = _tokenizer()
    worker.processor = None
    worker.mm_processor_kwargs = None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.rollout_config = types.SimpleNamespace(prompt_length=prompt_width, response_length=response_width)
    return worker


def _r3_replay_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """verl's R3 replay mask (``build_r3_replay_mask``, 0.9.0+) of a padded batch, at its columns.

    The release builds it from the packed (jagged) ``input_ids`` the trainer holds after
    ``left_right_2_no_padding``, reading only each sample's length, and the padded response mask;
    here the jagged tensor holds each sample's attended tokens in order, and the mask's values go
    back to the attended columns they belong to.
    """
    from verl.utils.megatron.router_replay_utils import build_r3_replay_mask

    attended = attention_mask.bool()
    values = build_r3_replay_mask(_jagged(input_ids, attended), response_mask).values()
    mask = torch.zeros_like(attended)
    mask[attended] = values
    return mask


def _jagged(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each sample's attended positions of ``x [B, W, ...]``, in order, as a jagged tensor: the
    form ``left_right_2_no_padding`` gives the trainer's ``input_ids`` and ``routed_experts``."""
    attended = torch.as_tensor(attention_mask).bool()
    return torch.nested.as_nested_tensor(
        [row[keep] for row, keep in zip(torch.as_tensor(x), attended, strict=True)], layout=torch.jagged
    )


def place_left_padded(
    version: str,
    payload: Payload,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """The agent loop's placement of the samples (``_agent_loop_postprocess`` per sample, then
    ``_postprocess`` into one batch), as a ``Placed`` batch of ``width`` columns.

    verl pads the prompt on the left to ``rollout.prompt_length`` and the response on the right to
    ``rollout.response_length``; the widths are the longest prompt and the rest of ``width``.
    Without ``prompt_lens`` each sample's first token is its prompt. Each sample's rows arrive as
    the engine hands them over (``len(tokens) − 1`` rows, the subject's payload type). The replay
    mask is what the release's trainer replays: from 0.9.0 its R3 mask; in 0.8.0, which has no
    mask, every position it is given (the attention mask).
    """
    check_placement_arguments(samples, width, prompt_lens)
    lens = [int(t.shape[0]) for t, _ in samples]
    if prompt_lens is not None and len(prompt_lens) != len(samples):
        raise ValueError(
            f"prompt_lens has {len(prompt_lens)} entries, expected one per sample ({len(samples)})"
        )
    splits = list(prompt_lens) if prompt_lens is not None else [min(1, n) for n in lens]
    prompt_width = max(splits)
    worker = _agent_loop_worker(version, prompt_width, width - prompt_width)
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    padded = []
    for (tokens, routes), split in zip(samples, splits, strict=True):
        output = AgentLoopOutput(
            prompt_ids=tokens[:split].tolist(),
            response_ids=tokens[split:].tolist(),
            response_mask=[1] * (len(tokens) - split),
            routed_experts=_as_payload(routes, payload),
            metrics=AgentLoopMetrics(),
        )
        padded.append(asyncio.run(worker._agent_loop_postprocess(output, False, raw_prompt=None)))
    batch = worker._postprocess(padded).batch
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
    if version == "0.8.0":
        replay_mask = attention_mask.clone()
    else:
        replay_mask = _r3_replay_mask(input_ids, attention_mask, batch["response_mask"])
    response_mask = None
    if prompt_lens is not None:
        response_mask = torch.zeros_like(attention_mask)
        response_mask[:, prompt_width:] = batch["response_mask"].bool()
    return Placed(input_ids, attention_mask, batch["routed_experts"], replay_mask, response_mask)


def _no_padding(
    tokens: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor | None = None
) -> Any:
    """``left_right_2_no_padding`` (``verl/workers/utils/padding.py``) on a padded batch: the
    trainer's conversion to jagged ``input_ids`` (and ``routed_experts``) with the flat ``indices``
    of the real tokens. The response mask it requires is only carried along (its width becomes
    ``max_response_len``), so the attention mask stands in for it."""
    from tensordict import TensorDict
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    mask = torch.as_tensor(attention_mask).long()
    fields = {
        "input_ids": torch.as_tensor(tokens),
        "attention_mask": mask,
        "response_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
    }
    if routes is not None:
        fields["routed_experts"] = torch.as_tensor(routes)
    return left_right_2_no_padding(TensorDict(fields, batch_size=mask.shape[0]))


class _Packing:
    """verl's no-padding layout of a ``[B, W]`` batch (``reference_impl.layouts.Packing``'s members).

    ``gather`` is ``left_right_2_no_padding``: a ``[B, W]`` tensor goes through it as
    ``input_ids``, a ``[B, W, layers, top_k]`` one as ``routed_experts``; ``scatter`` is the
    release's ``pad_input`` (``verl/utils/attention_utils.py``, which fills the padding with zeros)
    at the same ``indices``.
    """

    def __init__(self, attention_mask: torch.Tensor) -> None:
        from verl.utils import tensordict_utils as tu

        self.attention_mask = torch.as_tensor(attention_mask)
        self.batch_shape = tuple(self.attention_mask.shape)
        packed = _no_padding(torch.zeros(self.batch_shape, dtype=torch.long), self.attention_mask)
        self.indices = tu.get_non_tensor_data(data=packed, key="indices", default=None)
        self.cu_seqlens = packed["input_ids"].offsets()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return _no_padding(x, self.attention_mask)["input_ids"].values()
        zeros = torch.zeros(self.batch_shape, dtype=torch.long)
        return _no_padding(zeros, self.attention_mask, routes=x)["routed_experts"].values()

    def scatter(self, y: torch.Tensor, fill: float = 0) -> torch.Tensor:
        from verl.utils.attention_utils import pad_input

        if fill:
            raise ValueError(f"verl's pad_input fills the padding with zeros, not {fill!r}")
        return pad_input(y, self.indices, *self.batch_shape)


class _Layouts:
    """verl's layout functions (only its own; the rest are a skip naming each)."""

    def __init__(self, version: str, payload: Payload) -> None:
        self.version, self.payload = version, payload

    def place_left_padded(self, samples: Any, width: int, prompt_lens: Any = None) -> Placed:
        return place_left_padded(self.version, self.payload, samples, width, prompt_lens)


class _NoPaddingLayouts(_Layouts):
    """From 0.9.1, also the trainer's no-padding layout: ``left_right_2_no_padding`` runs on CPU
    (0.8.0 and 0.9.0 import ``flash_attn.bert_padding``, a CUDA-only package, for it)."""

    def pack(self, attention_mask: torch.Tensor) -> _Packing:
        require_release("verl", self.version, f"verl-{self.version}")
        return _Packing(attention_mask)

    def unplace(self, placed: Placed) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's tokens and rows as the trainer unpads them (jagged ``input_ids`` and
        ``routed_experts``); the row at a sample's last token is the placement's filler, not one of
        its ``len − 1`` rows, and is left out."""
        require_release("verl", self.version, f"verl-{self.version}")
        packed = _no_padding(placed.tokens, placed.attention_mask, routes=placed.routes)
        return [
            (tokens, routes[:-1])
            for tokens, routes in zip(
                packed["input_ids"].unbind(), packed["routed_experts"].unbind(), strict=True
            )
        ]


# --- Megatron R2/R3: router_replay_patch and router_replay_utils --------------------------------


def _replay_utils(version: str, model: Sequence[torch.nn.Module]) -> Any:
    """The release's ``verl/utils/megatron/router_replay_utils.py``, moving data on ``model`` 's
    device: the module picks its device once at import (``get_device_name()``, ``"cuda"`` from
    0.9.0 even without a GPU), which verl's own CPU tests override the same way."""
    require_release("verl", version, f"verl-{version}")
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = next(model[0].parameters()).device.type
    return router_replay_utils


class _MegatronController:
    """The action switch verl's Megatron engine drives: ``RouterReplay`` 's class methods of the
    release's ``router_replay_patch`` (RECORD / REPLAY_FORWARD before the forward, REPLAY_BACKWARD
    before the recompute, indices and actions cleared after the step)."""

    def __init__(self, version: str) -> None:
        require_release("verl", version, f"verl-{version}")
        from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

        self.replay, self.action = RouterReplay, RouterReplayAction

    def record(self) -> None:
        self.replay.set_global_router_replay_action(self.action.RECORD)

    def replay_forward(self) -> None:
        self.replay.set_global_router_replay_action(self.action.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        self.replay.set_global_router_replay_action(self.action.REPLAY_BACKWARD)

    def disarm(self) -> None:
        self.replay.clear_global_indices()
        self.replay.clear_global_router_replay_action()


class _MegatronDriver:
    """verl's Megatron replay: ``apply_router_replay_patch()`` (on Megatron-core 0.16.1 the full patch
    of ``TopKRouter``: verl's ``RouterReplay`` per router, verl's ``routing``) and the flag the
    release's engine sets: 0.8.0 its own ``enable_routing_replay`` (the only one its patched router
    reads), from 0.9.0 Megatron-core's ``moe_enable_routing_replay`` where the config has it."""

    def __init__(self, version: str) -> None:
        self.version = version

    def patch(self) -> None:
        require_release("verl", self.version, f"verl-{self.version}")
        from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

        apply_router_replay_patch()

    def config_overrides(self) -> dict[str, Any]:
        flag = "enable_routing_replay" if self.version == "0.8.0" else "moe_enable_routing_replay"
        return {flag: True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> _MegatronController:
        return _MegatronController(self.version)


class _MegatronData:
    """verl's per-micro-batch data movement: ``set_router_replay_data`` and
    ``merge_router_topk_indices`` on the jagged (no-padding) batch the engine holds.

    Targets go in as verl's R2 replay hands them over (every row, no replay mask): the harness's
    traces have a row for every position, so R3's ``align_r3_router_replay_data`` (a placeholder for
    a missing last row) and ``build_r3_replay_mask`` (which leaves that row native) have nothing to
    do. ``set_router_replay_data`` takes the forwarded ``model`` (and addresses its own routers) from
    0.9.0, ``merge_router_topk_indices`` from 0.9.1; before, both slice verl's registry by position.
    """

    def __init__(self, version: str) -> None:
        self.version = version

    def _scoped(self, model: Sequence[torch.nn.Module], since: str) -> dict[str, Any]:
        """``model=`` for a function that takes it from release ``since`` on."""
        newer = [int(part) for part in self.version.split(".")] >= [int(part) for part in since.split(".")]
        return {"model": list(model)} if newer else {}

    def set_replay_data(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
    ) -> None:
        utils = _replay_utils(self.version, model)
        utils.set_router_replay_data(
            _jagged(routes, attention_mask), None, config, vp_rank, **self._scoped(model, "0.9.0")
        )

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
    ) -> torch.Tensor:
        """``merge_router_topk_indices`` then ``pp_gather``, as verl's R2 RECORD does; the jagged
        routes go back to the attended positions of a ``[B, S, L, top_k]`` batch."""
        utils = _replay_utils(self.version, model)
        attended = torch.as_tensor(attention_mask).bool()
        recorded: list[torch.Tensor] = []
        tokens = _jagged(torch.zeros(attended.shape, dtype=torch.long), attended)
        utils.merge_router_topk_indices(
            None, tokens, recorded, config, vp_rank, **self._scoped(model, "0.9.1")
        )
        jagged = utils.pp_gather(recorded[0], config)
        values = jagged.values()
        merged = torch.zeros((*attended.shape, *values.shape[1:]), dtype=values.dtype)
        merged[attended] = values
        return merged


# --- VeOmni router replay on a transformers model: verl/utils/veomni/router_replay.py -------------


class _VeOmniReplay(HFReplay, abc.ABC):
    """The release's ``VeOmniRouterReplay`` on a transformers model, as verl's VeOmni engine drives it.

    The harness's router hooks (``HFReplay``) stand in for VeOmni's patched ``SparseMoeBlock.forward``:
    where the block has its top-k, they call the controller's ``on_router_forward(module,
    routing_scores, top_indices)`` (the router's logits and chosen ids) and dispatch the ids it
    returns, with the family's gate weights at those ids (VeOmni's per-family post-top-k math). A
    hook before and after each model forward is the engine's per-micro-batch bracket
    (``prepare_model_inputs`` / ``prepare_model_outputs``); ``record`` / ``replay`` are the step's
    ``begin_record`` / ``begin_replay``, ``disarm`` its ``clear``.

    Targets reach the controller as the engine hands them over: the batch's ``routed_experts`` with
    one slot per decoder layer (what the rollout backends fill, FACTS §1 "layer axis"; dense slots
    0), cut per slot (``unbind(dim=1)``). The harness's MoE-ordinal targets go to their decoder
    layers' slots, up to the last MoE layer they cover. Recompute needs no action: verl's controller
    recognises a router it has seen in this micro-batch and replays the same slot.

    It holds one micro-batch's targets: the VeOmni engine (FSDP2, no pipeline parallelism) runs each
    micro-batch's forward and backward before the next, so one forward is in flight
    (``OneForwardInFlight``).
    """

    forwards_in_flight = 1

    def __init__(self, model: torch.nn.Module, routers: list[Any], veomni: Any) -> None:
        super().__init__(model, routers)
        self.veomni = veomni
        self._decoder_targets: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._recordings: list[torch.Tensor] = []  # 0.9.1: take_recorded() of each recorded forward
        self._forwards = 0  # forwards recorded since record()
        self._bracket = [
            model.register_forward_pre_hook(lambda module, args: self._before_forward()),
            model.register_forward_hook(lambda module, args, output: self._after_forward()),
        ]

    def _route(self, r: Any, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """VeOmni's ``maybe_replay_indices``: the controller decides the ids every armed forward uses."""
        return self.veomni.on_router_forward(r.module, logits, ids)

    def _decoder_axis(self, targets: torch.Tensor) -> torch.Tensor:
        """MoE-ordinal ``[tokens, n, top_k]`` targets on the decoder layer axis, dense slots 0."""
        targets = torch.as_tensor(targets).to(torch.int64)
        if targets.ndim != 3 or targets.shape[1] > len(self.moe_layers):
            raise ValueError(
                f"replay targets: shape {list(targets.shape)}, expected [tokens, ≤ {len(self.moe_layers)}, "
                "top_k] (MoE layers)"
            )
        layers = list(self.moe_layers[: targets.shape[1]])
        decoder = targets.new_zeros((targets.shape[0], layers[-1] + 1 if layers else 0, targets.shape[2]))
        decoder[:, layers] = targets
        return decoder

    def record(self) -> None:
        self._reset()
        self.veomni.begin_record()
        self.mode = RoutingMode.RECORD

    def recording(self) -> torch.Tensor:
        routes = self._recorded()
        self.disarm()
        return routes

    def replay(self, targets: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        self._reset()
        self._decoder_targets = self._decoder_axis(targets)
        self._mask = None if mask is None else torch.as_tensor(mask).bool()
        self.veomni.begin_replay()
        self.mode = RoutingMode.REPLAY_FORWARD

    def prepare_backward(self) -> None:
        """Nothing to switch: the controller has no backward action (see the class docstring)."""

    def disarm(self) -> None:
        self.veomni.clear()
        self._reset()
        super().disarm()

    def remove(self) -> None:
        for hook in self._bracket:
            hook.remove()
        super().remove()

    def _reset(self) -> None:
        self._decoder_targets, self._mask, self._recordings, self._forwards = None, None, [], 0

    def _after_forward(self) -> None:
        if self.mode is RoutingMode.RECORD:
            self._forwards += 1
            self._take_recorded()

    @abc.abstractmethod
    def _before_forward(self) -> None:
        """Arm the controller for the next forward (the engine's ``prepare_model_inputs``)."""

    @abc.abstractmethod
    def _take_recorded(self) -> None:
        """After a recorded forward (the engine's ``prepare_model_outputs``)."""

    @abc.abstractmethod
    def _recorded(self) -> torch.Tensor:
        """The ids recorded since ``record()``, ``[tokens, n_moe, top_k]``."""


class _VeOmniReplay091(_VeOmniReplay):
    """0.9.1: ``begin_microbatch(targets=per_layer)`` / ``begin_microbatch()`` before each forward,
    ``take_recorded()`` after it. There is no replay mask: a position without a row reaches the
    controller as an all-zero row (the engine's pad suffix, R3's missing rows), which it routes
    natively because the row repeats an id."""

    def _before_forward(self) -> None:
        if self.mode is RoutingMode.RECORD:
            self.veomni.begin_microbatch()
        elif self._decoder_targets is not None:
            targets = self._decoder_targets
            if self._mask is not None:
                targets = torch.where(self._mask[:, None, None], targets, 0)
            self.veomni.begin_microbatch(targets=list(targets.unbind(dim=1)))

    def _take_recorded(self) -> None:
        self._recordings.append(self.veomni.take_recorded())

    def _recorded(self) -> torch.Tensor:
        return torch.cat(self._recordings)


class _VeOmniReplay080(_VeOmniReplay):
    """0.8.0 and 0.9.0: ``set_microbatch_targets(per_layer, replay_mask=…)`` before each replayed
    forward (targets and mask through the controller's own ``slice_microbatch_replay_*``, no SP
    group), ``advance_record_microbatch()`` between recorded forwards, ``collect_recorded`` at the
    end (no SP padding to trim)."""

    def _before_forward(self) -> None:
        if self.mode is RoutingMode.RECORD and self._forwards:
            self.veomni.advance_record_microbatch()
        elif self.mode is RoutingMode.REPLAY_FORWARD and self._decoder_targets is not None:
            per_layer = self.veomni.slice_microbatch_replay_targets(self._decoder_targets)
            mask = None if self._mask is None else self.veomni.slice_microbatch_replay_mask(self._mask)
            self.veomni.set_microbatch_targets(per_layer, replay_mask=mask)

    def _take_recorded(self) -> None:
        """Nothing per forward: ``collect_recorded`` returns every micro-batch at the end."""

    def _recorded(self) -> torch.Tensor:
        count = self._forwards
        return torch.cat(self.veomni.collect_recorded(pad_size_per_mb=[0] * count, num_micro_batches=count))


class _VeOmniDriver:
    """``install_hf_replay``: a fresh ``VeOmniRouterReplay`` per model behind the harness's router
    hooks (nothing global: VeOmni's ``set_active_replay`` slot is what the hooks replace)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def patch(self) -> None:
        require_release("verl", self.version, f"verl-{self.version}")

    def unpatch(self) -> None:
        """Nothing global to undo."""

    def install(self, model: torch.nn.Module) -> _VeOmniReplay:
        require_release("verl", self.version, f"verl-{self.version}")
        from verl.utils.veomni.router_replay import VeOmniRouterReplay

        cls = _VeOmniReplay091 if self.version == "0.9.1" else _VeOmniReplay080
        handle = cls(model, find_routers(model), VeOmniRouterReplay())
        handle._attach()
        return handle


def _subject(version: str, payload: Payload) -> Subject:
    return Subject(
        name=f"verl-{version} ({'vLLM numpy' if payload == 'numpy' else 'SGLang tensor'} payloads)",
        splice=partial(splice, version, payload),
        layouts=(_NoPaddingLayouts if version == "0.9.1" else _Layouts)(version, payload),
        install_megatron_replay=_MegatronDriver(version),
        megatron_data=_MegatronData(version),
        install_hf_replay=_VeOmniDriver(version),
    )


VERL_0_8_0 = _subject("0.8.0", "numpy")
"""verl 0.8.0 with vLLM (the default backend): payloads are numpy arrays."""
VERL_0_8_0_SGLANG = _subject("0.8.0", "tensor")
"""verl 0.8.0 with SGLang and ``skip_tokenizer_init``: payloads are torch tensors."""
VERL_0_9_0 = _subject("0.9.0", "numpy")
VERL_0_9_1 = _subject("0.9.1", "numpy")
