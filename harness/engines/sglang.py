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
import os
import uuid
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


CPU_KV_TOKENS = 4096
"""The KV pool on a CPU, in tokens: ample for the harness's requests (the longest batch holds ~1,000
tokens). Left to SGLang, the pool is sized from the machine's memory: the scheduler held 10 GB of a
24 GB machine for the tiny checkpoint."""


def refuse_dense_layers(checkpoint: TinyCheckpoint, version: str) -> None:
    """``ConventionError`` for a Qwen3-MoE checkpoint with dense layers (``mlp_only_layers``).

    SGLang's ``Qwen3MoeForCausalLM`` (``sglang/srt/models/qwen3_moe.py``, 0.5.23) reads neither
    ``mlp_only_layers`` nor ``decoder_sparse_step``: it builds every layer as MoE, the dense layer's
    MLP weights load into nothing and its experts stay uninitialised. Observed here: NaN log-probs,
    token 0 every step, the same four experts on every row, and no error or warning from SGLang."""
    spec = checkpoint.spec
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layer_tuple]
    if dense:
        raise ConventionError(
            f"sglang {version}: checkpoint: dense layers {dense} (mlp_only_layers); expected every layer "
            "MoE: SGLang's Qwen3MoeForCausalLM builds every layer as MoE and leaves a dense layer's "
            "experts uninitialised (NaN log-probs); write it with mlp_only_layers=[]"
        )


