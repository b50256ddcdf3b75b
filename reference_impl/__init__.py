"""Reference implementation of MoE routing replay: the executable specification.

Pure torch, no harness imports. Start with `routers.py` (families, record/replay state), then
`model.py` (the MoE LM that uses them); `config.py` describes the model.
"""

from .config import DTYPES, ROUTER_FAMILIES, ConfigError, MoEConfig
from .model import KVCache, MoEBlock, MoELM
from .routers import (
    FAMILIES,
    ReplayError,
    ReplayTargets,
    Router,
    RouterFamily,
    RoutingMode,
    make_family,
)

__all__ = [
    "DTYPES",
    "FAMILIES",
    "ROUTER_FAMILIES",
    "ConfigError",
    "KVCache",
    "MoEBlock",
    "MoEConfig",
    "MoELM",
    "ReplayError",
    "ReplayTargets",
    "Router",
    "RouterFamily",
    "RoutingMode",
    "make_family",
]
