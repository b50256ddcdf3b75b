"""The process ``rrh bench counts`` runs under callgrind: each kernel on its fixed input, counted alone.

``python -m harness.bench.count_child LIBRARY OUT REPEATS [--double NAME] NAME...`` builds each
named kernel's input (seeded, the same bytes on every machine), calls the kernel once uncounted
(numba loads its compiled code, numpy its buffers), then calls it ``REPEATS`` times between the
two calls of ``LIBRARY`` (``harness.bench.counts.toggle_library``): the first switches callgrind's
collection on, the second off and dumps the counts under the kernel's name. Everything else the
process does (the interpreter starting, imports, building inputs) is never collected. ``OUT``
receives, as JSON, each kernel's bytes of input and what the process saw of the CPU.

``--double NAME`` runs that kernel twice a repeat: the planted 2× slowdown that proves the gate
fails on one (``tests/test_bench_counts.py``).
"""

from __future__ import annotations

import ctypes
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROWS, LAYERS, TOP_K, NUM_EXPERTS = 4096, 48, 8, 128
"""The fixed input: 1.5 MiB of uint8 routes, under ``harness.trace.kernels.PARALLEL_MIN_BYTES``, so
every kernel runs on the calling thread (no thread scheduling in the count)."""

Kernel = tuple[Callable[[], object], int]
"""A kernel ready to call on its input, and the bytes of routes it reads a call."""


def _routes(seed: int) -> np.ndarray:
    from harness.bench.trace import synthetic_routes

    return synthetic_routes(ROWS, LAYERS, TOP_K, NUM_EXPERTS, np.random.default_rng(seed))


def _trace_kernels() -> dict[str, Callable[[], Kernel]]:
    from harness.bench.trace import perturb
    from harness.trace import RoutingTrace, compare, validate_routes

    def validate() -> Kernel:
        routes = _routes(0)
        return (lambda: validate_routes(routes, NUM_EXPERTS)), routes.nbytes

    def disagreement(permuted: bool) -> Callable[[], Kernel]:
        def build() -> Kernel:
            routes = _routes(0)
            other = perturb(routes, 0.05, NUM_EXPERTS, np.random.default_rng(1))
            if permuted:
                other = np.ascontiguousarray(other[..., ::-1])
            a, b = RoutingTrace(routes, num_experts=NUM_EXPERTS), RoutingTrace(other, num_experts=NUM_EXPERTS)
            return (lambda: compare(a, b).disagreement), routes.nbytes * 2

        return build

    def save_load() -> Kernel:
        trace = RoutingTrace(_routes(0), num_experts=NUM_EXPERTS)
        return (lambda: RoutingTrace.from_bytes(trace.to_bytes())), trace.experts.nbytes

    return {
        "trace.validate": validate,
        "trace.disagreement": disagreement(False),
        "trace.disagreement_permuted": disagreement(True),
        "trace.save_load": save_load,
    }


def _audit_kernels() -> dict[str, Callable[[], Kernel]]:
    from harness.audit.checks import kernels
    from harness.audit.checks.repeat_kernels import repeated_runs

    samples = 16
    bounds = np.linspace(0, ROWS, samples + 1).astype(np.int64)
    owner = np.repeat(np.arange(samples), np.diff(bounds))

    def load_and_digests() -> Kernel:
        routes = _routes(0)
        slots = np.arange(LAYERS, dtype=np.intp)
        captured = np.ones(ROWS, dtype=bool)
        prompt = np.zeros(ROWS, dtype=bool)
        prompt[bounds[:-1]] = True  # each sample's first rows: its prompt's digest
        group = owner // 4
        return (
            lambda: kernels.load_and_digests(routes, slots, captured, group, 4, NUM_EXPERTS, prompt)
        ), routes.nbytes

    def agreement() -> Kernel:
        rng = np.random.default_rng(2)
        overlap = np.where(rng.random((ROWS, LAYERS)) < 0.05, TOP_K - 1, TOP_K).astype(np.uint8)
        keep = np.ones(ROWS, dtype=bool)
        return (
            lambda: kernels.agreement(overlap, keep, owner // 4, 4, owner, samples, TOP_K)
        ), overlap.nbytes

    def repeats() -> Kernel:
        routes = _routes(3)
        captured = np.ones(ROWS, dtype=bool)
        return (lambda: repeated_runs(routes, captured, bounds[:-1], bounds[1:])), routes.nbytes

    return {
        "audit.load_and_digests": load_and_digests,
        "audit.agreement": agreement,
        "audit.repeated_runs": repeats,
    }


def kernel_builders() -> dict[str, Callable[[], Kernel]]:
    """Every counted kernel by name: the trace core's and the audit's."""
    return _trace_kernels() | _audit_kernels()


def cpu_seen() -> dict[str, Any]:
    """What this process sees of the CPU: the architecture and numpy's widest dispatched extension
    (under valgrind, the CPU valgrind emulates, which is what the counts depend on)."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as features  # type: ignore[no-redef]
    widest = next(
        (isa for isa in ("AVX512_SKX", "AVX2", "SSE42", "ASIMD", "VSX") if features.get(isa)), "baseline"
    )
    return {"machine": platform.machine() or "unknown", "numpy_isa": widest}


def main(argv: list[str]) -> int:
    library, out, repeats, *rest = argv
    doubled = set()
    while rest and rest[0] == "--double":
        doubled.add(rest[1])
        rest = rest[2:]
    toggle = ctypes.CDLL(library)
    toggle.rrh_count_stop.argtypes = [ctypes.c_char_p]
    builders = kernel_builders()
    sizes = {}
    for name in rest:
        call, nbytes = builders[name]()
        call()  # uncounted: compiled code loaded, buffers first touched
        calls = int(repeats) * (2 if name in doubled else 1)
        toggle.rrh_count_start()
        for _ in range(calls):
            call()
        toggle.rrh_count_stop(name.encode())
        sizes[name] = nbytes
    Path(out).write_text(json.dumps({"bytes": sizes, "repeats": int(repeats), "cpu": cpu_seen()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
