"""A transformers model as the inference engine: KV-cache rollouts that return their routes.

``generate_rollouts`` samples the way an inference engine does — one prefill of the prompts, then
one-token decode steps through the model's own cache (``past_key_values``) — while an ``HFReplay``
records the routing of every forward. Each rollout is canonical (DESIGN §3.1): routes for positions
``[0, P + R − 1)`` (the last sampled token is never fed back, so it has no row), MoE-ordinal layer
axis, and the sampled tokens' log-probs from the engine's own logits.

Each rollout is a reference ``Rollout`` (``hf_trace`` makes its canonical trace).
``hf_generate(model, handle)`` adapts ``generate_rollouts`` to the engine call of the one episode
driver, ``reference_impl.episode.run_episode``, so an abort/resume or multi-turn ``Schedule`` runs
through real HF generation and its KV cache.

``run_hf_mismatch_lab`` is DESIGN §6's mismatch lab on a real transformers model: a bf16 Qwen3-MoE
(SDPA, 64 experts top-8) rolls out with its KV cache, the trainer recomputes with one full forward,
without replay and with R3 (the rollout routes replayed through ``install_replay``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from harness.engines.checkpoint import EngineRollout, Generate
from harness.errors import HarnessError
from harness.lab.measure import LabConfig, LabResult, lab_result
from harness.trace import LayerAxis, Provenance, RoutingTrace
from harness.trainers.hf.replay import HFReplay, install_replay
from reference_impl.engine import Rollout


def hf_trace(rollout: Rollout, handle: HFReplay) -> RoutingTrace:
    """A rollout's routes as a validated ``RoutingTrace`` (MoE-ordinal axis) of ``handle``'s model."""
    if rollout.routes is None:
        raise HarnessError("hf_trace: the rollout has no routes (no forward ran)")
    return RoutingTrace(
        rollout.routes.numpy(),
        num_experts=handle.num_experts,
        moe_layers=handle.moe_layers,
        num_layers=_num_layers(handle.model),
        layer_axis=LayerAxis.MOE_ORDINAL,
        provenance=Provenance("hf", _transformers_version(), "kv-cache decode"),
    )


def _num_layers(model: Any) -> int:
    """Decoder layers of a transformers model (``Any``: its config is no attribute ``nn.Module`` types)."""
    return int(model.config.num_hidden_layers)


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


@torch.no_grad()
def generate_rollouts(
    model: nn.Module,
    handle: HFReplay,
    prompts: torch.Tensor,
    response_len: int,
    *,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> list[Rollout]:
    """Sample ``response_len`` tokens after each of ``prompts`` ``[B, P]`` through the KV cache.

    Each rollout's ``routes`` is ``[P + R − 1, num_moe_layers, top_k]`` int64: row ``i`` is the
    routing computed when position ``i`` of ``prompt ⊕ tokens`` was the model input.
    One prefill forward of the prompts, then ``response_len − 1`` decode forwards of one token
    each; ``handle`` records every forward (it is disarmed afterwards). Log-probs are the fp32
    log-softmax of the logits the token was sampled from.
    """
    if prompts.ndim != 2 or prompts.shape[1] == 0:
        raise ValueError(f"prompts: shape {list(prompts.shape)}, expected [batch, prompt_len ≥ 1]")
    if response_len < 1:
        raise ValueError(f"response_len = {response_len}, expected ≥ 1")
    batch, prompt_len = prompts.shape
    device = next(model.parameters()).device
    handle.record()
    out = model(input_ids=prompts.to(device), use_cache=True)
    sampled: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    routes = [handle.recording().reshape(batch, prompt_len, len(handle.moe_layers), handle.top_k)]
    for step in range(response_len):
        logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()
        if greedy:
            token = logp.argmax(-1)
        else:
            token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        sampled.append(token)
        logprobs.append(logp.gather(1, token[:, None]).squeeze(1))
        if step == response_len - 1:
            break  # the last sampled token is never fed back: it has no row
        handle.record()
        out = model(input_ids=token[:, None].to(device), past_key_values=out.past_key_values, use_cache=True)
        routes.append(handle.recording().reshape(batch, 1, len(handle.moe_layers), handle.top_k))
    handle.disarm()
    tokens, lps, rows = torch.stack(sampled, 1), torch.stack(logprobs, 1), torch.cat(routes, 1)
    return [Rollout(prompt_len, tokens[b], lps[b], rows[b], 0, "length") for b in range(batch)]


def hf_generate(
    model: nn.Module, handle: HFReplay, *, greedy: bool = False, generator: torch.Generator | None = None
) -> Generate:
    """The ``(context, max_tokens) -> EngineRollout`` engine call of ``run_episode``.

    Each call is one engine call: a fresh KV cache, a prefill of the whole context, then decode
    steps (``generate_rollouts`` on a batch of one) for exactly ``max_tokens`` tokens (no stop token,
    so ``finish_reason`` is ``"length"``). Its trace is the full payload: rows ``[0, len(context) +
    max_tokens − 1)`` on the MoE-ordinal axis of ``handle``'s model, start 0.
    """

    def generate(context: Sequence[int], max_tokens: int) -> EngineRollout:
        prompt = torch.tensor([list(context)], dtype=torch.long)
        (rollout,) = generate_rollouts(model, handle, prompt, max_tokens, greedy=greedy, generator=generator)
        return EngineRollout(
            prompt=tuple(int(t) for t in context),
            tokens=tuple(int(t) for t in rollout.tokens.tolist()),
            logprobs=tuple(float(lp) for lp in rollout.logprobs.tolist()),
            trace=hf_trace(rollout, handle),
            finish_reason="length",
            raw_dtype="int64",
        )

    return generate


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
