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
  verl's multi-turn path (``ToolAgentLoop`` keeps each turn's latest payload) is another entry
  point and is not driven here.
"""

from __future__ import annotations

import asyncio
import importlib
import types
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal
from unittest import mock

import torch

from harness.subjects import Subject
from harness.subjects.frameworks import require_release
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


def splice(version: str, payload: Payload, prompt_len: int, attempts: Sequence[Attempt]) -> Any:
    """Run the release's resume loop over canned engine outputs, one per attempt; its routes."""
    client_cls = _client_class(version)
    module: Any = importlib.import_module(client_cls.__module__)
    from verl.workers.rollout.replica import TokenOutput

    outputs, next_token = [], 1
    for index, attempt in enumerate(attempts):
        last = index == len(attempts) - 1
        outputs.append(
            TokenOutput(
                token_ids=list(range(next_token, next_token + attempt.new_tokens)),
                routed_experts=_as_payload(attempt.routes, payload),
                stop_reason=attempt.finish_reason if last else "aborted",
                extra_fields={"global_steps": index},
            )
        )
        next_token += attempt.new_tokens
    client = _canned_client(version, outputs)
    # A budget no schedule reaches: the loop ends on the last attempt's stop reason.
    sampling = {"max_tokens": next_token + 1}
    with mock.patch.object(module, "asyncio", _NoWait()):
        final = asyncio.run(
            client.generate("sample", prompt_ids=list(range(prompt_len)), sampling_params=sampling)
        )
    if outputs:
        raise RuntimeError(f"the release's loop stopped with {len(outputs)} attempt(s) not consumed")
    return final.routed_experts


def _subject(version: str, payload: Payload) -> Subject:
    return Subject(
        name=f"verl-{version} ({'vLLM numpy' if payload == 'numpy' else 'SGLang tensor'} payloads)",
        splice=partial(splice, version, payload),
    )


VERL_0_8_0 = _subject("0.8.0", "numpy")
"""verl 0.8.0 with vLLM (the default backend): payloads are numpy arrays."""
VERL_0_8_0_SGLANG = _subject("0.8.0", "tensor")
"""verl 0.8.0 with SGLang and ``skip_tokenizer_init``: payloads are torch tensors."""
VERL_0_9_0 = _subject("0.9.0", "numpy")
VERL_0_9_1 = _subject("0.9.1", "numpy")
