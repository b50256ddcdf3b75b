"""Whether real SGLang can start on this CPU, and why not (FACTS §6, "SGLang runs on this CPU").

SGLang publishes no CPU build, yet 0.5.23 runs on a CPU in its own CPU engine mode with two
stand-ins the project provides in ``ci/sglang_cpu`` (``tox -e sglang-cpu`` sets all of this up):

- ``SGLANG_USE_CPU_ENGINE=1`` (without it SGLang picks no CPU platform);
- the torch release SGLang pins (0.5.23: ``torch==2.14.1``; it cannot run beside torch 2.13.0);
- an importable ``sgl_kernel``: the only ``sglang-kernel`` on PyPI is a CUDA build, which fails to
  import without ``libcuda``; the import-only stand-in resolves every name and records any call;
- its routed-experts host buffer unpinned in every SGLang process (``ci/sglang_cpu/sitecustomize.py``,
  which sets ``UNPINNED_SGLANG_HOST_BUFFER``), since SGLang pins it with ``cudaHostRegister``.

``cpu_blocker`` names the first of these that is missing, in one line; nothing of SGLang is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from harness.engines.hints import sglang_cpu_hint

STANDINS = "ci/sglang_cpu"
"""The folder that must come first on ``PYTHONPATH``: the ``sgl_kernel`` stand-in and the
``sitecustomize`` that unpins the host buffer."""


ENV_PREFIX = f"SGLANG_USE_CPU_ENGINE=1 PYTHONPATH={STANDINS}"
"""What ``tox -e sglang-cpu`` sets, for a command run from the repository root in its env outside tox
(``SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=ci/sglang_cpu .tox/sglang-cpu/bin/rrh run …``)."""


def _how() -> str:
    return f"{sglang_cpu_hint()} sets it up; a command in its env outside tox: {ENV_PREFIX} COMMAND"


def _pinned_torch() -> str | None:
    """The ``torch==X`` the installed SGLang's metadata pins, or None when it pins none."""
    for line in importlib.metadata.requires("sglang") or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name == "torch" and req.marker is None:
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if pins:
                return pins[0]
    return None


def _torch_blocker(version: str) -> str | None:
    pinned = _pinned_torch()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return f"sglang {version} needs torch=={pinned or '?'}, and torch is not installed ({_how()})"
    if pinned is None:
        return None
    try:
        same = Version(torch_version).release == Version(pinned).release
    except InvalidVersion:
        same = False
    if same:
        return None
    return (
        f"sglang {version} needs torch=={pinned}, torch {torch_version} is installed (SGLang cannot run "
        f"beside another torch; {_how()})"
    )


def cpu_blocker(version: str) -> str | None:
    """Why SGLang ``version`` cannot start on this CPU, or None when its CPU mode is set up."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return (
            f"no CUDA device here, and SGLANG_USE_CPU_ENGINE is not 1: sglang {version} runs on a CPU only "
            f"in its CPU engine mode ({_how()})"
        )
    blocker = _torch_blocker(version)
    if blocker is not None:
        return blocker
    try:
        importlib.import_module("sgl_kernel")
    except (ImportError, OSError) as err:
        why = (str(err).splitlines() or [type(err).__name__])[0]
        return (
            f"sgl_kernel cannot be imported on this CPU ({why}): the only "
            f"sglang-kernel on PyPI is a CUDA build; put the stand-in folder {STANDINS} first on "
            f"PYTHONPATH ({_how()})"
        )
    if not getattr(sys.modules.get("sitecustomize"), "UNPINNED_SGLANG_HOST_BUFFER", False):
        return (
            f"{STANDINS}/sitecustomize.py is not loaded: SGLang would pin its routed-experts host buffer "
            f"with cudaHostRegister (no NVIDIA driver); put {STANDINS} first on PYTHONPATH ({_how()})"
        )
    return None
