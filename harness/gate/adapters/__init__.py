"""The engines the gate observes, by name: one ``EngineAdapter`` each (``rrh gate --engine NAME``).

``base``: the protocol (``installed_version``, ``convention``, ``start``, ``observe``), the
``Observation`` an adapter returns and the ``ObservationError`` a failed probe raises;
``reference``, ``hf``, ``served`` (vLLM and SGLang): the adapters.
"""

from __future__ import annotations

from harness.errors import HarnessError
from harness.gate.adapters.base import EngineAdapter, Observation, ObservationError, Suites
from harness.gate.adapters.hf import HFAdapter
from harness.gate.adapters.reference import ReferenceAdapter
from harness.gate.adapters.served import ServedAdapter

ADAPTERS: dict[str, EngineAdapter] = {
    adapter.name: adapter
    for adapter in (
        ReferenceAdapter(),
        HFAdapter(),
        ServedAdapter("vllm", "harness.engines.vllm:VLLMEngine"),
        ServedAdapter("sglang", "harness.engines.sglang:SGLangEngine"),
    )
}
"""Engine name → its adapter."""

ENGINES: tuple[str, ...] = tuple(ADAPTERS)

__all__ = [
    "ADAPTERS",
    "ENGINES",
    "EngineAdapter",
    "Observation",
    "ObservationError",
    "Suites",
    "UnknownEngine",
    "adapter",
]


class UnknownEngine(HarnessError, ValueError):
    """No adapter has this engine name."""


def adapter(engine: str) -> EngineAdapter:
    """The adapter of ``engine``; ``UnknownEngine`` naming the known engines otherwise."""
    try:
        return ADAPTERS[engine]
    except KeyError:
        raise UnknownEngine(
            f"engine: unknown engine {engine!r}; expected one of {', '.join(ENGINES)}"
        ) from None
