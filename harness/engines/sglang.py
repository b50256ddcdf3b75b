"""SGLang as the inference engine: offline rollouts that return canonical routing traces (FACTS §1).

``SGLangEngine(checkpoint)`` starts ``sglang.Engine(model_path=dir, enable_return_routed_experts=True,
skip_tokenizer_init=True, …)`` on the harness's tiny checkpoint and generates from token ids with
``return_routed_experts=True`` per request; ``meta_info["routed_experts"]`` (base64 of raw
little-endian int32, ``seqlen − 1 − routed_experts_start_len`` rows, decoder-index axis) is decoded
with the convention of the installed SGLang (``resolve("sglang", installed_version())``). Without
the server flag SGLang silently returns nothing; here that is a ``ConventionError`` (payload None).

SGLang is imported lazily: importing this module never needs it; ``SGLangEngine`` raises
``EngineUnavailable`` naming what is missing. ``decode_generate_output`` is the pure decoding step.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from harness.conventions import Convention, ModelSpec
from harness.engines import installed
from harness.engines.checkpoint import EngineRollout, TinyCheckpoint
from harness.errors import ConventionError

ENGINE = "sglang"


def installed_version() -> str | None:
    """The installed SGLang's version, or None when it is not installed."""
    return installed.installed_version(ENGINE)


def convention(version: str | None = None) -> Convention:
    """The convention of ``version`` (default: the installed SGLang); ``ConventionError`` if none."""
    return installed.installed_convention(ENGINE, version)


def _logprobs(meta: Mapping[str, Any], tokens: Sequence[int]) -> tuple[float, ...] | None:
    """``meta_info["output_token_logprobs"]``: ``(logprob, token_id, text)`` per generated token."""
    entries = meta.get("output_token_logprobs")
    if entries is None:
        return None
    if len(entries) != len(tokens):
        raise ConventionError(
            f"sglang: meta_info.output_token_logprobs has {len(entries)} entries, expected "
            f"{len(tokens)} (one per output id)"
        )
    out = []
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        logprob, token_id = entry[0], entry[1]
        if token_id is not None and int(token_id) != int(token):
            raise ConventionError(
                f"sglang: meta_info.output_token_logprobs[{position}] is for token {token_id}, "
                f"expected the output id {token}"
            )
        out.append(float(logprob))
    return tuple(out)


def decode_generate_output(
    output: Mapping[str, Any],
    prompt: Sequence[int],
    *,
    conv: Convention,
    model: ModelSpec,
    version: str,
    start: int = 0,
) -> EngineRollout:
    """One ``Engine.generate`` / ``/generate`` result (``output_ids``, ``meta_info``) as an ``EngineRollout``.

    ``meta_info["prompt_tokens"]`` and ``["completion_tokens"]`` must match the prompt and
    ``output_ids``; the routes are ``meta_info["routed_experts"]`` decoded by ``conv``.
    """
    if conv.engine != ENGINE:
        raise ConventionError(f"convention: {conv.name} is not an SGLang convention")
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        raise ConventionError("sglang: meta_info: missing; expected the request's meta_info dict")
    tokens = tuple(int(t) for t in output.get("output_ids", ()))
    prompt = tuple(int(t) for t in prompt)
    for key, want in (("prompt_tokens", len(prompt)), ("completion_tokens", len(tokens))):
        if key in meta and int(meta[key]) != want:
            raise ConventionError(f"sglang: meta_info.{key} = {meta[key]}, expected {want}")
    if "routed_experts" not in meta:
        raise ConventionError(
            'sglang: meta_info["routed_experts"]: absent; expected routed experts (start the engine with '
            "enable_return_routed_experts=True and send return_routed_experts=True: without the server "
            "flag SGLang silently returns nothing)"
        )
    trace = conv.decode(
        meta["routed_experts"],
        model=model,
        prompt_len=len(prompt),
        response_len=len(tokens),
        start=start,
        version=version,
    )
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, Mapping) else finish
    cached = meta.get("cached_tokens")
    return EngineRollout(
        prompt,
        tokens,
        _logprobs(meta, tokens),
        trace,
        str(reason or "abort"),
        "int32",
        None if cached is None else int(cached),
    )


class SGLangEngine:
    """Offline SGLang (``sglang.Engine``) on a harness checkpoint, returning canonical traces.

    Args:
        checkpoint: the model (``write_checkpoint``).
        version: the SGLang version whose convention decodes payloads (default: the installed one).
        seed: ``random_seed`` of the engine.
        disable_radix_cache: turn the prefix cache off (on by default, as in production).
        chunked_prefill_size: tokens per prefill chunk (a longer prompt is prefilled in chunks).
        engine_kwargs: further ``sglang.Engine`` server arguments.
    """

    name = ENGINE

    def __init__(
        self,
        checkpoint: TinyCheckpoint,
        *,
        version: str | None = None,
        seed: int = 0,
        disable_radix_cache: bool = False,
        chunked_prefill_size: int | None = 64,
        mem_fraction_static: float = 0.3,
        **engine_kwargs: Any,
    ) -> None:
        self.version = version or installed_version() or ""
        self.convention = convention(self.version or None)  # refuse unknown versions before starting
        sglang = installed.import_engine(ENGINE)
        self.checkpoint = checkpoint
        kwargs: dict[str, Any] = dict(
            model_path=str(checkpoint.path),
            enable_return_routed_experts=True,
            skip_tokenizer_init=True,
            random_seed=seed,
            dtype=checkpoint.dtype,
            mem_fraction_static=mem_fraction_static,
            disable_radix_cache=disable_radix_cache,
            log_level="error",
        )
        if chunked_prefill_size is not None:
            kwargs["chunked_prefill_size"] = chunked_prefill_size
        kwargs.update(engine_kwargs)
        self.engine = sglang.Engine(**kwargs)
        self._has_start = "routed_experts_start_len" in inspect.signature(self.engine.generate).parameters
        try:
            from sglang.srt.sampling.sampling_params import SamplingParams

            self._has_seed = "sampling_seed" in inspect.signature(SamplingParams).parameters
        except (ImportError, TypeError, ValueError):
            self._has_seed = False

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = 0,
        start: int = 0,
    ) -> list[EngineRollout]:
        """Generate ``max_tokens`` after each prompt (token ids); greedy by default."""
        sampling: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
        }
        if seed is not None and temperature > 0 and self._has_seed:
            sampling["sampling_seed"] = seed  # per-request seed, where this SGLang has one
        extra: dict[str, Any] = {}
        if start:
            if not self._has_start:
                raise ConventionError(
                    f"sglang {self.version}: start: Engine.generate has no routed_experts_start_len; "
                    f"expected start 0, got {start}"
                )
            extra["routed_experts_start_len"] = start
        ids = [[int(t) for t in p] for p in prompts]
        outputs = self.engine.generate(
            input_ids=ids, sampling_params=sampling, return_logprob=True, return_routed_experts=True, **extra
        )
        if isinstance(outputs, Mapping):
            outputs = [outputs]
        return [
            decode_generate_output(
                o, p, conv=self.convention, model=self.checkpoint.spec, version=self.version, start=start
            )
            for o, p in zip(outputs, ids, strict=True)
        ]

    def generate_one(self, context: Sequence[int], max_tokens: int) -> EngineRollout:
        """One engine call: the ``generate`` of ``reference_impl.episode.run_episode``, which plays an
        abort/resume or multi-turn ``Schedule`` through this engine (``checkpoint.spliced_trace``)."""
        return self.generate([context], max_tokens)[0]

    def close(self) -> None:
        """Shut the engine (its scheduler and detokenizer processes) down."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
