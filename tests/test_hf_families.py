"""The transformers router-family registry and ``install_replay``'s refusals (``harness.trainers.hf``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.conventions.hf_families import FAMILIES, ROUTER_PATHS, softmax_rule
from harness.trainers.hf import HFReplayError, install_replay, tiny_model
from harness.trainers.hf.models import MODEL_TYPES

pytestmark = pytest.mark.hf


def test_every_model_type_maps_to_a_registered_family() -> None:
    assert set(MODEL_TYPES.values()) == set(FAMILIES)
    assert ROUTER_PATHS == ("feed_forward.router", "mlp.gate", "mlp.router")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe"])
def test_dense_first_layers_have_no_router_and_layers_keep_their_decoder_index(model_type: str) -> None:
    handle = install_replay(tiny_model(model_type))
    assert handle.moe_layers == (1, 2)
    assert handle.families == ("sigmoid_grouped",)


def test_unknown_router_class_is_an_error_listing_the_families() -> None:
    class MyRouter(nn.Linear):
        pass

    model = tiny_model("qwen3_moe")
    model.model.layers[1].mlp.gate = MyRouter(32, 8, bias=False)
    with pytest.raises(HFReplayError, match=r"model\.layers\.1\.mlp\.gate: router class MyRouter") as info:
        install_replay(model)
    for name in FAMILIES:
        assert name in str(info.value)


def test_a_dense_model_is_an_error() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
    )
    with pytest.raises(HFReplayError, match="no MoE router found"):
        install_replay(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize(
    ("model_type", "dtype", "family"),
    [
        ("deepseek_v3", torch.float32, "sigmoid_grouped"),
        ("glm4_moe", torch.float32, "sigmoid_grouped"),
        ("mixtral", torch.bfloat16, "softmax_topk_fp32"),
    ],
)
def test_softmax_rule_for_every_family_fails_the_self_check(
    model_type: str, dtype: torch.dtype, family: str
) -> None:
    """SkyRL's structural softmax hook (FACTS §2) is wrong for sigmoid routers and fp32 Mixtral scores."""
    with pytest.raises(HFReplayError, match=rf"{family} routers .* moved the logits by up to (\S+),") as info:
        install_replay(tiny_model(model_type, dtype), rule=softmax_rule)
    print(f"{model_type} {dtype}: {info.value}")


def test_softmax_rule_is_right_for_the_qwen_family() -> None:
    install_replay(tiny_model("qwen3_moe", torch.bfloat16), rule=softmax_rule)


def test_malformed_targets_are_errors_naming_the_field() -> None:
    model = tiny_model("qwen3_moe")
    handle = install_replay(model)
    good = torch.tensor([[[0, 1], [2, 3]]] * 4)
    with pytest.raises(HFReplayError, match=r"shape \[4, 1, 2\], expected \[tokens, 2, 2\]"):
        handle.replay(good[:, :1])
    layer1 = r"decoder layer 1 \(model\.layers\.1\.mlp\.gate\)"
    with pytest.raises(HFReplayError, match=layer1 + r": replayed row 0 = \[2, 8\] has ids outside \[0, 8\)"):
        handle.replay(torch.where(good == 3, 8, good))
    with pytest.raises(
        HFReplayError, match=r"decoder layer 0 .*: replayed row 0 = \[0, 0\] repeats an expert"
    ):
        handle.replay(torch.zeros_like(good))
    with pytest.raises(HFReplayError, match=r"dtype torch.float32, expected an integer dtype"):
        handle.replay(good.float())
    with pytest.raises(HFReplayError, match=r"replay mask of .* expected \[4\] bool"):
        handle.replay(good, torch.ones(4, dtype=torch.long))
    handle.replay(torch.zeros_like(good), torch.zeros(4, dtype=torch.bool))  # masked-out filler is fine
    handle.replay(good)
    with pytest.raises(HFReplayError, match=r"decoder layer 0 .* have shape \[4, 2\], expected \[6, 2\]"):
        model(input_ids=torch.ones(2, 3, dtype=torch.long), use_cache=False)


def test_install_twice_is_an_error_and_remove_restores_native_routing() -> None:
    model = tiny_model("mixtral")
    tokens = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=tokens).logits
    handle = install_replay(model)
    with pytest.raises(HFReplayError, match="already installed"):
        install_replay(model)
    handle.replay(torch.tensor([[[0, 1], [2, 3]]] * 8))
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(input_ids=tokens).logits, before)
    install_replay(model)
