"""DESIGN §6's mismatch lab on a real transformers model: a bf16 Qwen3-MoE (SDPA, 64 experts top-8)
rolls out with its KV cache (``harness.engines.hf.generate_rollouts``), the trainer recomputes with
one full forward, without replay and with R3 (the rollout routes replayed through
``install_replay``); ``score_rollouts`` scores any engine's rollouts the same way (real vLLM in
``harness.lab.engine``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from harness.engines.hf import generate_rollouts
from harness.lab.measure import LabConfig, LabResult, lab_result
from harness.trainers.hf.replay import HFReplay, install_replay


def lab_model(cfg: LabConfig) -> nn.Module:
    """The lab's Qwen3-MoE (``cfg``'s experts, top-k, layers, hidden size, dtype), SDPA attention."""
    from harness.trainers.hf.models import tiny_model

    return tiny_model(
        "qwen3_moe",
        getattr(torch, cfg.dtype),
        seed=cfg.seed,
        vocab_size=256,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=cfg.hidden_size // 4,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=32,
    )


def run_hf_mismatch_lab(cfg: LabConfig | None = None) -> LabResult:
    """KV-cache rollouts vs a full-forward recompute of a transformers Qwen3-MoE, without replay and with R3.

    Every sample has the same prompt length, so the trainer batch needs no padding: rollout row
    ``i`` is trainer row ``b·W + i`` for ``i < W − 1``; each sample's last position has no rollout
    row and routes natively (replay mask False). ``cfg.family`` is informational ("qwen3_moe").
    """
    cfg = cfg or LabConfig(family="qwen3_moe")
    model = lab_model(cfg)
    handle = install_replay(model)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(0, 256, (cfg.batch, cfg.prompt_len), generator=gen)
    rollouts = generate_rollouts(model, handle, prompts, cfg.response_len, generator=gen)

    tokens = torch.cat([prompts, torch.stack([r.tokens for r in rollouts])], dim=1)
    routes = torch.stack([cast(torch.Tensor, r.routes) for r in rollouts])  # every rollout ran a forward
    infer = torch.stack([r.logprobs for r in rollouts])
    result = score_rollouts(model, handle, cfg, tokens, routes, infer)
    handle.remove()
    return result


def score_rollouts(
    model: nn.Module,
    handle: HFReplay,
    cfg: LabConfig,
    tokens: torch.Tensor,
    routes: torch.Tensor,
    infer: torch.Tensor,
) -> LabResult:
    """Recompute rollouts with one full forward of ``model``, without replay and with R3, and score them.

    ``tokens`` ``[B, W]`` (``W = prompt_len + response_len``, no padding), ``routes`` the rollout's
    ``[B, W − 1, n_moe, k]`` (MoE-ordinal axis; the last position has no row and routes natively),
    ``infer`` the rollout's ``[B, response_len]`` sampled-token log-probs. Any rollout engine: the
    transformers KV cache here, real vLLM in ``harness.engines.vllm``.
    """
    width = cfg.prompt_len + cfg.response_len
    layers, k = len(handle.moe_layers), handle.top_k
    targets = torch.zeros(cfg.batch, width, layers, k, dtype=torch.int64)
    targets[:, :-1] = routes
    mask = torch.ones(cfg.batch, width, dtype=torch.bool)
    mask[:, -1] = False
    targets, mask = targets.reshape(-1, layers, k), mask.reshape(-1)
    device = next(model.parameters()).device

    def token_logprobs() -> torch.Tensor:
        ids = tokens.to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([picked.new_zeros(cfg.batch, 1), picked], dim=1).cpu()

    with torch.no_grad():
        handle.record()
        lp_native = token_logprobs()
        native_routes = handle.recording()
        handle.replay(targets, mask)
        lp_r3 = token_logprobs()
        r3_routes = handle.dispatched()
        handle.disarm()
    return lab_result(
        cfg, handle.moe_layers, targets, mask, (native_routes, lp_native), (r3_routes, lp_r3), infer
    )
