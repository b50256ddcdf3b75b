"""Megatron-core's own ``RouterReplay`` (PyPI ``megatron-core`` 0.16.1) as a release subject.

The shipped subject ``harness.subjects.megatron_core:MEGATRON_CORE`` is Megatron-core's class API
and nothing else (``moe_enable_routing_replay=True``, ``RouterReplay`` actions, ``set_replay_data``,
``get_recorded_data``); this subject reuses it rather than a twin, and only adds the release check,
so that its recorded verdict (``fixtures/verdicts/mcore-0.16.1.json``) describes 0.16.1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.subjects import Subject
from harness.subjects.frameworks import require_release
from harness.subjects.megatron_core import MEGATRON_CORE

VERSION = "0.16.1"


class _ReleaseDriver:
    """``MEGATRON_CORE`` 's driver, refusing to run on another Megatron-core release."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def patch(self) -> None:
        require_release("megatron-core", VERSION, f"mcore-{VERSION}")
        self.driver.patch()

    def config_overrides(self) -> Mapping[str, Any]:
        return self.driver.config_overrides()

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        require_release("megatron-core", VERSION, f"mcore-{VERSION}")
        return self.driver.install(model, config)


MCORE_0_16_1 = Subject(
    name=f"megatron-core-{VERSION}",
    install_megatron_replay=_ReleaseDriver(MEGATRON_CORE.install_megatron_replay),
    megatron_data=MEGATRON_CORE.megatron_data,
)
