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

The mismatch lab on a real transformers model, rolled out here, is ``harness.lab.hf``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from harness.engines.checkpoint import EngineRollout, Generate
from harness.errors import HarnessError
from harness.trace import LayerAxis, Provenance, RoutingTrace
from harness.trainers.hf.replay import HFReplay
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
