"""Interleaved forward timing of two copies of one model: what ``rrh bench replay`` and ``rrh bench
tap`` share.

The model is a Qwen3-MoE at random init (4 layers, 64 experts top-8 by default). Per dtype, one
copy stays bare and the other is instrumented by the bench (replay hooks, the trainer tap); their
forwards alternate copy by copy, so drift in machine speed hits both alike, and the figure is the
median of the per-pair time ratio. The result is a plain dict (the benches' ``--json``).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch

Instrument = Callable[
    [torch.nn.Module, torch.Tensor, "ForwardShape"], AbstractContextManager[Callable[[], float]]
]
"""Instruments the copy of the model it is given (of that shape) and yields the timed forward of it
on the tokens given (seconds per call)."""


@dataclass(frozen=True)
class ForwardShape:
    """The benched model and forward: ``batch`` × ``seq`` tokens through ``layers`` MoE layers."""

    batch: int = 2
    seq: int = 512
    layers: int = 4
    experts: int = 64
    top_k: int = 8
    hidden: int = 128


BENCH_SHAPE = ForwardShape()
"""The shape both benches run by default."""


def qwen3_moe(dtype: torch.dtype, shape: ForwardShape) -> torch.nn.Module:
    """A random-init Qwen3-MoE of ``shape`` (nothing downloaded)."""
    from harness.trainers.hf.models import tiny_model

    return tiny_model(
        "qwen3_moe",
        dtype,
        vocab_size=1024,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        moe_intermediate_size=shape.hidden // 2,
        num_hidden_layers=shape.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=shape.hidden // 4,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
    )


def forward_seconds(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """Wall time of one forward of ``tokens``."""
    t0 = time.perf_counter()
    model(input_ids=tokens, use_cache=False)
    return time.perf_counter() - t0


@torch.no_grad()
def bench_pairs(
    instrument: Instrument,
    *,
    with_key: str,
    target_ratio: float,
    shape: ForwardShape,
    repeats: int,
    dtypes: tuple[str, ...],
    seed: int,
) -> dict[str, Any]:
    """Per dtype: one warm-up pair, then ``repeats`` interleaved pairs of the bare and the instrumented
    copy; the medians (``without_ms``, ``with_key``) and the median per-pair ratio against
    ``target_ratio``."""
    result: dict[str, Any] = {
        "shape": asdict(shape),
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "target_ratio": target_ratio,
        "dtypes": {},
    }
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1024, (shape.batch, shape.seq), generator=generator)
    for name in dtypes:
        bare = qwen3_moe(getattr(torch, name), shape)
        with instrument(copy.deepcopy(bare), tokens, shape) as timed:
            forward_seconds(bare, tokens), timed()  # warm-up
            pairs = [(forward_seconds(bare, tokens), timed()) for _ in range(repeats)]
        without, with_it = zip(*pairs, strict=True)
        ratio = statistics.median(w / b for b, w in pairs)
        result["dtypes"][name] = {
            "without_ms": 1e3 * statistics.median(without),
            with_key: 1e3 * statistics.median(with_it),
            "ratio": ratio,
            "within_target": ratio <= target_ratio,
        }
    return result


def format_pairs(result: dict[str, Any], title: str, labels: tuple[str, str], with_key: str) -> list[str]:
    """The bench as lines of text: a header naming the model and run, then one line per dtype with
    the two medians under ``labels`` (bare, instrumented) and the ratio's verdict."""
    s = result["shape"]
    lines = [
        f"{title}: Qwen3-MoE {s['layers']} layers × {s['experts']} experts top-{s['top_k']}, hidden "
        f"{s['hidden']}, forward of {s['batch']}×{s['seq']} tokens, {result['repeats']} interleaved pairs, "
        f"{result['threads']} threads"
    ]
    for name, d in result["dtypes"].items():
        verdict = "ok" if d["within_target"] else f"ABOVE the {result['target_ratio']:.2f}× target"
        lines.append(
            f"  {name:<9} {labels[0]} {d['without_ms']:8.2f} ms  {labels[1]} {d[with_key]:8.2f} ms  "
            f"median ratio {d['ratio']:.3f}×  ({verdict})"
        )
    return lines
