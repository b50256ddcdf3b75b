"""Instructions per byte of the trace and audit kernels, counted by callgrind: a gate no load can move.

A wall-time ratio measured on a shared machine moves with whatever else runs there (the trace
core's set disagreement fell from ~1.0× to 0.69× a numpy copy with the other core busy, FACTS §6);
the instructions a kernel executes on a fixed input do not. ``count_kernels`` runs
``harness.bench.count_child`` under ``valgrind --tool=callgrind`` with collection off, switched on
around each kernel's repeated calls only (callgrind's client requests, from a ten-line library
compiled here: ``toggle_library``), and reads the instructions of each kernel from its dump.

The counts depend on the code the CPU runs, so they are recorded per CPU kind as the counted
process saw it (``harness.bench.count_child.cpu_seen``: the architecture and numpy's widest
dispatched extension, which under valgrind is the CPU valgrind emulates); numba compiles the
kernels for the generic CPU of the architecture (``NUMBA_CPU_NAME=generic``), so its share is the
same on every machine of one architecture. ``check_counts`` fails a kernel whose count moved by
more than ``BOUND`` either way: a 2× regression fails, a faster kernel asks for the record to be
made again, and nothing else (a busy neighbour, another machine of the kind) moves a count by
more than a fraction of a percent (docs/testing.md has the figures).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.errors import HarnessError

BOUND = 1.5
"""Largest ratio either way between a kernel's count and its recorded one: a 2× slowdown fails."""
FORMAT_NAME = "rrh.instruction_counts"
FORMAT_VERSION = 1

_TOGGLE_SOURCE = """\
#include <valgrind/callgrind.h>
/* Collection on, from zero: what follows is the kernel's alone. */
void rrh_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
/* Collection off, the counts since rrh_count_start dumped under NAME. */
void rrh_count_stop(const char *name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
"""

_TRIGGER = re.compile(r"^desc: Trigger: Client Request: (.+)$", re.MULTILINE)
_TOTAL = re.compile(r"^(?:summary|totals): (\d+)", re.MULTILINE)


class CountError(HarnessError):
    """The counts cannot be taken here (no valgrind, no C compiler) or a record cannot be read."""


def toggle_library(directory: Path) -> Path:
    """Compile the two-function library that switches callgrind's collection (outside valgrind its
    requests do nothing) into ``directory``; ``CountError`` names what is missing."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise CountError("no C compiler (cc or gcc) on PATH: the count library cannot be built")
    source, library = directory / "rrh_count.c", directory / "rrh_count.so"
    source.write_text(_TOGGLE_SOURCE)
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], capture_output=True, text=True
    )
    if built.returncode != 0:
        why = built.stderr.strip().splitlines()[-1:] or ["no message"]
        raise CountError(
            f"{compiler} could not build the count library ({why[0]}; is valgrind's callgrind.h installed?)"
        )
    return library


def _child_env(numba_cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONHASHSEED="0",
        NUMBA_CPU_NAME="generic",
        NUMBA_CACHE_DIR=str(numba_cache),
        OMP_NUM_THREADS="1",
        NUMBA_NUM_THREADS="1",
    )
    return env


def count_kernels(
    names: Sequence[str] | None = None, *, repeats: int = 3, double: Sequence[str] = ()
) -> dict[str, Any]:
    """Each kernel's instructions per byte of input, counted by callgrind over ``repeats`` calls.

    ``double``: kernels run twice a repeat (a planted 2× slowdown). The kernels are first run once
    outside valgrind, so that numba's cache holds them and valgrind never counts a compilation.
    """
    from harness.bench.count_child import kernel_builders

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise CountError("valgrind is not installed: instruction counts need valgrind --tool=callgrind")
    known = list(kernel_builders())
    names = list(names or known)
    unknown = [n for n in names + list(double) if n not in known]
    if unknown:
        raise CountError(f"unknown kernel {unknown[0]!r}; expected one of {known}")
    with tempfile.TemporaryDirectory(prefix="rrh-counts-") as tmp:
        work = Path(tmp)
        library = toggle_library(work)
        env = _child_env(work / "numba")
        sizes = work / "sizes.json"
        child = [sys.executable, "-m", "harness.bench.count_child", str(library), str(sizes), "1"]
        _run(child + names, env, "the uncounted warm-up run")
        doubled = [arg for name in double for arg in ("--double", name)]
        child[-1] = str(repeats)
        counted = [
            valgrind, "--tool=callgrind", "--collect-atstart=no", "--dump-instr=no",
            f"--callgrind-out-file={work / 'callgrind.out'}", *child, *doubled, *names,
        ]  # fmt: skip
        _run(counted, env, "the counted run under callgrind")
        seen = json.loads(sizes.read_text())
        instructions = _dumped_counts(work)
    kernels = {}
    for name in names:
        if name not in instructions:
            raise CountError(f"callgrind wrote no dump for {name!r}")
        per_call = instructions[name] / repeats
        kernels[name] = {
            "instructions_per_call": per_call,
            "bytes": seen["bytes"][name],
            "instructions_per_byte": per_call / seen["bytes"][name],
        }
    return {"kind": cpu_kind(seen["cpu"]), "cpu": seen["cpu"], "repeats": repeats, "kernels": kernels}


def _run(command: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CountError(f"{what} failed (exit {done.returncode}): {tail}")


def _dumped_counts(work: Path) -> dict[str, int]:
    """Instructions per kernel from callgrind's dumps (one file per ``rrh_count_stop``)."""
    counts: dict[str, int] = {}
    for dump in sorted(work.glob("callgrind.out*")):
        text = dump.read_text(errors="replace")
        trigger, total = _TRIGGER.search(text), _TOTAL.search(text)
        if trigger and total:
            counts[trigger.group(1).strip()] = int(total.group(1))
    return counts


