"""Which inference engine is installed here, the convention of its version, and importing it.

Shared by the vLLM and SGLang adapters: neither engine is ever imported at module import time,
and an engine that is missing (or a machine without CUDA) is an ``EngineUnavailable`` that says so.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from harness.conventions import Convention, resolve
from harness.engines.checkpoint import EngineUnavailable

NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
"""Engine (= distribution) name → how people write it."""


def installed_version(engine: str) -> str | None:
    """The installed engine's version (``importlib.metadata``), or None when it is not installed."""
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_convention(engine: str, version: str | None = None) -> Convention:
    """The convention of ``version`` (default: the installed one); ``ConventionError`` if none covers it."""
    version = version or installed_version(engine)
    if version is None:
        raise EngineUnavailable(
            f"{engine}: {NAMES[engine]} is not installed (pip install 'routing-replay-harness[{engine}]'); "
            "no version to resolve"
        )
    return resolve(engine, version)


def import_engine(engine: str) -> Any:
    """Import the engine for a run: it must be installed and this machine must have CUDA."""
    if installed_version(engine) is None:
        raise EngineUnavailable(
            f"{engine}: {NAMES[engine]} is not installed (extra '{engine}'); the {NAMES[engine]} adapter "
            "cannot start"
        )
    import torch

    if not torch.cuda.is_available():
        raise EngineUnavailable(
            f"{engine}: no CUDA device on this machine; the {NAMES[engine]} adapter needs a GPU"
        )
    return importlib.import_module(engine)