class SGLangEngine:
    """Real SGLang (``sglang.Engine``, in process; its scheduler and detokenizer are child processes)
    on a harness checkpoint, returning canonical traces.

    On a CPU (no CUDA device) it runs SGLang's CPU engine mode with the ``torch_native`` attention
    backend (on an AMX host SGLang would default to ``intel_amx``, whose kernels nobody ships) and no
    CUDA graphs; ``harness.engines.sglang_cpu`` says what else that needs.

    Args:
        checkpoint: the model (``write_checkpoint``).
        version: the SGLang version whose convention decodes payloads (default: the installed one).
        seed: ``random_seed`` of the engine.
        disable_radix_cache: turn the prefix cache off (on by default, as in production).
        chunked_prefill_size: tokens per prefill chunk (a longer prompt is prefilled in chunks).
        max_total_tokens: the KV pool's size in tokens (None: ``CPU_KV_TOKENS`` on a CPU, SGLang's own
            sizing on a GPU); a tiny pool makes the scheduler retract (preempt) running requests.
        engine_kwargs: further ``sglang.Engine`` server arguments.
    """

    name = ENGINE
    checkpoint_overrides: Mapping[str, Any] = {"mlp_only_layers": []}
    """``write_checkpoint`` overrides of a checkpoint this engine serves correctly: every layer MoE
    (see ``refuse_dense_layers``)."""

    def __init__(
        self,
        checkpoint: TinyCheckpoint,
        *,
        version: str | None = None,
        seed: int = 0,
        disable_radix_cache: bool = False,
        chunked_prefill_size: int | None = 64,
        max_total_tokens: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.version = version or installed_version() or ""
        self.convention = convention(self.version or None)  # refuse unknown versions before starting
        sglang = installed.import_engine(ENGINE)
        refuse_dense_layers(checkpoint, self.version)
        self.checkpoint = checkpoint
        self._retractions = 0
        kwargs: dict[str, Any] = dict(
            model_path=str(checkpoint.path),
            enable_return_routed_experts=True,
            skip_tokenizer_init=True,
            random_seed=seed,
            dtype=checkpoint.dtype,
            disable_radix_cache=disable_radix_cache,
            log_level="error",
        )
        if installed.on_cpu():
            kwargs |= dict(
                device="cpu",
                attention_backend="torch_native",
                disable_cuda_graph=True,
                skip_server_warmup=True,
                max_total_tokens=CPU_KV_TOKENS,
            )
        else:
            kwargs["mem_fraction_static"] = 0.3
        if chunked_prefill_size is not None:
            kwargs["chunked_prefill_size"] = chunked_prefill_size
        if max_total_tokens is not None:
            kwargs["max_total_tokens"] = max_total_tokens
        kwargs.update(engine_kwargs)
        self.engine = sglang.Engine(**kwargs)
        self._has_start = "routed_experts_start_len" in inspect.signature(self.engine.generate).parameters
        try:
            from sglang.srt.sampling.sampling_params import SamplingParams

            self._has_seed = "sampling_seed" in inspect.signature(SamplingParams).parameters
        except (ImportError, TypeError, ValueError):
            self._has_seed = False

    def _sampling(self, max_tokens: int, temperature: float, seed: int | None, n: int = 1) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
        }
        if n != 1:
            sampling["n"] = n
        if seed is not None and temperature > 0 and self._has_seed:
            sampling["sampling_seed"] = seed  # per-request seed, where this SGLang has one
        return sampling

    def _start(self, start: int) -> dict[str, Any]:
        if not start:
            return {}
        if not self._has_start:
            raise ConventionError(
                f"sglang {self.version}: start: Engine.generate has no routed_experts_start_len; "
                f"expected start 0, got {start}"
            )
        return {"routed_experts_start_len": start}

    def _decode(self, output: Mapping[str, Any], prompt: Sequence[int], start: int = 0) -> EngineRollout:
        meta = output.get("meta_info")
        if isinstance(meta, Mapping):
            self._retractions += int(meta.get("num_retractions") or 0)
        return decode_generate_output(
            output,
            prompt,
            conv=self.convention,
            model=self.checkpoint.spec,
            version=self.version,
            start=start,
        )

    def raw_outputs(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = 0,
        start: int = 0,
        n: int = 1,
    ) -> list[Mapping[str, Any]]:
        """What ``Engine.generate`` returns for ``prompts`` (token ids) as the release builds it: one
        ``{"output_ids", "meta_info"}`` per sample, the ``n`` of a prompt next to each other."""
        outputs = self.engine.generate(
            input_ids=[[int(t) for t in p] for p in prompts],
            sampling_params=self._sampling(max_tokens, temperature, seed, n=n),
            return_logprob=True,
            return_routed_experts=True,
            **self._start(start),
        )
        outputs = [outputs] if isinstance(outputs, Mapping) else list(outputs)
        if len(outputs) != n * len(prompts):
            raise ConventionError(
                f"sglang: generate with n = {n} returned {len(outputs)} outputs, expected n × prompts = "
                f"{n * len(prompts)}"
            )
        return outputs

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
        outputs = self.raw_outputs(prompts, max_tokens, temperature=temperature, seed=seed, start=start)
        return [self._decode(o, p, start) for o, p in zip(outputs, prompts, strict=True)]

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        seed: int | None = 0,
        start: int = 0,
    ) -> list[list[EngineRollout]]:
        """``n`` samples per prompt (SGLang's sampling parameter ``n``), all prompts in one batch."""
        outputs = self.raw_outputs(prompts, max_tokens, temperature=temperature, seed=seed, start=start, n=n)
        return [[self._decode(outputs[i * n + j], p, start) for j in range(n)] for i, p in enumerate(prompts)]

    def preemptions(self) -> int:
        """Retractions (SGLang's preemption: a running request sent back to the queue when the KV
        pool is full) of every request this adapter has decoded so far (``meta_info["num_retractions"]``)."""
        return self._retractions

    def abort_after(self, prompt: Sequence[int], max_tokens: int, abort_at: int) -> EngineRollout:
        """A request aborted by the client once it has ``abort_at`` tokens: what an RL framework's
        partial rollout gets from SGLang (``abort_request``: finish reason abort, the rows so far).

        Streams the request with ``Engine.async_generate`` on the engine's own event loop, calls the
        tokenizer manager's ``abort_request`` and decodes the last output."""
        ids = [int(t) for t in prompt]
        rid = f"rrh-abort-{uuid.uuid4().hex}"  # unique per request: SGLang keys its state by rid

        async def run() -> Any:
            stream = await self.engine.async_generate(
                input_ids=ids,
                sampling_params=self._sampling(max_tokens, 0.0, None),
                return_logprob=True,
                return_routed_experts=True,
                stream=True,
                rid=rid,
            )
            final, aborted = None, False
            async for output in stream:
                final = {**output, "output_ids": list(output.get("output_ids", ()))}
                if not aborted and len(final["output_ids"]) >= abort_at:
                    aborted = True
                    self.engine.tokenizer_manager.abort_request(rid=rid)
            return final

        output = self.engine.loop.run_until_complete(run())
        if output is None:
            raise ConventionError("sglang: async_generate yielded no output for the aborted request")
        return self._decode(output, ids)

    def load_weights(self, weights_path: str | os.PathLike[str]) -> None:
        """Load the checkpoint at ``weights_path`` into the running engine in place, as an RL loop's
        weight sync does: SGLang's own ``update_weights_from_disk``, whose request flushes the prefix
        cache by default (``UpdateWeightFromDiskReqInput.flush_cache``; what a cached prefix then
        returns is measured by ``conformance/test_engines.py``, not assumed here)."""
        result = self.engine.update_weights_from_disk(str(weights_path))
        success, message = result[0], result[1]
        if not success:
            raise ConventionError(
                f"sglang {self.version}: update_weights_from_disk({weights_path}): {message}"
            )

    def generate_one(self, context: Sequence[int], max_tokens: int) -> EngineRollout:
        """One engine call: the ``generate`` of ``reference_impl.episode.run_episode``, which plays an
        abort/resume or multi-turn ``Schedule`` through this engine (``checkpoint.spliced_trace``)."""
        return self.generate([context], max_tokens)[0]

    def close(self) -> None:
        """Shut the engine (its scheduler and detokenizer processes) down."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
