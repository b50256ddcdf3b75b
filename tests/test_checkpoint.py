"""The tiny engine checkpoint: what is written, and that transformers reads back the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from harness.conventions import ModelSpec
from harness.engines.checkpoint import ENGINE_OVERRIDES, load_checkpoint, model_spec, write_checkpoint
from harness.errors import HarnessError
from harness.trainers.hf import install_replay, tiny_model

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), dtype=torch.bfloat16, seed=3)


def test_files_are_config_and_safetensors_without_tokenizer(written) -> None:  # type: ignore[no-untyped-def]
    names = {p.name for p in Path(written.path).iterdir()}
    assert {"config.json", "model.safetensors"} <= names, f"files written: {sorted(names)}"
    assert not names & {"tokenizer.json", "tokenizer_config.json", "vocab.json"}, (
        f"tokenizer files: {sorted(names)}"
    )
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names), f"pickle files: {sorted(names)}"


def test_config_names_the_model_for_every_engine(written) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((written.path / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 16,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "mlp_only_layers": [0],
        "torch_dtype": "bfloat16",
        "head_dim": 64,
    }
    for key, value in expected.items():
        assert config.get(key) == value, f"config.json {key}: {config.get(key)!r}, expected {value!r}"
    assert "rope_theta" in config, (
        "config.json rope_theta: missing, expected the rope base (transformers 4.x)"
    )
    assert written.spec == ModelSpec(4, 16, 4, (1, 2, 3)), (
        f"spec {written.spec}, expected MoE layers (1, 2, 3)"
    )


def test_weights_are_per_expert_bf16_tensors_and_the_first_layer_is_dense(written) -> None:  # type: ignore[no-untyped-def]
    with safe_open(str(written.path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in keys}
    assert dtypes == {torch.bfloat16}, f"tensor dtypes {dtypes}, expected bfloat16 only"
    for e in range(16):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            assert key in keys, f"{key}: missing, expected per-expert tensors (the layout vLLM/SGLang load)"
    assert "model.layers.1.mlp.gate.weight" in keys
    assert "model.layers.0.mlp.gate.weight" not in keys, "layer 0 has a router, expected a dense MLP"
    assert "model.layers.0.mlp.gate_proj.weight" in keys


def test_bf16_weights_load_back_bit_identical(written) -> None:  # type: ignore[no-untyped-def]
    """Every tensor transformers loads equals the in-memory model's, in bf16."""
    original = tiny_model("qwen3_moe", torch.bfloat16, seed=3, **ENGINE_OVERRIDES)
    loaded = load_checkpoint(written)
    assert loaded.dtype == torch.bfloat16, (
        f"loaded dtype {loaded.dtype}, expected bfloat16 (config torch_dtype)"
    )
    want, got = original.state_dict(), loaded.state_dict()
    assert set(want) == set(got), f"tensors differ: {sorted(set(want) ^ set(got))[:5]}"
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), f"{name}: differs after save/load"


def test_transformers_loads_it_back_with_identical_logits_and_routing(tmp_path: Path) -> None:
    """fp32: AutoModelForCausalLM.from_pretrained(dir) gives the built model's logits and routes bit for bit.

    (In bf16 the in-memory model's ``.to(bfloat16)`` also rounds the rotary ``inv_freq`` buffer,
    which the loader keeps in fp32, so only the weights are compared there.)
    """
    from transformers import AutoModelForCausalLM

    written = write_checkpoint(tmp_path, dtype=torch.float32, seed=3)
    original = tiny_model("qwen3_moe", torch.float32, seed=3, **ENGINE_OVERRIDES)
    loaded = AutoModelForCausalLM.from_pretrained(written.path).eval()
    ids = torch.randint(3, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = original(input_ids=ids, use_cache=False).logits
        got = loaded(input_ids=ids, use_cache=False).logits
    diff = (want.float() - got.float()).abs().max().item()
    assert torch.equal(want, got), f"logits after save/load differ by up to {diff:.3e}, expected identical"
    routes = []
    for model in (original, loaded):
        handle = install_replay(model)
        with torch.no_grad():
            handle.record()
            model(input_ids=ids, use_cache=False)
            routes.append(handle.recording())
        handle.remove()
    assert torch.equal(routes[0], routes[1]), "routing after save/load differs"


def test_a_changed_weight_changes_the_logits(tmp_path: Path) -> None:
    """The round-trip check can fail: a checkpoint of another seed loads back to other logits."""
    a = load_checkpoint(write_checkpoint(tmp_path / "a", dtype=torch.float32, seed=0, num_hidden_layers=2))
    b = load_checkpoint(write_checkpoint(tmp_path / "b", dtype=torch.float32, seed=1, num_hidden_layers=2))
    ids = torch.arange(3, 11)[None]
    with torch.no_grad():
        assert not torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


@pytest.mark.parametrize(
    ("config", "moe"),
    [
        ({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2}, (0, 1, 2, 3)),
        (
            {"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2},
            (1, 3),
        ),
        (
            {
                "num_hidden_layers": 3,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "mlp_only_layers": [0, 2],
            },
            (1,),
        ),
        (
            {
                "num_hidden_layers": 3,
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "first_k_dense_replace": 1,
            },
            (1, 2),
        ),
    ],
)
def test_model_spec_reads_the_moe_layers(config: dict, moe: tuple[int, ...]) -> None:  # type: ignore[type-arg]
    spec = model_spec(config)
    assert spec.moe_layer_tuple == moe, f"moe_layers {spec.moe_layer_tuple}, expected {moe}"
    assert (spec.num_experts, spec.top_k) == (8, 2)


def test_the_negated_router_copy_negates_every_router_and_nothing_else(tmp_path: Path) -> None:
    """The real-engine splice suites' weight update: a copy of the served checkpoint whose MoE routers
    (only) are negated, pushed through the engine's own loading (never edited in place)."""
    from safetensors.torch import load_file, save_file

    from harness.engines.weight_updates import negated_router_checkpoint

    checkpoint = write_checkpoint(tmp_path / "ckpt", seed=0)
    negated = negated_router_checkpoint(checkpoint.path, tmp_path / "negated")
    assert (negated / "config.json").read_text() == (checkpoint.path / "config.json").read_text()
    before, after = load_file(checkpoint.path / "model.safetensors"), load_file(negated / "model.safetensors")
    assert before.keys() == after.keys()
    routers = [name for name in before if name.endswith("mlp.gate.weight")]
    assert len(routers) == len(checkpoint.spec.moe_layers), routers
    for name, tensor in before.items():
        expected = -tensor if name in routers else tensor
        assert torch.equal(after[name], expected), name
    (tmp_path / "dense").mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "dense" / "model.safetensors")
    with pytest.raises(HarnessError, match=r"no tensor named \*\.mlp\.gate\.weight in .*dense"):
        negated_router_checkpoint(tmp_path / "dense", tmp_path / "dense-negated")
