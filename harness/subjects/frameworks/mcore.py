"""Megatron-core's own ``RouterReplay`` (PyPI ``megatron-core`` 0.16.1, 0.19.2) as release subjects.

The shipped subject ``harness.subjects.megatron_core:MEGATRON_CORE`` is Megatron-core's class API
and nothing else (``moe_enable_routing_replay=True``, ``RouterReplay`` actions, ``set_replay_data``,
``get_recorded_data``); these subjects reuse it rather than a twin, and only add the release check,
so that each recorded verdict (``fixtures/verdicts/mcore-<version>.json``) describes that release.

From 0.17 ``RouterReplay`` also has a static-buffer mode for CUDA graphs
(``megatron/core/transformer/moe/router_replay.py``): ``set_global_static_buffers(buffer)`` binds
instance ``i`` of ``global_router_replay_instances`` — by list position, not layer number — to the
slice ``buffer[:, i, :]``; ``record_indices`` then copies each forward's ids into that slice and
``get_recorded_indices`` returns a view of it, which the next RECORD forward overwrites.
``MCORE_0_19_2_STATIC`` drives that mode: its driver binds one buffer for every router it installs
on, exactly as a CUDA-graph caller does, and its data movement is Megatron-core's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from harness.subjects import Subject
from harness.subjects.frameworks import require_release
from harness.subjects.megatron_core import MEGATRON_CORE, CoreController

STATIC_BUFFER_TOKENS = 4096
"""Rows of the static buffer: a CUDA-graph caller sizes it for its largest captured batch; the
suites' micro-batches hold at most a few hundred local tokens."""


class _ReleaseDriver:
    """``MEGATRON_CORE`` 's driver, refusing to run on another Megatron-core release."""

    def __init__(self, driver: Any, version: str) -> None:
        self.driver = driver
        self.version = version

    def _require(self) -> None:
        require_release("megatron-core", self.version, f"mcore-{self.version}")

    @property
    def patches_nothing(self) -> bool:
        """``PatchesNothing`` as the wrapped driver says (``install`` still checks the release)."""
        return bool(getattr(self.driver, "patches_nothing", False))

    def patch(self) -> None:
        self._require()
        self.driver.patch()

    def config_overrides(self) -> Mapping[str, Any]:
        return self.driver.config_overrides()

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        self._require()
        return self.driver.install(model, config)


class _StaticBufferDriver(_ReleaseDriver):
    """The release's driver, then one static buffer ``[tokens, routers, top_k]`` for all routers
    (``RouterReplay.set_global_static_buffers``), so that every RECORD copies into it."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> CoreController:
        controller = super().install(model, config)
        from megatron.core.transformer.moe.router_replay import RouterReplay

        routers = len(RouterReplay.global_router_replay_instances)
        device = next(model[0].parameters()).device
        buffer = torch.zeros(
            STATIC_BUFFER_TOKENS, routers, int(config.moe_router_topk), dtype=torch.long, device=device
        )
        RouterReplay.set_global_static_buffers(buffer)
        return controller


def release_subject(version: str, *, static_buffers: bool = False) -> Subject:
    """Megatron-core ``version`` 's ``RouterReplay``, in its default or static-buffer mode."""
    driver_type = _StaticBufferDriver if static_buffers else _ReleaseDriver
    mode = " static buffers" if static_buffers else ""
    return Subject(
        name=f"megatron-core-{version}{mode}",
        install_megatron_replay=driver_type(MEGATRON_CORE.install_megatron_replay, version),
        megatron_data=MEGATRON_CORE.megatron_data,
    )


MCORE_0_16_1 = release_subject("0.16.1")
MCORE_0_19_2 = release_subject("0.19.2")
MCORE_0_19_2_STATIC = release_subject("0.19.2", static_buffers=True)
