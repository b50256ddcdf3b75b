"""The registry of every engine version's convention: which convention an engine version follows.

``resolve`` is the one way from an engine's name and version to its convention; an unknown engine,
a version that is not PEP 440, or one outside every known range is a ``ConventionError`` naming
what is known.
"""

from __future__ import annotations

from harness.conventions.convention import Convention, EngineConventions, ModelSpec
from harness.conventions.sglang import SGLANG_ENGINE
from harness.conventions.vllm import VLLM
from harness.errors import ConventionError
from harness.trace import RoutingTrace

_BY_ENGINE: dict[str, EngineConventions] = {e.engine: e for e in (VLLM, SGLANG_ENGINE)}

ENGINES = tuple(_BY_ENGINE)
"""The engines with conventions: ``("vllm", "sglang")``."""

CONVENTIONS: tuple[Convention, ...] = tuple(c for e in _BY_ENGINE.values() for c in e.conventions)
"""Every convention, engine by engine, oldest first."""


def known_ranges(engine: str | None = None) -> str:
    """``"vllm-0.14 >=0.14,<0.16; …"`` for the error messages (every engine's when ``engine`` is None)."""
    engines = _BY_ENGINE.values() if engine is None else [_BY_ENGINE[engine]]
    return "; ".join(e.known_ranges() for e in engines)


def resolve(engine: str, version: str) -> Convention:
    """The convention of ``engine`` at ``version``; pre-releases resolve by their release part.

    Unknown engines and versions outside every range raise ``ConventionError`` naming the known
    engines and ranges.
    """
    name = str(engine).strip().lower()
    if name not in _BY_ENGINE:
        raise ConventionError(f"engine: unknown engine {engine!r}; known engines: {', '.join(ENGINES)}")
    return _BY_ENGINE[name].resolve(version)


def decode_payload(
    engine: str,
    version: str,
    payload: object,
    *,
    model: ModelSpec,
    prompt_len: int,
    response_len: int,
    start: int = 0,
) -> RoutingTrace:
    """``resolve(engine, version).decode(payload, …)`` with the version recorded in provenance."""
    return resolve(engine, version).decode(
        payload, model=model, prompt_len=prompt_len, response_len=response_len, start=start, version=version
    )
