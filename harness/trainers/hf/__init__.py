"""The transformers trainer backend: routing record/replay on ``*ForCausalLM`` MoE models.

``install_replay(model) -> HFReplay`` hooks every router of a supported family (``FAMILIES``);
``tiny_model(model_type)`` builds a random-init model of each family for the suites.
"""

from typing import Any

from harness.trainers.hf.families import FAMILIES, RouterFamily, WeightRule, softmax_rule
from harness.trainers.hf.models import MODEL_TYPES, tiny_config, tiny_model

_REPLAY = ("HFReplay", "HFReplayError", "find_routers", "install_replay")


def __getattr__(name: str) -> Any:
    """The replay names, imported on first use (PEP 562): ``replay`` imports ``harness.probes.hf``,
    which imports ``families`` and ``routers`` from this package, so an eager import here would make
    ``import harness.probes.hf`` (first in a process) circle back into a half-built module."""
    if name in _REPLAY:
        from harness.trainers.hf import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "MODEL_TYPES",
    "HFReplay",
    "HFReplayError",
    "RouterFamily",
    "WeightRule",
    "find_routers",
    "install_replay",
    "softmax_rule",
    "tiny_config",
    "tiny_model",
]
