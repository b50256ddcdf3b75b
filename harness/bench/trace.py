"""Benchmarks that print numbers (never timed tests).

``rrh bench trace`` measures the trace core on a production-sized batch: validation, set
disagreement against a perturbed copy (twice: lanes in the same order, and lanes in another
order as another kernel would return them), and save + load, each as throughput and as a ratio to
a plain numpy copy of the same bytes (so the figures travel across machines). Save + load is also
set against its floor on the same file system: writing the same bytes with fsync and reading them
back, with nothing else (no header, checksum or validation).

Each ratio is measured in pairs: the operation and its baseline timed one after the other,
``repeats`` times, and the ratio of each pair kept (a load that comes and goes slows both halves
of a pair alike); a figure is the median of its pairs, and the interquartile range of the pairs
is the noise of this run. ``check_against`` compares a run's ratios with those recorded in a JSON
file (``rrh bench trace --against``) and names each that dropped by more than the noise measured:
the two runs' and the spread between the machines of this CPU kind the file holds runs of.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import HarnessError
from harness.trace import RoutingTrace, compare, kernels, validate_routes

CHECKED_RATIOS = (
    "validate_vs_copy",
    "disagreement_vs_copy",
    "disagreement_permuted_vs_copy",
    "save_load_vs_file_floor",
)
"""The ratios ``--against`` checks: the project's code against the same work done plainly. Save +
load is checked against its file system floor (the same bytes written with fsync and read back),
not against the copy: it waits on the file system, which a busy machine slows apart from memory.
``file_floor_vs_copy`` is the file system's own figure, with none of the project's code in it."""

RECORDED_CONFIG = ("shape", "num_experts", "threads", "directory")
"""What a recorded file and a run must share for their ratios to be compared."""


class RecordedRatiosError(HarnessError):
    """A file of recorded ratios cannot be read, or was recorded with another configuration."""


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _paired_rounds(
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]], repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds of each pair's operation and baseline, timed one after the other, in ``repeats`` rounds.

    Every round times one pair of each name, so a load that changes during the run spreads over
    every figure's pairs (it shows in their quartiles) instead of shifting one figure; the order
    within a pair alternates from round to round, so that neither half always runs first.
    """
    seconds: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    for i in range(repeats):
        for name, (op, baseline) in pairs.items():
            ops, bases = seconds[name]
            if i % 2:
                ops.append(_seconds(op))
                bases.append(_seconds(baseline))
            else:
                bases.append(_seconds(baseline))
                ops.append(_seconds(op))
    return seconds


def _ratios(numerators: list[float], denominators: list[float]) -> tuple[float, list[float]]:
    """The median of the pairs' ratios, and their quartiles ``[q1, q3]``."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    if len(ratios) == 1:
        return ratios[0], [ratios[0], ratios[0]]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, [q1, q3]


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
    """Valid routes with uniformly random sets: ``(base + j) mod E`` for a random base, shuffled lanes.

    Summed in bytes where ``base + j`` cannot pass 255 (the same ids, without a temporary of
    eight bytes an id: 3.2 GB for the default batch).
    """
    base = rng.integers(0, num_experts, size=(rows, layers, 1), dtype=np.int64)
    lanes = rng.permutation(top_k)
    wide = np.uint8 if num_experts + top_k <= 256 else np.int64
    return ((base.astype(wide) + lanes.astype(wide)) % num_experts).astype(np.uint8)


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


def _disagreement(trace: RoutingTrace, routes: npt.NDArray[np.uint8]) -> tuple[float, Callable[[], object]]:
    """``compare(trace, other).disagreement`` for a trace of ``routes``, and the call that measures it.

    The value comes from one untimed call, which also loads the compiled kernel (``harness.trace.swar``).
    """
    other = RoutingTrace(routes, num_experts=trace.num_experts)
    return compare(trace, other).disagreement, lambda: compare(trace, other).disagreement


def _cpu_name() -> str:
    """The CPU's model name where Linux says it, else the machine's architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


VECTOR_ISAS = ("avx512bw", "avx2", "sse4_2")
"""x86 vector extensions, widest first: the compiled kernels' speed against a numpy copy depends on
which one the CPU has (LLVM vectorises the byte compares to its width)."""


