"""The real engines' adapters by name (``vllm``, ``sglang``), and a checkpoint each serves correctly.

What the conformance tests, the gate and the mismatch lab share, so a caller names an engine and
never branches on it: ``engine_class("sglang")`` is ``SGLangEngine``; ``engine_checkpoint`` writes
the harness checkpoint with the overrides that adapter declares (``checkpoint_overrides``: SGLang's
Qwen3-MoE builds every layer as MoE, so its checkpoint has no dense layer). Nothing is imported
until asked for.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from harness.engines.checkpoint import TinyCheckpoint, write_checkpoint
from harness.errors import HarnessError

REAL_ENGINES = {"vllm": "harness.engines.vllm:VLLMEngine", "sglang": "harness.engines.sglang:SGLangEngine"}
"""Engine name → its adapter class (``module:Class``)."""


def engine_class(name: str) -> Any:
    """The adapter class of engine ``name``; ``HarnessError`` naming the known engines otherwise."""
    if name not in REAL_ENGINES:
        raise HarnessError(f"engine: {name!r}; expected one of {', '.join(REAL_ENGINES)}")
    module, _, cls = REAL_ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def engine_checkpoint(name: str, directory: str | os.PathLike[str], **overrides: Any) -> TinyCheckpoint:
    """``write_checkpoint(directory, …)`` as engine ``name`` serves it: its adapter's
    ``checkpoint_overrides``, then ``overrides``."""
    return write_checkpoint(directory, **{**engine_class(name).checkpoint_overrides, **overrides})