def cpu_kind(cpu: dict[str, Any]) -> str:
    """The record key of what the counted process saw: ``x86_64/AVX2``."""
    return f"{cpu['machine']}/{cpu['numpy_isa']}"


def load_record(path: Path) -> dict[str, Any]:
    """A file ``--record`` wrote; ``CountError`` names the path and the problem."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise CountError(f"{path}: no recorded counts; record them with --record") from None
    except (OSError, ValueError) as err:
        raise CountError(f"{path}: not a JSON file of recorded counts ({err})") from None
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT_NAME
        or doc.get("format_version") != FORMAT_VERSION
    ):
        raise CountError(f"{path}: format: expected {FORMAT_NAME!r} version {FORMAT_VERSION}")
    if not isinstance(doc.get("kinds"), dict):
        raise CountError(f"{path}: kinds: expected an object of CPU kinds")
    return doc


def recorded(result: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """``before`` (or a new record) with this run's counts as its CPU kind's."""
    doc = before or {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "bound": BOUND, "kinds": {}}
    doc["kinds"][result["kind"]] = {
        "repeats": result["repeats"],
        "numpy": _numpy_version(),
        "instructions_per_byte": {n: k["instructions_per_byte"] for n, k in result["kernels"].items()},
    }
    return doc


def _numpy_version() -> str:
    import numpy

    return str(numpy.__version__)


def check_counts(
    result: dict[str, Any], record: dict[str, Any]
) -> tuple[list[tuple[str, bool, str]], str | None]:
    """``([(kernel, moved, what), …], note)``: each kernel against its recorded count; ``note`` says
    why nothing was compared (a CPU kind with no record)."""
    kind = record["kinds"].get(result["kind"])
    if kind is None:
        return [], f"no counts recorded for CPU kind {result['kind']} (recorded: {sorted(record['kinds'])})"
    bound = float(record.get("bound", BOUND))
    checks = []
    for name, figures in result["kernels"].items():
        base = kind["instructions_per_byte"].get(name)
        if base is None:
            checks.append((name, True, "no recorded count: record again with --record"))
            continue
        ratio = figures["instructions_per_byte"] / base
        moved = not (1 / bound <= ratio <= bound)
        advice = " (faster: record again with --record)" if ratio < 1 / bound else ""
        checks.append(
            (name, moved, f"{figures['instructions_per_byte']:.2f} instructions/byte, {ratio:.4f}× the "
             f"recorded {base:.2f} (bound {bound}×){advice}")
        )  # fmt: skip
    return checks, None
