"""``rrh bench replay``: what the transformers replay hooks cost a forward.

A 4-layer, 64-expert top-8 Qwen3-MoE (random init) runs a forward of 2 × 512 tokens on two copies
of the same weights: one bare, one with ``install_replay`` hooks armed with the model's own natural
routing (so both copies run the same experts on the same tokens and only the hooks differ). The
forwards alternate copy by copy, so drift in machine speed hits both alike; the figure is the median
over repetitions of the per-pair time ratio, in fp32 and bf16 (``harness.bench.pairs``). The target
is ≤ 1.10×.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from harness.bench.pairs import BENCH_SHAPE, ForwardShape, bench_pairs, format_pairs, forward_seconds

TARGET_RATIO = 1.10


@contextmanager
def _armed(hooked: torch.nn.Module, tokens: torch.Tensor, _: ForwardShape) -> Iterator[Callable[[], float]]:
    """Replay hooks on ``hooked``, armed with the routing its own forward of ``tokens`` records."""
    from harness.trainers.hf.replay import install_replay

    handle = install_replay(hooked)
    handle.record()
    hooked(input_ids=tokens, use_cache=False)
    handle.replay(handle.recording())
    try:
        yield lambda: forward_seconds(hooked, tokens)
    finally:
        handle.remove()


def bench_replay(
    shape: ForwardShape = BENCH_SHAPE,
    repeats: int = 15,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    seed: int = 0,
) -> dict[str, Any]:
    """Forward time with replay hooks armed vs without, per dtype: medians and the median ratio."""
    return bench_pairs(
        _armed, with_key="with_replay_ms", target_ratio=TARGET_RATIO, shape=shape, repeats=repeats,
        dtypes=dtypes, seed=seed,
    )  # fmt: skip


def format_bench_replay(result: dict[str, Any]) -> str:
    """The bench as lines of text, one per dtype."""
    return "\n".join(format_pairs(result, "replay hooks", ("without", "armed"), "with_replay_ms"))
