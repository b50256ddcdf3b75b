"""The engines' HTTP payloads: request bodies that ask for routed experts, and response decoders.

- vLLM (OpenAI ``/v1/completions``): ``choices[i].routed_experts`` is base64 of an ``np.save`` .npy
  on 0.22–0.26 (``vllm_completion_trace``); 0.21 sends nested int lists, prompt rows at the response
  level (``prompt_routed_experts``); 0.14–0.20 send nothing over HTTP. The server needs
  ``--enable-return-routed-experts`` (no per-request switch).
- SGLang: ``/generate`` → ``meta_info["routed_experts"]`` (``sglang_generate_trace``); OpenAI
  endpoints → response-level ``sglext.routed_experts`` (``sglang_openai_trace``); both base64 of
  raw little-endian int32. The request needs ``return_routed_experts: true`` and the server
  ``--enable-return-routed-experts``.

Every decoder takes the parsed JSON (a dict) and returns a canonical ``RoutingTrace`` through the
conventions registry; a missing field is a ``ConventionError`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.conventions import ModelSpec, decode_sglang_meta, decode_vllm_021, decode_vllm_http, resolve
from harness.errors import ConventionError
from harness.trace import RoutingTrace

__all__ = [
    "sglang_generate_request",
    "sglang_generate_trace",
    "sglang_openai_trace",
    "vllm_completion_request",
    "vllm_completion_trace",
]


def _get(mapping: object, key: str | int, where: str) -> Any:
    try:
        return mapping[key]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        raise ConventionError(f"{where}: missing; expected it in the response") from None


def _count(mapping: object, key: str, where: str) -> int:
    """A token count of the response: a JSON integer ≥ 0, never coerced.

    ``null``, ``"5"``, ``true``, ``1.9``, NaN or Infinity are a ``ConventionError`` naming the
    field (a bare ``int()`` would turn ``"5"`` into 5 and ``1.9`` into 1, or raise a foreign error).
    """
    value = _get(mapping, key, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConventionError(f"{where}: expected a non-negative integer, got {value!r:.80}")
    return value


def _token_count(token_ids: object, where: str) -> int:
    """``len(token_ids)`` of a JSON list of token ids (integers ≥ 0); anything else is a
    ``ConventionError`` naming the entry (``["a", null]`` is no list of two tokens)."""
    if not isinstance(token_ids, list):
        raise ConventionError(f"{where}: expected a list of token ids, got {type(token_ids).__name__}")
    for i, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConventionError(f"{where}[{i}]: expected a token id (an integer >= 0), got {token!r:.80}")
    return len(token_ids)


def _prompt_count(mapping: object, key: str, where: str) -> int:
    """A prompt's token count: a JSON integer ≥ 1 (an engine never serves an empty prompt)."""
    count = _count(mapping, key, where)
    if count < 1:
        raise ConventionError(f"{where}: expected at least 1 prompt token, got {count}")
    return count


def _same_count(mapping: object, key: str, where: str, expected: int, what: str) -> None:
    """A count the response also gives (``usage``) agrees with the one read elsewhere, when present."""
    if isinstance(mapping, Mapping) and key in mapping:
        given = _count(mapping, key, where)
        if given != expected:
            raise ConventionError(f"{where}: {given}, but {what} says {expected}; expected one count")


# --- vLLM ----------------------------------------------------------------------------------------


def vllm_completion_request(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    start: int = 0,
    **extra: Any,
) -> dict[str, Any]:
    """A ``/v1/completions`` body from token ids that also returns the sampled token ids and log-probs.

    ``return_tokens_as_token_ids`` lets a server started with ``--skip-tokenizer-init`` (no tokenizer,
    as the harness's checkpoints have none) return log-probs: without it vLLM answers 400 "Unable to
    get tokenizer".
    """
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt_token_ids],
        "max_tokens": int(max_tokens),
        "temperature": temperature,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if start:
        body["routed_experts_prompt_start"] = int(start)
    body.update(extra)
    return body


