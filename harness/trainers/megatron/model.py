"""Tiny Megatron-core GPT MoE models for the replay checks (random init, nothing downloaded).

Local (non-Transformer-Engine) module specs, so the same model builds on a CPU box (with the
test-support patches) and on a GPU runner. megatron-core is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.trainers.megatron.layout import MegatronLayout

HIDDEN = 16
HEADS = 4
FFN = 32
MOE_FFN = 8
VOCAB = 64


def tiny_config(
    layout: MegatronLayout,
    *,
    recompute: bool = True,
    dispatcher: str = "allgather",
    score_function: str = "softmax",
    **overrides: Any,
) -> Any:
    """A ``TransformerConfig`` with routing replay on, for ``layout``'s parallel sizes.

    fp32, no dropout, no fusions, no aux loss (it would not change routing, only the loss),
    sequence parallel whenever TP > 1 (Megatron requires it for MoE training with TP), and
    ``recompute`` = selective activation recompute of the MoE layers (``recompute_modules=['moe']``),
    which is what drives ``REPLAY_BACKWARD``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=layout.num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=MOE_FFN,
        num_moe_experts=layout.num_experts,
        moe_router_topk=layout.top_k,
        moe_layer_freq=list(layout.moe_layer_freq),
        moe_router_score_function=score_function,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type=dispatcher,
        moe_enable_routing_replay=True,
        moe_grouped_gemm=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.tp > 1,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    if recompute:
        kwargs.update(recompute_granularity="selective", recompute_modules=["moe"])
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with Megatron's norm signature that accepts sequence parallelism.

    Megatron's local spec uses ``WrappedTorchNorm`` without Apex / Transformer Engine, which refuses
    ``sequence_parallel=True``. A layer norm is per token, so it runs unchanged on a sequence shard;
    only its parameter gradients are partial per TP rank (marked ``sequence_parallel`` as Megatron's
    own norms do, for ``finalize_model_grads`` to all-reduce). The checks compare gradients rank by
    rank, so they never need that reduction.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def _local_block_spec(config: Any) -> Any:
    """Megatron's local GPT block spec with :class:`SequenceParallelLayerNorm` for every torch norm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    if spec.layer_norm is WrappedTorchNorm:
        spec.layer_norm = SequenceParallelLayerNorm
    for layer in spec.layer_specs:
        for name in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
            if getattr(layer.submodules, name, None) is WrappedTorchNorm:
                setattr(layer.submodules, name, SequenceParallelLayerNorm)
    return spec


def build_gpt(config: Any, layout: MegatronLayout) -> Any:
    """A ``GPTModel`` of ``config`` (this rank's pipeline stage), local specs, on the current device."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = _local_block_spec(config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=layout.seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return model.to(device)


def batch_tokens(layout: MegatronLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels ``[dp·B, S]`` of the global batch (the same on every rank for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (layout.global_batch, layout.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
