"""Every mutant, by name. ``--rr-subject harness.mutants.registry:<name>`` loads one as a subject."""

from __future__ import annotations

from harness.mutants import (
    Mutant,
    conventions,
    layouts,
    megatron,
    parallel,
    passes,
    replay,
    router_rules,
    serving,
    splice,
    training,
)
from harness.subjects import Subject

MUTANTS: tuple[Mutant, ...] = (
    *serving.MUTANTS,
    *splice.MUTANTS,
    *layouts.MUTANTS,
    *replay.MUTANTS,
    *router_rules.MUTANTS,
    *conventions.MUTANTS,
    *training.MUTANTS,
    *passes.MUTANTS,
    *parallel.MUTANTS,
    *megatron.MUTANTS,
)

_BY_NAME = {m.name: m for m in MUTANTS}


def get(name: str) -> Mutant:
    """The mutant called ``name``; ``KeyError`` lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no mutant {name!r}; known: {', '.join(_BY_NAME)}") from None


def __getattr__(name: str) -> Subject:
    """``registry.<mutant-name>`` is that mutant's subject (names may hold dashes: use getattr)."""
    if name in _BY_NAME:
        return _BY_NAME[name].subject
    raise AttributeError(name)
