"""What the vLLM and SGLang adapters share: the tiny checkpoint, rollout records, attempts, the trainer.

- **The checkpoint.** ``write_checkpoint(dir)`` writes a random-init Qwen3-MoE (``config.json`` +
  ``model.safetensors``, no tokenizer: the engines run with ``skip_tokenizer_init``) built by
  ``harness.trainers.hf.models.tiny_model``. The engine default (``ENGINE_OVERRIDES``) is sized for
  GPU kernels (head_dim 64, 16 experts top-4) and has a dense first layer (``mlp_only_layers=[0]``),
  so the decoder-index layer axis has a dense slot an engine must fill with 0. Both spellings of the
  expert count (``num_experts``, ``num_local_experts``) and of the rope base are written, so the
  transformers pinned by an engine (4.x or 5.x) reads the same model.
- **Rollouts.** ``EngineRollout``: one engine call — prompt, generated tokens, their log-probs, the
  canonical ``RoutingTrace`` decoded through the conventions registry, and the raw payload's dtype.
- **Episodes.** An abort/resume or multi-turn ``Schedule`` (``reference_impl.episode``) drives any
  ``generate(context, max_tokens) -> EngineRollout`` through the one episode driver
  ``reference_impl.episode.run_episode``; ``spliced_trace`` splices its payloads with the reference
  splice (DESIGN §3.4): each attempt contributes only the rows of its own new positions.
- **The trainer.** ``trainer_recompute`` loads the checkpoint into transformers, recomputes the
  rollouts with one full forward, and measures routing disagreement with the engine and the log-prob
  gap without replay and with R3 (the engine's routes replayed through ``install_replay``).

Nothing here imports an engine.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.conventions import ModelSpec
from harness.errors import HarnessError
from harness.trace import LayerAxis, Provenance, RoutingComparison, RoutingTrace, compare
from reference_impl.episode import Episode
from reference_impl.splice import SpliceError, splice

__all__ = [
    "ENGINE_OVERRIDES",
    "EngineRollout",
    "EngineUnavailable",
    "TinyCheckpoint",
    "TrainerComparison",
    "load_checkpoint",
    "model_spec",
    "spliced_trace",
    "trainer_recompute",
    "write_checkpoint",
]


class EngineUnavailable(HarnessError, RuntimeError):
    """An engine adapter cannot start: the engine is not installed, or needs a CUDA device."""


# --------------------------------------------------------------------------------------------
# the checkpoint
# --------------------------------------------------------------------------------------------

ENGINE_OVERRIDES: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
)
"""The engine checkpoint: a Qwen3-MoE with kernel-friendly sizes and a dense first decoder layer."""


@dataclass(frozen=True)
class TinyCheckpoint:
    """A checkpoint directory the harness wrote, and what decoders need to know about its model."""

    path: Path
    model_type: str
    dtype: str  # "bfloat16" | "float32" | "float16"
    spec: ModelSpec
    config: dict[str, Any] = field(repr=False, default_factory=dict)
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token takes (keys and values of every layer), to size a tiny cache."""
        c = self.config
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return 2 * int(c["num_hidden_layers"]) * kv_heads * head_dim * itemsize


def model_spec(config: Any) -> ModelSpec:
    """Decoder layers, experts, top-k and MoE layer indices of a Qwen2/3-MoE-style config (object or dict).

    A layer is MoE unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``
    (the rule transformers, vLLM and SGLang apply to Qwen-MoE configs).
    """

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    layers = int(get("num_hidden_layers"))
    experts = get("num_experts", None) or get("num_local_experts", None) or get("n_routed_experts", None)
    if experts is None:
        raise HarnessError(
            "config: no num_experts / num_local_experts / n_routed_experts; expected a MoE config"
        )
    dense = set(get("mlp_only_layers", None) or [])
    step = int(get("decoder_sparse_step", 1) or 1)
    first_dense = int(get("first_k_dense_replace", 0) or 0)
    moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first_dense)
    return ModelSpec(layers, int(experts), int(get("num_experts_per_tok")), moe)


