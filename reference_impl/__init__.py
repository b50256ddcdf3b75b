"""Reference implementation of MoE routing replay: the executable specification.

Pure torch, no harness imports. Start with `routers.py` (families, record/replay state), then
`model.py` (the MoE LM that uses them; `config.py` describes it), `engine.py` (the KV-cache
rollout engine that stands in for vLLM/SGLang), `episode.py` (the schedule of an episode's
attempts and the one driver that plays it through any engine), `splice.py` (building a sample's
trace from its attempts), `layouts.py` (the trainer's layouts) and `training.py` (R2, R3 and the
reference pass).
"""

from . import layouts, splice, training
from .config import DTYPES, ROUTER_FAMILIES, ConfigError, MoEConfig
from .engine import Rollout, RolloutEngine
from .episode import AttemptPlan, Episode, EpisodeError, Schedule, run_episode
from .model import KVCache, MoEBlock, MoELM
from .routers import (
    FAMILIES,
    ReplayError,
    ReplayTargets,
    Router,
    RouterFamily,
    RouterReplay,
    RoutingMode,
    make_family,
)

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
