"""``rrh bench replay``: what the transformers replay hooks cost a forward.

A 4-layer, 64-expert top-8 Qwen3-MoE (random init) runs a forward of 2 × 512 tokens on two copies
of the same weights: one bare, one with ``install_replay`` hooks armed with the model's own natural
routing (so both copies run the same experts on the same tokens and only the hooks differ). The
forwards alternate copy by copy, so drift in machine speed hits both alike; the figure is the median
over repetitions of the per-pair time ratio, in fp32 and bf16. The target is ≤ 1.10×.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

TARGET_RATIO = 1.10


def _qwen3_moe(dtype: torch.dtype, hidden: int, layers: int, experts: int, top_k: int) -> torch.nn.Module:
    from harness.trainers.hf.models import tiny_model

    return tiny_model(
        "qwen3_moe",
        dtype,
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        num_experts=experts,
        num_experts_per_tok=top_k,
    )


def _seconds(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(input_ids=tokens, use_cache=False)
    return time.perf_counter() - t0


@torch.no_grad()
def bench_replay(
    batch: int = 2,
    seq: int = 512,
    layers: int = 4,
    experts: int = 64,
    top_k: int = 8,
    hidden: int = 128,
    repeats: int = 15,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    seed: int = 0,
) -> dict[str, Any]:
    """Forward time with replay hooks armed vs without, per dtype: medians and the median ratio."""
    from harness.trainers.hf.replay import install_replay

    result: dict[str, Any] = {
        "shape": {
            "batch": batch,
            "seq": seq,
            "layers": layers,
            "experts": experts,
            "top_k": top_k,
            "hidden": hidden,
        },
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "target_ratio": TARGET_RATIO,
        "dtypes": {},
    }
    tokens = torch.randint(0, 1024, (batch, seq), generator=torch.Generator().manual_seed(seed))
    for name in dtypes:
        bare = _qwen3_moe(getattr(torch, name), hidden, layers, experts, top_k)
        hooked = copy.deepcopy(bare)
        handle = install_replay(hooked)
        handle.record()
        hooked(input_ids=tokens, use_cache=False)
        handle.replay(handle.recording())
        _seconds(bare, tokens), _seconds(hooked, tokens)  # warm-up
        pairs = [(_seconds(bare, tokens), _seconds(hooked, tokens)) for _ in range(repeats)]
        handle.remove()
        without, with_replay = zip(*pairs, strict=True)
        ratio = statistics.median(w / b for b, w in pairs)
        result["dtypes"][name] = {
            "without_ms": 1e3 * statistics.median(without),
            "with_replay_ms": 1e3 * statistics.median(with_replay),
            "ratio": ratio,
            "within_target": ratio <= TARGET_RATIO,
        }
    return result


def format_bench_replay(result: dict[str, Any]) -> str:
    """The bench as lines of text, one per dtype."""
    s = result["shape"]
    lines = [
        f"replay hooks: Qwen3-MoE {s['layers']} layers × {s['experts']} experts top-{s['top_k']}, hidden "
        f"{s['hidden']}, forward of {s['batch']}×{s['seq']} tokens, {result['repeats']} interleaved pairs, "
        f"{result['threads']} threads"
    ]
    for name, d in result["dtypes"].items():
        verdict = "ok" if d["within_target"] else f"ABOVE the {result['target_ratio']:.2f}× target"
        lines.append(
            f"  {name:<9} without {d['without_ms']:8.2f} ms  armed {d['with_replay_ms']:8.2f} ms  "
            f"median ratio {d['ratio']:.3f}×  ({verdict})"
        )
    return "\n".join(lines)
