"""Megatron-core's own ``RouterReplay`` (PyPI ``megatron-core`` 0.16.1) as a subject.

Megatron-core ships replay itself (``megatron/core/transformer/moe/router_replay.py``, enabled with
``moe_enable_routing_replay=True``): its ``RouterReplay`` actions are the controller and
``RouterReplay.set_replay_data`` takes one target tensor per router. The harness's Megatron backend
(``harness.trainers.megatron.subject``) is exactly that, with the canonical data movement in
front; this subject reuses it rather than a twin, and adds only the release check, so its verdict
describes 0.16.1. Until the Megatron suites run against a subject's capabilities,
``suites/test_megatron.py`` (which drives Megatron-core's ``RouterReplay`` through the same backend)
is its verdict (``harness.verdicts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.subjects import Subject
from harness.subjects.frameworks import require_release
from harness.trainers.megatron.subject import MEGATRON_DATA, MEGATRON_DRIVER

VERSION = "0.16.1"


class _ReleaseDriver:
    """Megatron-core's ``RouterReplay`` driver, refusing to run on another release."""

    def patch(self) -> None:
        require_release("megatron-core", VERSION, f"mcore-{VERSION}")
        MEGATRON_DRIVER.patch()

    def config_overrides(self) -> Mapping[str, Any]:
        return MEGATRON_DRIVER.config_overrides()

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        require_release("megatron-core", VERSION, f"mcore-{VERSION}")
        return MEGATRON_DRIVER.install(model, config)


MCORE_0_16_1 = Subject(
    name=f"megatron-core-{VERSION}",
    install_megatron_replay=_ReleaseDriver(),
    megatron_data=MEGATRON_DATA,
)
