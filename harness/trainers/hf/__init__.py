"""The transformers trainer backend: routing record/replay on ``*ForCausalLM`` MoE models.

``install_replay(model) -> HFReplay`` hooks every router of a supported family
(``harness.conventions.hf_families``, found by ``harness.conventions.hf_routers``);
``tiny_model(model_type)`` builds a random-init model of each family for the suites.
"""

from harness.trainers.hf.models import MODEL_TYPES, tiny_config, tiny_model
from harness.trainers.hf.replay import HFReplay, HFReplayError, install_replay

__all__ = ["MODEL_TYPES", "HFReplay", "HFReplayError", "install_replay", "tiny_config", "tiny_model"]
