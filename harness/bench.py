"""Benchmarks that print numbers (never timed tests).

``rrh bench trace`` measures the trace core on a production-sized batch: validation, set
disagreement against a perturbed copy (twice: lanes in the same order, and lanes in another
order as another kernel would return them), and save + load, each as throughput and as a ratio to
a plain numpy copy of the same bytes measured in the same run (so the figures travel across
machines). Save + load is also set against its floor on the same file system: writing the same
bytes with fsync and reading them back, with nothing else (no header, checksum or validation).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.trace import RoutingTrace, compare, validate_routes


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _write_read(path: Path, array: npt.NDArray[Any]) -> None:
    """Write ``array``'s bytes to ``path`` with fsync and read them back: what any save + load costs."""
    with open(path, "wb") as handle:
        handle.write(array.data)
        handle.flush()
        os.fsync(handle.fileno())
    back = np.empty_like(array)
    with open(path, "rb", buffering=0) as handle:
        handle.readinto(back.data)


def synthetic_routes(
    rows: int, layers: int, top_k: int, num_experts: int, rng: np.random.Generator
) -> npt.NDArray[np.uint8]:
    """Valid routes with uniformly random sets: ``(base + j) mod E`` for a random base, shuffled lanes."""
    base = rng.integers(0, num_experts, size=(rows, layers, 1), dtype=np.int64)
    lanes = rng.permutation(top_k)
    return ((base + lanes) % num_experts).astype(np.uint8)


def perturb(
    routes: npt.NDArray[np.uint8], fraction: float, num_experts: int, rng: np.random.Generator
) -> Any:
    """A copy in which ``fraction`` of the (row, layer) routes swap one id for an id outside the route."""
    out = routes.copy()
    top_k = routes.shape[-1]
    flip = rng.random(routes.shape[:2]) < fraction
    # Every route is a run of top_k consecutive ids (mod E), so base + top_k is never in it.
    out[flip, 0] = ((routes[flip].min(axis=-1).astype(np.int64) + top_k) % num_experts).astype(np.uint8)
    return out


def _time_disagreement(
    trace: RoutingTrace, routes: npt.NDArray[np.uint8], repeats: int
) -> tuple[float, float]:
    """``compare(trace, other).disagreement`` for a trace of ``routes``, and its median seconds.

    Measured after one untimed call, which loads the compiled kernel (``harness.trace.swar``).
    """
    other = RoutingTrace(routes, num_experts=trace.num_experts)
    disagreement = compare(trace, other).disagreement
    return disagreement, _median_seconds(lambda: compare(trace, other).disagreement, repeats)


def bench_trace(
    sequences: int = 256,
    positions: int = 4096,
    layers: int = 48,
    top_k: int = 8,
    num_experts: int = 128,
    repeats: int = 3,
    seed: int = 0,
    directory: Path | None = None,
) -> dict[str, Any]:
    """Measure validation, disagreement and save + load against a numpy copy of the same bytes.

    ``directory`` holds save + load's file (default: the system's temporary directory).
    """
    rng = np.random.default_rng(seed)
    routes = synthetic_routes(sequences * positions, layers, top_k, num_experts, rng)
    nbytes = routes.nbytes
    copy_s = _median_seconds(routes.copy, repeats)
    validate_routes(routes[:1], num_experts)  # loads the compiled kernel (harness.trace.swar)
    validate_s = _median_seconds(lambda: validate_routes(routes, num_experts), repeats)
    trace = RoutingTrace(routes, num_experts=num_experts)
    perturbed = perturb(routes, 0.1, num_experts, rng)
    disagreement, compare_s = _time_disagreement(trace, perturbed, repeats)
    # The same sets, each route's lanes shuffled as another kernel might order them: no route
    # matches word for word, so this measures the set comparison itself.
    shuffled = rng.permuted(perturbed, axis=-1)
    del perturbed
    disagreement_permuted, compare_permuted_s = _time_disagreement(trace, shuffled, repeats)
    del shuffled
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "trace.safetensors"

        def round_trip() -> None:
            trace.save(path)
            RoutingTrace.load(path)

        save_load_s = _median_seconds(round_trip, repeats)
        file_bytes = path.stat().st_size
        floor_s = _median_seconds(lambda: _write_read(Path(tmp) / "raw", routes), repeats)
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    return {
        "shape": [sequences * positions, layers, top_k],
        "num_experts": num_experts,
        "dtype": str(trace.experts.dtype),
        "bytes": nbytes,
        "copy_gbps": gbps(copy_s),
        "validate_gbps": gbps(validate_s),
        "validate_vs_copy": copy_s / validate_s,
        "disagreement_gbps": gbps(compare_s),
        "disagreement_vs_copy": copy_s / compare_s,
        "disagreement_measured": disagreement,
        "disagreement_permuted_gbps": gbps(compare_permuted_s),
        "disagreement_permuted_vs_copy": copy_s / compare_permuted_s,
        "disagreement_permuted_measured": disagreement_permuted,
        "save_load_gbps": gbps(save_load_s),
        "save_load_vs_copy": copy_s / save_load_s,
        "file_floor_gbps": gbps(floor_s),
        "file_floor_vs_copy": copy_s / floor_s,
        "save_load_vs_file_floor": floor_s / save_load_s,
        "directory": str(directory or tempfile.gettempdir()),
        "stored_bytes_per_position_layer": trace.experts.nbytes / (routes.shape[0] * layers),
        "file_bytes_per_position_layer": file_bytes / (routes.shape[0] * layers),
    }
