"""The SkyRL structural softmax hook on real transformers models (FACTS §2–3): caught where it is
wrong, harmless where it is right."""

from __future__ import annotations

import pytest
import torch

from harness.mutants.registry import get

pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

from harness.trainers.hf import tiny_model

CASES = [
    ("deepseek_v3", torch.float32, True),
    ("glm4_moe", torch.float32, True),
    ("mixtral", torch.bfloat16, True),
    ("qwen3_moe", torch.float32, False),
    ("qwen3_moe", torch.bfloat16, False),
    ("olmoe", torch.float32, False),
]


@pytest.mark.hf
@pytest.mark.parametrize(("model_type", "dtype", "wrong"), CASES, ids=[f"{m}-{d}" for m, d, _ in CASES])
def test_softmax_hook_moves_logits_exactly_where_its_rule_is_wrong(
    model_type: str, dtype: torch.dtype, wrong: bool
) -> None:
    model = tiny_model(model_type, dtype)
    handle = get("hf-softmax-hook").subject.install_hf_replay(model)  # type: ignore[misc]
    tokens = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        handle.record()
        native = model(tokens).logits
        handle.replay(handle.recording())
        replayed = model(tokens).logits
    handle.disarm()
    moved = (native.float() - replayed.float()).abs().max().item()
    assert (moved > 0) == wrong, (
        f"{model_type} {dtype}: replay with the softmax hook moved logits by {moved:.3e}"
    )
