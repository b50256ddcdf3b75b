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


SCALE = 2.5
"""``moe_router_topk_scaling_factor`` of the scaled router rules."""


def router_rules() -> dict[str, dict[str, Any]]:
    """Every gate-weight rule megatron-core's ``TopKRouter`` offers (``topk_routing_with_score_function``),
    by name: ``TransformerConfig`` fields, ``moe_router_topk`` included.

    Score function ``softmax`` (after top-k, or over every expert first with ``pre_softmax``) or
    ``sigmoid`` (normalised over the chosen experts when top-k > 1; ``pre_softmax`` changes nothing
    for it), each with and without ``moe_router_topk_scaling_factor``, group-limited routing
    (``moe_router_num_groups`` = 2, one group per token: it changes the choice, not the rule) and, for
    sigmoid, the aux-loss-free expert bias (added to the scores for the choice only). Top-1 needs
    ``pre_softmax`` with softmax (megatron-core refuses a softmax over one logit), and sigmoid top-1 is
    not normalised. Names read ``<score>[-pre][-scaled][-grouped][-bias][-top1]``.
    """
    rules: dict[str, dict[str, Any]] = {}
    for score in ("softmax", "sigmoid"):
        for pre in (False, True) if score == "softmax" else (False,):
            for scaled in (False, True):
                for grouped in (False, True):
                    for bias in (False, True) if score == "sigmoid" else (False,):
                        name = (
                            score + "-pre" * pre + "-scaled" * scaled + "-grouped" * grouped + "-bias" * bias
                        )
                        rules[name] = {
                            "moe_router_score_function": score,
                            "moe_router_topk": 2,
                            "moe_router_pre_softmax": pre,
                            "moe_router_topk_scaling_factor": SCALE if scaled else None,
                            "moe_router_num_groups": 2 if grouped else None,
                            "moe_router_group_topk": 1 if grouped else None,
                            "moe_router_enable_expert_bias": bias,
                        }
    rules["softmax-pre-top1"] = {**rules["softmax-pre"], "moe_router_topk": 1}
    rules["sigmoid-scaled-top1"] = {**rules["sigmoid-scaled"], "moe_router_topk": 1}
    return rules


def randomise_expert_bias(model: Any, seed: int) -> None:
    """Give every router's aux-loss-free ``expert_bias`` (zeros at init) random values, so that it
    moves the choice: a gate weight that wrongly includes it then differs."""
    from megatron.core.transformer.moe.router import TopKRouter

    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, TopKRouter) and getattr(module, "expert_bias", None) is not None:
            bias = torch.rand(module.expert_bias.shape, generator=gen) * 0.5
            with torch.no_grad():
                module.expert_bias.copy_(bias.to(module.expert_bias.device))


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
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        pipeline_dtype=torch.float32,
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


def packed_attention_class() -> type:
    """Megatron's local ``DotProductAttention`` that also takes a packed (THD) micro-batch.

    Megatron-core's local attention refuses ``packed_seq_params`` (only Transformer Engine's takes
    THD, and TE needs CUDA). This subclass handles ``qkv_format='thd'`` itself: query/key/value
    ``[T, heads, dim]``, causal attention inside each sample's segment of ``cu_seqlens_q_padded``
    (filler rows at a segment's end are never attended by its real rows), output ``[T, heads·dim]``
    as ``Attention.forward`` expects; the unpacked input goes to the local kernel unchanged.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc, valid-type]
        def forward(
            self, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any
        ) -> Any:
            packed = kwargs.get("packed_seq_params")
            if packed is None or packed.qkv_format != "thd":
                return super().forward(query, key, value, attention_mask, *args, **kwargs)
            cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            rows = query.shape[0]
            segment = torch.bucketize(
                torch.arange(rows, device=query.device), cu[1:].to(query.device), right=True
            )
            index = torch.arange(rows, device=query.device)
            allowed = (segment.unsqueeze(1) == segment.unsqueeze(0)) & (
                index.unsqueeze(1) >= index.unsqueeze(0)
            )
            groups = query.shape[1] // key.shape[1]
            q, k, v = (
                x.transpose(0, 1)
                for x in (query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1))
            )
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=self.softmax_scale
            )
            return out.transpose(0, 1).reshape(rows, -1)

    return PackedDotProductAttention


def _local_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron's local GPT block spec with :class:`SequenceParallelLayerNorm` for every torch norm
    and :func:`packed_attention_class` as every layer's core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **chunk)
    if spec.layer_norm is WrappedTorchNorm:
        spec.layer_norm = SequenceParallelLayerNorm
    packed_attention = packed_attention_class()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = packed_attention
        for name in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
            if getattr(layer.submodules, name, None) is WrappedTorchNorm:
                setattr(layer.submodules, name, SequenceParallelLayerNorm)
    return spec


def _mtp_block_spec(config: Any, spec: Any, vp_stage: int | None) -> Any:
    """The multi-token-prediction block spec of ``config.mtp_num_layers`` layers (each the last
    decoder layer's spec, so an MoE layer when that one is), or ``None`` when the config has none or
    this stage builds none; its norms are :class:`SequenceParallelLayerNorm` as the decoder's are."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not getattr(config, "mtp_num_layers", None):
        return None
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
    for layer in mtp.layer_specs if mtp is not None else ():
        for name in ("enorm", "hnorm", "layer_norm"):
            if getattr(layer.submodules, name) is WrappedTorchNorm:
                setattr(layer.submodules, name, SequenceParallelLayerNorm)
    return mtp


def build_gpt(config: Any, layout: MegatronLayout, vp_stage: int | None = None) -> Any:
    """A ``GPTModel`` of ``config`` (this rank's pipeline stage; with VPP its model chunk ``vp_stage``,
    whose layers megatron-core places by ``get_transformer_layer_offset(config, vp_stage)``), local
    specs, on the current device; with ``config.mtp_num_layers`` (``tiny_config(...,
    mtp_num_layers=1)``) also a multi-token-prediction block, whose MoE router owns a ``RouterReplay``
    after the decoder's (FACTS §2) and carries ``layer_number`` ``num_layers + k`` in 0.16.1 while its
    ``MultiTokenPredictionLayer`` carries the bare ``k``.

    ``max_sequence_length`` covers :func:`slot_count` learned positions: a packed layout's positions
    name a ``(sample, position)`` slot each (the placement oracle of ``suites/megatron_checks.py``).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    chunk = {} if vp_stage is None else {"vp_stage": vp_stage}
    spec = _local_block_spec(config, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=slot_count(layout),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        position_embedding_type="learned_absolute",
        mtp_block_spec=_mtp_block_spec(config, spec, vp_stage),
        **chunk,
    )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return model.to(device)


def slot_count(layout: MegatronLayout) -> int:
    """Learned absolute positions the model needs: ``S``, or ``B·S + 1`` for a packed layout (one per
    ``(sample, position)`` of a micro-batch and one for filler rows)."""
    return layout.micro_batch * layout.seq_len + 1 if layout.packed else layout.seq_len


def batch_tokens(layout: MegatronLayout, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and labels ``[dp·B, S]`` of the global batch (the same on every rank for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (layout.global_batch, layout.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
