"""Reference implementation of MoE routing replay: the executable specification.

Pure torch, no harness imports. Start with `routers.py` (families, record/replay state), then
`model.py` (the MoE LM that uses them; `config.py` describes it), `engine.py` (the KV-cache
rollout engine that stands in for vLLM/SGLang), `episode.py` (the schedule of an episode's
attempts and the one driver that plays it through any engine), `splice.py` (building a sample's
trace from its attempts), `layouts.py` (the trainer's layouts) and `training.py` (R2, R3 and the
reference pass).
"""

import importlib
from typing import Any

# Names are imported on first use (PEP 562), so that ``reference_impl.axes`` — the one module the
# harness's trace core needs — does not bring torch with it.
_SUBMODULES = ("layouts", "splice", "training")
_NAMES = {
    "DTYPES": "config", "ROUTER_FAMILIES": "config", "ConfigError": "config", "MoEConfig": "config",
    "Rollout": "engine", "RolloutEngine": "engine",
    "AttemptPlan": "episode", "Episode": "episode", "EpisodeError": "episode", "Schedule": "episode",
    "run_episode": "episode",
    "KVCache": "model", "MoEBlock": "model", "MoELM": "model",
    "FAMILIES": "routers", "ReplayError": "routers", "ReplayTargets": "routers", "Router": "routers",
    "RouterFamily": "routers", "RouterReplay": "routers", "RoutingMode": "routers", "make_family": "routers",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DTYPES",
    "FAMILIES",
    "ROUTER_FAMILIES",
    "AttemptPlan",
    "ConfigError",
    "Episode",
    "EpisodeError",
    "KVCache",
    "MoEBlock",
    "MoEConfig",
    "MoELM",
    "ReplayError",
    "ReplayTargets",
    "Rollout",
    "RolloutEngine",
    "Router",
    "RouterFamily",
    "RouterReplay",
    "RoutingMode",
    "Schedule",
    "layouts",
    "make_family",
    "run_episode",
    "splice",
    "training",
]