def write_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model_type: str = "qwen3_moe",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    **overrides: Any,
) -> TinyCheckpoint:
    """Write a random-init MoE checkpoint (``config.json`` + ``model.safetensors``) into ``directory``.

    ``overrides`` update ``ENGINE_OVERRIDES`` (for ``qwen3_moe``) or the tiny config of another
    ``model_type``. The weights are ``tiny_model(model_type, dtype, seed)``'s, saved with
    ``save_pretrained`` (per-expert tensors, the layout every engine loads); no tokenizer is written.
    """
    from harness.trainers.hf.models import tiny_model

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    settings = {**(ENGINE_OVERRIDES if model_type == "qwen3_moe" else {}), **overrides}
    model: Any = tiny_model(model_type, dtype, seed=seed, **settings)
    model.save_pretrained(path, safe_serialization=True)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    # The transformers an engine pins may be 4.x: write both spellings of renamed fields.
    if "num_local_experts" in config and "num_experts" not in config:
        config["num_experts"] = config["num_local_experts"]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    dtype_name = str(dtype).removeprefix("torch.")
    config.setdefault("dtype", dtype_name)
    config["torch_dtype"] = dtype_name
    _atomic_write_text(config_file, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return TinyCheckpoint(path, model_type, dtype_name, model_spec(config), config, seed)


def load_checkpoint(
    checkpoint: TinyCheckpoint | str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """The checkpoint as a transformers causal LM in eval mode (SDPA attention)."""
    from transformers import AutoModelForCausalLM

    from harness.trainers.hf.models import model_imports

    path = checkpoint.path if isinstance(checkpoint, TinyCheckpoint) else Path(checkpoint)
    if dtype is None and isinstance(checkpoint, TinyCheckpoint):
        dtype = getattr(torch, checkpoint.dtype)
    with model_imports():
        model: Any = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype or torch.float32, attn_implementation="sdpa"
        )
    return model.to(device).eval()  # type: ignore[no-any-return]


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# rollouts and attempts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRollout:
    """One real engine call: ``prompt`` (the context it was given), the ``tokens`` it generated, their
    log-probs (None when the engine did not return them), the canonical trace of positions
    ``[start, len(prompt) + len(tokens) − 1)``, how the call ended, and the raw payload's dtype.

    The reference ``Rollout`` plus what only a real engine's payload has: its decoded ``trace``
    (convention, layer axis, provenance), the wire dtype and the prefix-cache hit. It is an
    ``EngineCall`` of ``reference_impl.episode.run_episode``, so a ``Schedule`` drives a real engine
    through ``generate_one`` as it drives the reference engine."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    trace: RoutingTrace
    finish_reason: str = "length"
    raw_dtype: str = ""
    cached_tokens: int | None = None

    @property
    def sequence(self) -> tuple[int, ...]:
        return self.prompt + self.tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def start(self) -> int:
        return self.trace.start

    @property
    def routes(self) -> torch.Tensor:
        """The trace's routes on the decoder axis as int64 ``[rows, num_hidden_layers, top_k]``."""
        return torch.from_numpy(self.trace.to_decoder_axis().experts.astype(np.int64))


Generate = Callable[[Sequence[int], int], EngineRollout]
"""``(context token ids, max_tokens) -> EngineRollout``: one engine call, full payload (start 0)."""


def spliced_trace(episode: Episode[EngineRollout]) -> RoutingTrace:
    """The canonical trace of an episode of real engine calls: its attempts spliced (DESIGN §3.4).

    Decoder layer axis, the first call's model and provenance (convention ``+splice``), coverage
    ``[0, P + R − 1)`` checked; a payload the splice refuses raises `HarnessError`.
    """
    try:
        routes = splice(episode.prompt_len, episode.attempts)
    except SpliceError as err:
        raise HarnessError(f"splice: {err}") from None
    first = episode.calls[0].trace
    trace = RoutingTrace(
        routes.numpy(),
        num_experts=first.num_experts,
        moe_layers=first.moe_layers,
        num_layers=first.num_layers,
        layer_axis=LayerAxis.DECODER,
        provenance=Provenance(
            first.provenance.engine, first.provenance.version, first.provenance.convention + "+splice"
        ),
    )
    trace.check_coverage(episode.prompt_len, episode.response_len)
    return trace


# --------------------------------------------------------------------------------------------
# the trainer's recompute
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerComparison:
    """The transformers trainer against engine rollouts (response tokens only for the gap)."""

    routing: RoutingComparison  # engine routes vs the trainer's native routes, all rows
    r3_routing: RoutingComparison  # engine routes vs what the trainer dispatched under R3
    mean_abs_gap: float  # mean |log π_train − log π_engine| over response tokens, no replay
    mean_abs_gap_r3: float  # the same with the engine's routes replayed
    tokens: int
    abs_gaps: tuple[float, ...] = field(default=(), repr=False, compare=False)  # per token, no replay
    abs_gaps_r3: tuple[float, ...] = field(default=(), repr=False, compare=False)  # the same tokens, R3

    def as_dict(self) -> dict[str, float]:
        return {
            "trainer_disagreement": float(self.routing.disagreement),
            "trainer_token_disagreement": float(self.routing.token_disagreement),
            "r3_disagreement": float(self.r3_routing.disagreement),
            "mean_abs_gap": self.mean_abs_gap,
            "mean_abs_gap_r3": self.mean_abs_gap_r3,
        }


def _trace_of(routes: torch.Tensor, like: RoutingTrace) -> RoutingTrace:
    return RoutingTrace(
        routes.numpy(),
        num_experts=like.num_experts,
        moe_layers=like.moe_layers,
        num_layers=like.num_layers,
        layer_axis=LayerAxis.MOE_ORDINAL,
        provenance=Provenance("hf", "", "trainer recompute"),
    )


def trainer_recompute(
    model: torch.nn.Module,
    rollouts: Sequence[EngineRollout | Episode[EngineRollout]],
    *,
    handle: Any = None,
) -> TrainerComparison:
    """Recompute each rollout or episode with one full forward of ``model`` (transformers), without
    and with R3 (an episode's routes are its `spliced_trace`).

    Routes are compared per (position, MoE layer) as sets over every row the engine returned; the
    gap is over the sampled response tokens whose engine log-prob is known. ``handle`` is an
    ``install_replay`` handle of ``model`` (installed here when None, removed afterwards).
    """
    from harness.trainers.hf import install_replay

    own = handle is None
    handle = handle or install_replay(model)
    device = next(model.parameters()).device
    overlaps, overlaps_r3, gaps, gaps_r3 = [], [], [], []
    try:
        for rollout in rollouts:
            if isinstance(rollout, Episode):
                tokens, prompt_len, trace = (
                    rollout.tokens.tolist(),
                    rollout.prompt_len,
                    spliced_trace(rollout),
                )
                engine_lp = [
                    float(lp) if sampled and not math.isnan(lp) else None
                    for lp, sampled in zip(
                        rollout.response_logprobs.tolist(), rollout.sampled_mask.tolist(), strict=True
                    )
                ]
            else:
                tokens, prompt_len, trace = list(rollout.sequence), len(rollout.prompt), rollout.trace
                engine_lp = (
                    list(rollout.logprobs) if rollout.logprobs is not None else [None] * len(rollout.tokens)
                )
            if trace.start != 0:
                raise HarnessError(f"trainer_recompute: trace starts at {trace.start}, expected 0")
            ids = torch.tensor([tokens], device=device)
            rows = trace.rows
            engine_routes = torch.from_numpy(trace.to_moe_ordinal().experts.astype(np.int64))
            targets = torch.zeros(
                len(tokens), engine_routes.shape[1], engine_routes.shape[2], dtype=torch.int64
            )
            targets[:rows] = engine_routes
            mask = torch.zeros(len(tokens), dtype=torch.bool)
            mask[:rows] = True
            with torch.no_grad():
                handle.record()
                lp = _token_logprobs(model, ids)
                native = handle.recording()[:rows]
                handle.replay(targets, mask)
                lp_r3 = _token_logprobs(model, ids)
                dispatched = handle.dispatched()[:rows]
                handle.disarm()
            overlaps.append(compare(trace, _trace_of(native, trace)).overlap)
            overlaps_r3.append(compare(trace, _trace_of(dispatched, trace)).overlap)
            for i, elp in enumerate(engine_lp):
                if elp is None:
                    continue
                pos = prompt_len + i  # the response token at this position
                gaps.append(abs(float(lp[pos]) - elp))
                gaps_r3.append(abs(float(lp_r3[pos]) - elp))
    finally:
        if own:
            handle.remove()
    first = rollouts[0].calls[0].trace if isinstance(rollouts[0], Episode) else rollouts[0].trace
    k, moe = first.top_k, first.moe_layers
    return TrainerComparison(
        RoutingComparison(np.concatenate(overlaps), k, moe),
        RoutingComparison(np.concatenate(overlaps_r3), k, moe),
        float(np.mean(gaps)) if gaps else float("nan"),
        float(np.mean(gaps_r3)) if gaps_r3 else float("nan"),
        len(gaps),
        tuple(gaps),
        tuple(gaps_r3),
    )


def _token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``lp[p]`` = log-prob of token p given tokens ``< p`` (``lp[0] = 0``), fp32, on the CPU."""
    logits = model(input_ids=ids, use_cache=False).logits[0]
    picked = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([picked.new_zeros(1), picked]).cpu()
