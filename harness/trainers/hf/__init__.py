"""The transformers trainer backend: routing record/replay on ``*ForCausalLM`` MoE models.

``install_replay(model) -> HFReplay`` hooks every router of a supported family (``FAMILIES``);
``tiny_model(model_type)`` builds a random-init model of each family for the suites.
"""

from harness.trainers.hf.families import FAMILIES, RouterFamily, WeightRule, softmax_rule
from harness.trainers.hf.models import MODEL_TYPES, tiny_config, tiny_model
from harness.trainers.hf.replay import HFReplay, HFReplayError, find_routers, install_replay

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