def vector_isa() -> str:
    """The widest of ``VECTOR_ISAS`` the CPU's flags list (Linux), else the machine's architecture:
    the one CPU property recorded ratios must share with a run to be compared."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return next((isa for isa in VECTOR_ISAS if isa in flags), platform.machine() or "unknown")
    except OSError:
        pass
    return platform.machine() or "unknown"


def bench_trace(
    sequences: int = 256,
    positions: int = 4096,
    layers: int = 48,
    top_k: int = 8,
    num_experts: int = 128,
    repeats: int = 3,
    seed: int = 0,
    directory: Path | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Measure validation, disagreement and save + load against a numpy copy of the same bytes.

    ``directory`` holds save + load's file (default: the system's temporary directory);
    ``threads`` caps the kernels' threads (default: one per available CPU). Every ``*_vs_*``
    ratio is the median of ``repeats`` pairs, its ``*_quartiles`` the pairs' first and third quartiles.
    """
    with kernels.thread_limit(threads) if threads else nullcontext():
        return _bench_trace(
            sequences, positions, layers, top_k, num_experts, repeats, seed, directory, threads
        )


def _bench_trace(
    sequences: int,
    positions: int,
    layers: int,
    top_k: int,
    num_experts: int,
    repeats: int,
    seed: int,
    directory: Path | None,
    threads: int | None,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    routes = synthetic_routes(sequences * positions, layers, top_k, num_experts, rng)
    nbytes = routes.nbytes
    validate_routes(routes[:1], num_experts)  # loads the compiled kernel (harness.trace.swar)
    trace = RoutingTrace(routes, num_experts=num_experts)
    perturbed = perturb(routes, 0.1, num_experts, rng)
    disagreement, measure = _disagreement(trace, perturbed)
    # The same sets, each route's lanes shuffled as another kernel might order them: no route
    # matches word for word, so this measures the set comparison itself.
    disagreement_permuted, measure_permuted = _disagreement(trace, rng.permuted(perturbed, axis=-1))
    del perturbed
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "trace.safetensors"

        def round_trip() -> None:
            trace.save(path)
            RoutingTrace.load(path)

        def floor() -> None:
            _write_read(Path(tmp) / "raw", routes)

        figures = _paired_rounds(
            {
                "validate": (lambda: validate_routes(routes, num_experts), routes.copy),
                "disagreement": (measure, routes.copy),
                "disagreement_permuted": (measure_permuted, routes.copy),
                "save_load": (round_trip, routes.copy),
                "file_floor": (floor, routes.copy),
                "save_load_vs_file_floor": (round_trip, floor),
            },
            repeats,
        )
        file_bytes = path.stat().st_size
    save_load_s, floor_s = figures.pop("save_load_vs_file_floor")
    copies = [seconds for _, bases in figures.values() for seconds in bases]
    result: dict[str, Any] = {
        "shape": [sequences * positions, layers, top_k],
        "num_experts": num_experts,
        "dtype": str(trace.experts.dtype),
        "bytes": nbytes,
        "threads": threads or kernels.available_cpus(),
        "repeats": repeats,
        "cpu": _cpu_name(),
        "vector_isa": vector_isa(),
        "copy_gbps": nbytes / statistics.median(copies) / 1e9,
    }
    for name, (op_s, copy_s) in figures.items():
        result[f"{name}_gbps"] = nbytes / statistics.median(op_s) / 1e9
        result[f"{name}_vs_copy"], result[f"{name}_vs_copy_quartiles"] = _ratios(copy_s, op_s)
    result["save_load_vs_file_floor"], result["save_load_vs_file_floor_quartiles"] = _ratios(
        floor_s, save_load_s
    )
    result.update(
        disagreement_measured=disagreement,
        disagreement_permuted_measured=disagreement_permuted,
        directory=str(directory or tempfile.gettempdir()),
        stored_bytes_per_position_layer=trace.experts.nbytes / (routes.shape[0] * layers),
        file_bytes_per_position_layer=file_bytes / (routes.shape[0] * layers),
    )
    return result


def recorded_ratios(result: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``--record`` writes: the run's configuration and, per recorded run, each checked ratio
    with its quartiles. ``before`` (a file ``--record`` wrote) keeps its runs and gains this one, so
    the file holds every machine of this CPU kind measured so far; ``RecordedRatiosError`` when it
    was recorded with another configuration or on another CPU kind."""
    runs = []
    if before is not None:
        _same_configuration(result, before)
        other_kind = not_comparable(result, before)
        if other_kind is not None:
            raise RecordedRatiosError(f"cannot add this run to the record: {other_kind}")
        runs = list(before["runs"])
    run = {
        "cpu": result["cpu"],
        "ratios": {
            name: {"median": result[name], "quartiles": result[f"{name}_quartiles"]}
            for name in CHECKED_RATIOS
        },
    }
    return {
        "vector_isa": result["vector_isa"],
        "repeats": result["repeats"],
        **{name: result[name] for name in RECORDED_CONFIG},
        "runs": [*runs, run],
    }


def load_recorded(path: Path) -> dict[str, Any]:
    """A file ``--record`` wrote; ``RecordedRatiosError`` naming the file when it is not one."""
    try:
        recorded = json.loads(path.read_text())
        if not recorded["runs"]:
            raise ValueError("runs: expected at least one recorded run")
        for run in recorded["runs"]:
            for name in CHECKED_RATIOS:
                figure = run["ratios"][name]
                float(figure["median"]), float(figure["quartiles"][0]), float(figure["quartiles"][1])
        missing = [name for name in ("vector_isa", "repeats", *RECORDED_CONFIG) if name not in recorded]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RecordedRatiosError(
            f"{path}: not a file of recorded ratios ({type(err).__name__}: {err})"
        ) from err
    if missing:
        raise RecordedRatiosError(f"{path}: not a file of recorded ratios (no {', '.join(missing)})")
    return dict(recorded)


def not_comparable(result: dict[str, Any], recorded: dict[str, Any]) -> str | None:
    """Why ``result`` cannot be held to ``recorded``: a CPU with other vector instructions (a kernel's
    ratio to a copy is a property of the CPU kind, so another kind's record is no baseline), or
    ``None``. A file recorded before ``vector_isa`` existed is compared."""
    before = recorded.get("vector_isa")
    if before is not None and before != result["vector_isa"]:
        return (
            f"recorded on a CPU with {before}, this one's widest is {result['vector_isa']} (a kernel's "
            "ratio to a copy depends on the vector width): not compared; record this kind with --record"
        )
    return None


def _same_configuration(result: dict[str, Any], recorded: dict[str, Any]) -> None:
    for name in RECORDED_CONFIG:
        if result[name] != recorded[name]:
            raise RecordedRatiosError(
                f"{name}: this run {result[name]!r}, recorded {recorded[name]!r}; expected equal "
                "(run with the recorded options, or record again with --record)"
            )


def check_against(result: dict[str, Any], recorded: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Each checked ratio of ``result`` against ``recorded``: (name, dropped, what was seen).

    Two noises are measured, and a ratio dropped only when its median fell below both: the noise
    of a run (the interquartile range of its pairs, this run's and the slowest recorded run's,
    added) and the spread between machines of the same CPU kind (the recorded runs' highest median
    over their lowest: a copy's speed moves with the machine's memory more than the kernels do, so
    the same code has measured 1.42 and 1.17 on two hosts of one kind). The bound is the lowest
    recorded median divided by that spread, less both runs' noise. Nothing fixed: a noisy run or a
    record from far-apart hosts widens the margin, and a slower kernel moves the median down.
    ``RecordedRatiosError`` when the two were measured on different configurations.
    """
    _same_configuration(result, recorded)
    checks = []
    for name in CHECKED_RATIOS:
        q1, q3 = result[f"{name}_quartiles"]
        figures = [run["ratios"][name] for run in recorded["runs"]]
        medians = [float(figure["median"]) for figure in figures]
        lowest = figures[medians.index(min(medians))]
        low_q1, low_q3 = (float(q) for q in lowest["quartiles"])
        spread = max(medians) / min(medians)
        bound = min(medians) / spread - (q3 - q1) - (low_q3 - low_q1)
        recorded_as = (
            f"recorded {medians[0]:.2f} (quartiles {low_q1:.2f}–{low_q3:.2f})"
            if len(medians) == 1
            else f"recorded {min(medians):.2f}–{max(medians):.2f} on {len(medians)} runs "
            f"(the lowest's quartiles {low_q1:.2f}–{low_q3:.2f})"
        )
        checks.append(
            (
                name,
                result[name] < bound,
                f"{result[name]:.2f} (quartiles {q1:.2f}–{q3:.2f}), {recorded_as}: "
                f"the median must reach {bound:.2f}",
            )
        )
    return checks
