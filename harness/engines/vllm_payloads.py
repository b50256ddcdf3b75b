"""The installed vLLM's own payloads, as a framework receives them (FACTS §1).

- ``raw_outputs``: the ``RequestOutput`` objects of one offline ``LLM.generate`` call, undecoded:
  ``CompletionOutput.routed_experts`` is the in-process payload (an ndarray on 0.22+; 0.21 splits
  the prompt rows into ``RequestOutput.prompt_routed_experts``).
- ``completion_body``: the ``/v1/completions`` response body the release's own serving code builds
  for such an output — its ``CompletionResponseChoice`` with ``routed_experts`` from its own
  ``numpy2base64``, serialised by its pydantic model — as the bytes a server would send, without
  starting one (the HTTP server itself is exercised in ``conformance/test_engine_http.py``).
- ``payload_rows``: the rows of a raw payload read straight off the array, on the MoE layers, by
  the layer axis FACTS records for the release: the oracle the subject's decoder is judged against.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from harness.conventions import VLLM_0_21, Convention, ModelSpec
from harness.errors import ConventionError
from harness.trace import LayerAxis

__all__ = ["SERVING_MODULES", "completion_body", "in_process_payload", "payload_rows", "raw_outputs"]

SERVING_MODULES = (
    "vllm.entrypoints.openai.completion.serving",  # 0.27+
    "vllm.entrypoints.openai.serving_completion",  # 0.21–0.26
)
"""Where releases keep the completion endpoint's serving code (it imports ``numpy2base64`` and the
response models it fills)."""


def raw_outputs(
    engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int, *, start: int = 0
) -> list[Any]:
    """Greedy ``RequestOutput``\\ s of ``engine`` (a started ``VLLMEngine``) for token-id ``prompts``,
    undecoded (``start``: ``routed_experts_prompt_start``)."""
    from vllm.inputs import TokensPrompt

    params = engine.sampling_params(max_tokens, temperature=0.0, seed=0, start=start)
    prompts_in = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    return list(engine.llm.generate(prompts_in, params, use_tqdm=False))


def in_process_payload(output: Any, conv: Convention) -> Any:
    """What a framework reads off one ``RequestOutput`` (its first completion), exactly as returned."""
    raw = output.outputs[0].routed_experts
    if conv is VLLM_0_21:
        return (getattr(output, "prompt_routed_experts", None), raw)
    return raw


def _serving_module() -> Any:
    for name in SERVING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "numpy2base64") and hasattr(module, "CompletionResponseChoice"):
            return module
    return None


def completion_body(output: Any, *, model_name: str = "rrh") -> bytes | None:
    """The ``/v1/completions`` body the installed release's serving code builds for ``output`` (one
    prompt, its first completion, ``return_token_ids``), as JSON bytes; None when this release has
    no base64 ``routed_experts`` field in its completion response (before 0.22)."""
    serving = _serving_module()
    if serving is None:
        return None
    completion = output.outputs[0]
    raw = completion.routed_experts
    choice = serving.CompletionResponseChoice(
        index=0,
        text="",
        finish_reason=completion.finish_reason,
        token_ids=[int(t) for t in completion.token_ids],
        prompt_token_ids=[int(t) for t in output.prompt_token_ids],
        routed_experts=serving.numpy2base64(raw) if raw is not None else None,
    )
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), len(completion.token_ids)
    response = serving.CompletionResponse(
        model=model_name,
        choices=[choice],
        usage=serving.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
    )
    body = response.model_dump_json()
    json.loads(body)  # the bytes are a JSON document, as a client parses them
    return body.encode()


def payload_rows(payload: Any, conv: Convention, model: ModelSpec) -> np.ndarray:
    """``[rows, num_moe_layers, top_k]`` int64 read off a raw in-process payload: the MoE columns of a
    decoder-axis array, or the array itself on the MoE-ordinal axis (0.21: prompt rows, then generated)."""
    if conv is VLLM_0_21:
        parts = [np.asarray(p) for p in payload if p is not None]
        array = np.concatenate(parts) if parts else np.zeros((0, len(model.moe_layer_tuple), model.top_k))
    else:
        array = np.asarray(payload)
    if array.ndim != 3:
        raise ConventionError(f"{conv.name}: payload has shape {array.shape}, expected [rows, layers, top_k]")
    if conv.layer_axis is LayerAxis.DECODER:
        array = array[:, list(model.moe_layer_tuple)]
    return array.astype(np.int64)
