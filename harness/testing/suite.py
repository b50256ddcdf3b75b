"""What a suite test takes from the harness's pytest integration: the subject's capabilities
(declared by a marker, asked for with :func:`require`) and the subject's spec (:func:`subject_spec`).

Suites import this module, never the plugin: the plugin sits above the suites (DESIGN §4) and
drives this module (it opens each test's record and reads the markers).

A suite test declares what it exercises with ``@pytest.mark.capability("splice", ...)`` (on the
test, its module's ``pytestmark`` or a parametrization); the pytest plugin reads the marker at
collection, skips the test when the subject lacks a declared capability (naming it), and selects
tests by it (``--rr-capability``). Inside the test, :func:`require` hands the capability out and
records that the test asked for it, so the run's summary counts what tests actually used, not what
they declare (observe, don't trust). A property-based test describes its example with
``hypothesis.note`` under the :data:`COUNTEREXAMPLE` label; the plugin puts those notes on the
failure's report.

The plugin opens one :class:`Uses` per test with :func:`using`; a nested run (``rrh check`` inside a
test) opens its own and the enclosing one comes back when it ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.subjects import DEFAULT_SUBJECT, Subject
from harness.subjects.capabilities import CapabilityView

MARKER = "capability"
"""``@pytest.mark.capability(name, ...)``: the subject capabilities a suite test exercises."""

COUNTEREXAMPLE = "counterexample: "
"""The label of a suite's ``hypothesis.note``: a property-based suite test describes its example in
words, ``note(f"counterexample: {schedule.describe()}")``; hypothesis keeps the notes of the failing
example on the error, and the report takes the labelled ones (:func:`counterexample_notes`)."""

NAMESPACES = ("layouts", "training", "megatron_data")
"""Capabilities whose value is an object of functions (a module, an instance, a namespace)."""


@dataclass
class Uses:
    """The capabilities one test declares and those it has asked for so far, in order."""

    nodeid: str
    declared: tuple[str, ...]
    used: list[str] = field(default_factory=list)


def subject_spec(config: pytest.Config) -> str:
    """The ``--rr-subject`` spec (or ``$RR_SUBJECT``, or the reference): spawned ranks load the
    subject from it, a spec and not an object."""
    return str(config.getoption("--rr-subject") or os.environ.get("RR_SUBJECT") or DEFAULT_SUBJECT)


_current: ContextVar[Uses | None] = ContextVar("rrh_capability_uses", default=None)


def declared(item: pytest.Item) -> tuple[str, ...]:
    """The capabilities ``item`` declares (its own marks, its class's and module's, its
    parametrization's), each once, in order."""
    return tuple(dict.fromkeys(name for mark in item.iter_markers(MARKER) for name in mark.args))


@contextmanager
def using(nodeid: str, capabilities: tuple[str, ...]) -> Iterator[Uses]:
    """The record of one test's capability uses, current while the test runs."""
    uses = Uses(nodeid, capabilities)
    token = _current.set(uses)
    try:
        yield uses
    finally:
        _current.reset(token)


def current() -> Uses | None:
    """The running test's record, or ``None`` outside a test (a spawned rank, a script)."""
    return _current.get()


def require(subject: Subject, capability: str) -> Any:
    """The subject's ``capability``, for a test that declares it (``@pytest.mark.capability``).

    Asking for a capability the test does not declare fails the test: the marker is what selects
    it for a mutant of that capability and what skips it on a subject without it. A member that a
    namespace capability lacks is a skip naming it, not an ``AttributeError``.
    """
    uses = _current.get()
    if uses is not None:
        if capability not in uses.declared:
            pytest.fail(
                f"{uses.nodeid} asks for capability {capability!r} without declaring it: "
                f"add @pytest.mark.{MARKER}({capability!r})",
                pytrace=False,
            )
        uses.used.append(capability)
    value = subject.require(capability)
    if capability in NAMESPACES:
        return CapabilityView(value, capability, subject.name, on_missing=pytest.skip)
    return value


def counterexample_notes(err: BaseException) -> tuple[str, ...]:
    """The suite's own counterexample notes on a failure, without their label.

    Hypothesis attaches the notes of the failing example to the error (``__notes__``, PEP 678),
    after its own; a group of distinct failures carries them on its first member that has some.
    """
    notes = [
        n.removeprefix(COUNTEREXAMPLE) for n in getattr(err, "__notes__", ()) if n.startswith(COUNTEREXAMPLE)
    ]
    if notes:
        return tuple(notes)
    for member in getattr(err, "exceptions", ()):
        found = counterexample_notes(member)
        if found:
            return found
    return ()