def vllm_completion_trace(
    response: Mapping[str, Any],
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int | None = None,
    index: int = 0,
    start: int = 0,
    version: str | None = None,
) -> RoutingTrace:
    """``choices[index].routed_experts`` of a vLLM completion response as a canonical trace.

    ``response_len`` defaults to ``len(choices[index].token_ids)`` (``return_token_ids``) or, for a
    single choice, ``usage.completion_tokens``. ``version`` is the server's vLLM version (None:
    0.22–0.26, base64 .npy); 0.21's nested lists are read with the response-level
    ``prompt_routed_experts``.

    ``choices`` must be a JSON array and ``choices[index]`` an object: anything else (``"3"``,
    ``7``, ``null``, ``[5]``) is a ``ConventionError``, not read as "no routed experts" — which
    0.21 accepts when no generated rows are expected.
    """
    choices = _get(response, "choices", "choices")
    if not isinstance(choices, list):
        raise ConventionError(
            f"choices: expected a list of choice objects, got {type(choices).__name__} {choices!r:.80}"
        )
    choice = _get(choices, index, f"choices[{index}]")
    if not isinstance(choice, Mapping):
        raise ConventionError(
            f"choices[{index}]: expected an object (a completion choice), "
            f"got {type(choice).__name__} {choice!r:.80}"
        )
    usage = response.get("usage")
    if len(choices) == 1:  # usage counts every choice: compared only when there is one
        _same_count(usage, "prompt_tokens", "usage.prompt_tokens", prompt_len, "prompt_len")
    if choice.get("prompt_token_ids") is not None:
        given = _token_count(choice["prompt_token_ids"], f"choices[{index}].prompt_token_ids")
        if given != prompt_len:
            raise ConventionError(
                f"choices[{index}].prompt_token_ids: {given} tokens, but prompt_len is {prompt_len}; "
                "expected one count"
            )
    if choice.get("token_ids") is not None:
        generated = _token_count(choice["token_ids"], f"choices[{index}].token_ids")
        if len(choices) == 1:
            _same_count(usage, "completion_tokens", "usage.completion_tokens", generated,
                        f"choices[{index}].token_ids")  # fmt: skip
        if response_len is not None and response_len != generated:
            raise ConventionError(
                f"choices[{index}].token_ids: {generated} tokens, but response_len is {response_len}; "
                "expected one count"
            )
    if response_len is None:
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            response_len = _token_count(token_ids, f"choices[{index}].token_ids")
        elif len(choices) == 1:
            response_len = _count(
                _get(response, "usage", "usage"), "completion_tokens", "usage.completion_tokens"
            )
        else:
            raise ConventionError(
                f"choices[{index}].token_ids: missing; expected it (request return_token_ids) or response_len"
            )
    field = choice.get("routed_experts")
    if version is not None and resolve("vllm", version).name == "vllm-0.21":
        prompt_rows = response.get("prompt_routed_experts")
        if start:
            raise ConventionError(f"vllm {version}: start: 0.21 has no prompt skip; expected 0, got {start}")
        return decode_vllm_021(
            prompt_rows, field, model=model, prompt_len=prompt_len, response_len=response_len, version=version
        )
    return decode_vllm_http(
        field, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version
    )


# --- SGLang --------------------------------------------------------------------------------------


def sglang_generate_request(
    input_ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0, start: int = 0, **extra: Any
) -> dict[str, Any]:
    """A ``/generate`` body from token ids that returns routed experts and log-probs."""
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {
            "max_new_tokens": int(max_new_tokens),
            "temperature": temperature,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "return_routed_experts": True,
    }
    if start:
        body["routed_experts_start_len"] = int(start)
    body.update(extra)
    return body


def sglang_generate_trace(
    response: Mapping[str, Any], *, model: ModelSpec, start: int = 0, version: str | None = None
) -> RoutingTrace:
    """``meta_info["routed_experts"]`` of a ``/generate`` response; lengths from ``meta_info``
    (``prompt_tokens``, ``completion_tokens``)."""
    meta = _get(response, "meta_info", "meta_info")
    payload = _get(meta, "routed_experts", 'meta_info["routed_experts"]')
    prompt_len = _prompt_count(meta, "prompt_tokens", "meta_info.prompt_tokens")
    response_len = _count(meta, "completion_tokens", "meta_info.completion_tokens")
    return decode_sglang_meta(
        payload, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version
    )


def sglang_openai_trace(
    response: Mapping[str, Any], *, model: ModelSpec, start: int = 0, version: str | None = None
) -> RoutingTrace:
    """Response-level ``sglext.routed_experts`` of an SGLang OpenAI-endpoint response (one choice);
    lengths from ``usage``."""
    sglext = _get(response, "sglext", "sglext")
    payload = _get(sglext, "routed_experts", "sglext.routed_experts")
    choices = response.get("choices")
    if choices is not None and not (isinstance(choices, list) and len(choices) == 1):
        got = f"{len(choices)} choices" if isinstance(choices, list) else type(choices).__name__
        raise ConventionError(
            f"choices: {got}; expected one choice (sglext.routed_experts is the response's, of one sample)"
        )
    usage = _get(response, "usage", "usage")
    prompt_len = _prompt_count(usage, "prompt_tokens", "usage.prompt_tokens")
    response_len = _count(usage, "completion_tokens", "usage.completion_tokens")
    return decode_sglang_meta(
        payload, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version
    )
