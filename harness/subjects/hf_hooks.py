"""The harness's transformers replay hooks shipped as a subject of their own (the FSDP / SkyRL path).

``--rr-subject harness.subjects.hf_hooks:HF_HOOKS``: only ``install_hf_replay``, as a
``ReplayDriver`` (nothing to patch: hooks are per model and ``remove()`` takes them off).
"""

from __future__ import annotations

from typing import Any

from harness.subjects import Subject


class HFHooksDriver:
    """``ReplayDriver`` over ``harness.trainers.hf.install_replay`` (family rules, install self-check)."""

    def patch(self) -> None:
        """Hooks are per model: nothing global to patch."""

    def unpatch(self) -> None:
        """Nothing global to undo."""

    def install(self, model: Any) -> Any:
        from harness.trainers.hf import install_replay

        return install_replay(model)


HF_HOOKS = Subject(name="transformers hooks", install_hf_replay=HFHooksDriver())
