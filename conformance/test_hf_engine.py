"""The harness's transformers engine (``harness.engines.hf``) on real random-init models (DESIGN §3.1,
§3.10, §6): its KV-cache rollouts cover ``[0, P + R − 1)`` and route like a full forward, and its
mismatch lab on a bf16 Qwen3-MoE shows R3 removing the routing disagreement and shrinking the gap
where routing had flipped. No subject: the harness's own replay hooks record and replay.
"""

from __future__ import annotations

import pytest
import torch

from harness.testing.asserts import assert_close_logprobs, assert_same_routes
from harness.trainers.hf import install_replay
from harness.trainers.kinds import hf_kind

pytestmark = pytest.mark.hf

KIND = hf_kind()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text"])
def test_kv_cache_rollout_covers_all_but_the_last_token(model_type: str) -> None:
    """Rollout routes cover [0, P + R − 1) and, in fp32, equal a full forward's routing (§3.1, §6)."""
    from harness.engines.hf import generate_rollouts, hf_trace

    model = KIND.build(model_type, "fp32")
    handle = install_replay(model)  # the harness's HF engine records rollouts with its own hooks
    batch, prompt_len, response_len = 2, 5, 4
    prompts = torch.randint(3, KIND.vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(3))
    rollouts = generate_rollouts(
        model, handle, prompts, response_len, generator=torch.Generator().manual_seed(0)
    )
    tokens = torch.stack([torch.cat([prompt, r.tokens]) for prompt, r in zip(prompts, rollouts, strict=True)])
    with torch.no_grad():
        handle.record()
        logits = model(input_ids=tokens, use_cache=False).logits
        full = handle.recording().reshape(batch, prompt_len + response_len, len(handle.moe_layers), -1)
    handle.disarm()
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)
    for b, rollout in enumerate(rollouts):
        rows = rollout.routes.shape[0]
        assert rows == prompt_len + response_len - 1, (
            f"{model_type}: rollout has {rows} rows, expected P + R − 1 = {prompt_len + response_len - 1}"
        )
        hf_trace(rollout, handle).check_coverage(prompt_len, response_len)
        assert_same_routes(
            rollout.routes,
            full[b, :-1],
            names=("KV-cache decode", "a full forward"),
            what=f"{model_type} rollout {b}",
            axes=("position", "MoE ordinal"),
        )
        picked = logp[b].gather(-1, rollout.tokens[:, None]).squeeze(-1)
        assert_close_logprobs(
            rollout.logprobs,
            picked,
            names=("KV-cache decode", "a full forward"),
            what=f"{model_type} rollout {b}: response log-probs",
            atol=1e-5,
            axes=("response token",),
        )


@pytest.mark.parametrize(
    "size",
    [
        pytest.param({"batch": 4, "response_len": 32}, id="4x32"),
        pytest.param({"batch": 16, "response_len": 64}, id="16x64", marks=pytest.mark.slow),
    ],
)
def test_mismatch_lab_on_a_real_qwen3_moe(size: dict[str, int]) -> None:
    """bf16 SDPA Qwen3-MoE, 64 experts top-8: routing flips without replay, none with R3, smaller gap."""
    from harness.lab.hf import run_hf_mismatch_lab
    from harness.lab.measure import LabConfig, format_lab

    result = run_hf_mismatch_lab(LabConfig(family="qwen3_moe", **size))
    print(format_lab(result))
    without, r3 = result.without_replay, result.with_r3
    assert without.routing.disagreement > 0, "no route flipped between decode and full forward: no test"
    assert r3.routing.disagreement == 0.0, f"R3 left {r3.routing.disagreement:.4f} of routes disagreeing"
    assert result.flipped_tokens > 0, "no response token had flipped routing: the lab cannot test the gap"
    assert r3.gap_on_flipped.mean_abs_diff < without.gap_on_flipped.mean_abs_diff, (
        f"R3 did not shrink the gap on flipped tokens: {r3.gap_on_flipped.mean_abs_diff:.3e} vs "
        f"{without.gap_on_flipped.mean_abs_diff:.3e} without replay"
    )
