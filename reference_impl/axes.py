"""The layer axis of a trace: its two conventions, in a module without torch.

Kept apart from ``config.py`` so that readers of traces (the harness's trace type and its audit
of run files) name the convention without importing torch.
"""

from __future__ import annotations

import enum


class LayerAxis(str, enum.Enum):
    """What the layer axis of a trace indexes (DESIGN §2 "layer axis").

    The one definition of the two conventions and of their width rule: the reference engine and
    trainer, the harness's trace type, engine conventions and strategies all use it. A `str` enum,
    so ``"decoder"`` and ``LayerAxis.DECODER`` are interchangeable as arguments.
    """

    DECODER = "decoder"
    """One slot per hidden layer; dense-layer slots hold filler (vLLM ≠ 0.21, SGLang)."""
    MOE_ORDINAL = "moe_ordinal"
    """One slot per MoE layer, in model order (vLLM 0.21, Megatron R2 recordings)."""

    @classmethod
    def parse(cls, value: object) -> LayerAxis:
        """`value` (a `LayerAxis` or its string) as a `LayerAxis`; a ValueError naming the field otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"layer_axis = {value!r}: expected one of {[axis.value for axis in cls]}"
            ) from None
