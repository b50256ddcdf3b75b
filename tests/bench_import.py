"""Throughput of ``rrh audit``'s framework importers: a verl RolloutSkip dump and a SkyRL training
input, per GiB of dump, against reading the same files' bytes.

``python -m tests.bench_import [--samples N] [--length T] [--layers L] [--top-k K] [--repeats R]``
writes one step of each dump in the format its release writes (the synthetic writers of
``tests/test_audit_import_frameworks.py``: verl's pickled ``DataProto`` over a consolidated
TensorDict, SkyRL's pickled ``TrainingInputBatch``; the same files the release-written tests compare
them with), then times on one process, each the median of ``--repeats``:

- ``read``: the dump's bytes read into memory (the page cache is warm: the floor of any importer);
- ``import``: ``importers.import_dump`` — the allowlisted unpickling, the checks of every declared
  size, the conversion to the run layout and its Parquet write.

Figures are MiB of dump per second and seconds per GiB. A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harness.audit.importers import import_dump
from tests.test_audit_import_frameworks import Sample, _skyrl_synthetic, _verl_synthetic

E = 128
GROUP = 4


def rollout(samples: int, length: int, layers: int, top_k: int, seed: int = 0) -> list[Sample]:
    """``samples`` samples of ``length`` tokens (a quarter prompt, shared within each group of
    ``GROUP``), routes of ``top_k`` distinct ids on every MoE layer (layer 0 dense), one row short of
    the length as an engine returns them."""
    rng = np.random.default_rng(seed)
    prompt_len = length // 4
    out = []
    for i in range(samples):
        if i % GROUP == 0:
            prompt = rng.integers(2, 1000, prompt_len)
        start = rng.integers(0, E, size=(length - 1, layers, 1))
        routes = ((start + np.arange(top_k)) % E).astype(np.int32)
        routes[:, 0] = 0
        response = rng.integers(2, 1000, length - prompt_len)
        logprobs = -rng.exponential(1.0, size=len(response)).astype(np.float32)
        out.append(Sample(i // GROUP, prompt, response, routes, logprobs))
    return out


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(name: str, dump: Path, moe_layers: tuple[int, ...], repeats: int) -> dict[str, float]:
    """``read`` and ``import`` seconds of the dump at ``dump`` (importer ``name``), and its bytes."""
    files = [p for p in dump.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)

    def read() -> None:
        for p in files:
            p.read_bytes()

    def convert() -> None:
        with tempfile.TemporaryDirectory(prefix="rrh-bench-import-") as target:
            import_dump(name, dump, target, num_experts=E, moe_layers=moe_layers)

    read()
    return {
        "bytes": size,
        "read": _median_seconds(read, repeats),
        "import": _median_seconds(convert, repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    samples = rollout(args.samples, args.length, args.layers, args.top_k)
    moe_layers = tuple(range(1, args.layers))
    print(
        f"{args.samples} samples × {args.length} tokens × {args.layers} layers × top-{args.top_k}, "
        f"{E} experts, one step; median of {args.repeats}"
    )
    with tempfile.TemporaryDirectory(prefix="rrh-bench-import-") as tmp:
        root = Path(tmp)
        _verl_synthetic(root / "verl", {1: samples})
        _skyrl_synthetic(root / "skyrl", {1: samples}, {})
        for name in ("verl", "skyrl"):
            f = bench(name, root / name, moe_layers, args.repeats)
            mib = f["bytes"] / 2**20
            print(
                f"  {name:<6} {mib:7.1f} MiB  read {mib / f['read']:8.0f} MiB/s  import "
                f"{mib / f['import']:6.1f} MiB/s ({f['import'] / f['bytes'] * 2**30:5.1f} s per GiB, "
                f"{f['read'] / f['import']:.3f}× the read)"
            )


if __name__ == "__main__":
    main()
