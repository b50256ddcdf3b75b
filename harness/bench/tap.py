"""``rrh bench tap``: what the tap costs a trainer forward.

The model of ``rrh bench replay`` (a 4-layer, 64-expert top-8 Qwen3-MoE, random init, a forward of
2 × 512 tokens) on two copies of the same weights: one bare, one with a ``TrainerTap`` (the
harness's probe on every MoE layer, each forward's dispatch assigned to its samples and positions
from the packing metadata). Forwards alternate copy by copy, so drift in machine speed hits both
alike; the figure is the median of the per-pair time ratio, in fp32 and bf16, in one run
(``harness.bench.pairs``). The target is ≤ 1.05×. Writing happens on the tap's background thread,
outside the forward.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.audit.tap.trainer import BackgroundWriter, PackedRows, TrainerTap
from harness.bench.pairs import BENCH_SHAPE, ForwardShape, bench_pairs, format_pairs

TARGET_RATIO = 1.05


@contextmanager
def _tapped(
    model: torch.nn.Module, tokens: torch.Tensor, shape: ForwardShape
) -> Iterator[Callable[[], float]]:
    """A ``TrainerTap`` on ``model`` writing to a temporary directory; each timed forward is one
    ``old_logprob`` pass of padded rows, its capture discarded outside the timing."""
    mask = torch.ones(shape.batch, shape.seq, dtype=torch.bool)
    rows = PackedRows.padded([f"sample-{i}" for i in range(shape.batch)], mask)
    with tempfile.TemporaryDirectory(prefix="rrh-bench-tap-") as tmp:
        writer = BackgroundWriter(tmp)
        tap = TrainerTap(model, writer, num_layers=shape.layers, moe_layers=range(shape.layers),
                         num_experts=shape.experts, top_k=shape.top_k, source="rrh bench tap")  # fmt: skip

        def timed() -> float:
            t0 = time.perf_counter()
            with tap.forward("old_logprob", rows):
                model(input_ids=tokens, use_cache=False)
            seconds = time.perf_counter() - t0
            tap.discard()
            return seconds

        try:
            yield timed
        finally:
            tap.probe.remove()
            writer.close()


def bench_tap(
    shape: ForwardShape = BENCH_SHAPE,
    repeats: int = 20,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    seed: int = 0,
) -> dict[str, Any]:
    """Forward time with the tap vs without, per dtype: medians and the median per-pair ratio."""
    return bench_pairs(
        _tapped, with_key="with_tap_ms", target_ratio=TARGET_RATIO, shape=shape, repeats=repeats,
        dtypes=dtypes, seed=seed,
    )  # fmt: skip


def format_bench_tap(result: dict[str, Any]) -> str:
    """The bench as lines of text, one per dtype."""
    return "\n".join(format_pairs(result, "tap", ("untapped", "tapped"), "with_tap_ms"))
