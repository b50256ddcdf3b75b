"""``rrh bench tap``: what the tap costs a trainer forward.

The model of ``rrh bench replay`` (a 4-layer, 64-expert top-8 Qwen3-MoE, random init, a forward of
2 × 512 tokens) on two copies of the same weights: one bare, one with a ``TrainerTap`` (the
harness's probe on every MoE layer, each forward's dispatch assigned to its samples and positions
from the packing metadata). Forwards alternate copy by copy, so drift in machine speed hits both
alike; the figure is the median of the per-pair time ratio, in fp32 and bf16, in one run. The
target is ≤ 1.05×. Writing happens on the tap's background thread, outside the forward.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from typing import Any

import torch

from harness.audit.tap import BackgroundWriter, PackedRows, TrainerTap
from harness.bench_replay import _qwen3_moe, _seconds

TARGET_RATIO = 1.05


def _tapped_seconds(model: torch.nn.Module, tap: TrainerTap, tokens: torch.Tensor, rows: PackedRows) -> float:
    t0 = time.perf_counter()
    with tap.forward("old_logprob", rows):
        model(input_ids=tokens, use_cache=False)
    seconds = time.perf_counter() - t0
    tap.discard()
    return seconds


@torch.no_grad()
def bench_tap(
    batch: int = 2,
    seq: int = 512,
    layers: int = 4,
    experts: int = 64,
    top_k: int = 8,
    hidden: int = 128,
    repeats: int = 20,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    seed: int = 0,
) -> dict[str, Any]:
    """Forward time with the tap vs without, per dtype: medians and the median per-pair ratio."""
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
    rows = PackedRows.padded([f"sample-{i}" for i in range(batch)], torch.ones(batch, seq, dtype=torch.bool))
    for name in dtypes:
        bare = _qwen3_moe(getattr(torch, name), hidden, layers, experts, top_k)
        tapped = copy.deepcopy(bare)
        with tempfile.TemporaryDirectory(prefix="rrh-bench-tap-") as tmp:
            writer = BackgroundWriter(tmp)
            tap = TrainerTap(tapped, writer, num_layers=layers, moe_layers=range(layers), num_experts=experts,
                             top_k=top_k, source="rrh bench tap")  # fmt: skip
            _seconds(bare, tokens), _tapped_seconds(tapped, tap, tokens, rows)  # warm-up
            pairs = [
                (_seconds(bare, tokens), _tapped_seconds(tapped, tap, tokens, rows)) for _ in range(repeats)
            ]
            tap.probe.remove()
            writer.close()
        without, with_tap = zip(*pairs, strict=True)
        ratio = statistics.median(w / b for b, w in pairs)
        result["dtypes"][name] = {
            "without_ms": 1e3 * statistics.median(without),
            "with_tap_ms": 1e3 * statistics.median(with_tap),
            "ratio": ratio,
            "within_target": ratio <= TARGET_RATIO,
        }
    return result


def format_bench_tap(result: dict[str, Any]) -> str:
    """The bench as lines of text, one per dtype."""
    s = result["shape"]
    lines = [
        f"tap: Qwen3-MoE {s['layers']} layers × {s['experts']} experts top-{s['top_k']}, "
        f"hidden {s['hidden']}, forward of {s['batch']}×{s['seq']} tokens, {result['repeats']} "
        f"interleaved pairs, {result['threads']} threads"
    ]
    for name, d in result["dtypes"].items():
        verdict = "ok" if d["within_target"] else f"ABOVE the {result['target_ratio']:.2f}× target"
        lines.append(
            f"  {name:<9} untapped {d['without_ms']:8.2f} ms  tapped {d['with_tap_ms']:8.2f} ms  "
            f"median ratio {d['ratio']:.3f}×  ({verdict})"
        )
    return "\n".join(lines)
