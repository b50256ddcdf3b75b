"""Capability coverage: which public functions of the reference's capabilities the suites call.

``RECORDING`` is the reference subject with every capability function wrapped to count its calls
(replay handles too: each method of the handle an installer returns). Running the suites against
it and finding a public function that was never called names a blind spot: a capability whose
wrong answer no suite could see (tests/test_capability_coverage.py fails on one).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from harness.subjects import CAPABILITIES, Subject
from harness.subjects.reference import REFERENCE

CALLS: Counter[str] = Counter()
"""Calls per ``capability`` or ``capability.function`` since the process started (or was cleared)."""

HANDLE_METHODS = ("record", "recording", "replay", "prepare_backward", "disarm")
"""The ``ReplayController`` protocol's methods, counted for each replay installer (``dispatched`` is
optional and never evidence: the harness's probes observe dispatch)."""

SPAWNED = ("install_megatron_replay", "megatron_data")
"""Capabilities exercised only inside spawned rank processes (``suites/test_megatron.py``), whose
calls this process cannot count; they are left out of the recording and of ``never_called``."""


class _Namespace:
    """Attributes of a recorded module capability (hashable, unlike ``SimpleNamespace``)."""


class _RecordedHandle:
    """A replay handle whose protocol methods count their calls under ``capability.method``."""

    def __init__(self, handle: Any, capability: str) -> None:
        self._handle, self._capability = handle, capability

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._handle, name)
        if name in HANDLE_METHODS:
            return _counted(f"{self._capability}.{name}", value)
        return value


def _counted(key: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        CALLS[key] += 1
        return function(*args, **kwargs)

    return wrapper


def public_functions(capability: str, value: Any) -> list[str]:
    """The names under which ``value``'s public functions are counted.

    A callable capability counts as itself (and, for a replay installer, each handle method); a
    module counts the public functions *defined in it* (not those it imports).
    """
    if inspect.ismodule(value):
        return [
            f"{capability}.{name}"
            for name, member in vars(value).items()
            if not name.startswith("_") and inspect.isfunction(member) and member.__module__ == value.__name__
        ]
    if capability.startswith("install"):
        return [capability, *(f"{capability}.{m}" for m in HANDLE_METHODS)]
    return [capability]


def recording(subject: Subject) -> Subject:
    """``subject`` with every capability counting its calls in ``CALLS``."""
    changes: dict[str, Any] = {}
    for capability in CAPABILITIES:
        value = getattr(subject, capability)
        if value is None or capability in SPAWNED:
            continue
        if inspect.ismodule(value):
            namespace = _Namespace()
            for name in dir(value):
                if name.startswith("_"):
                    continue
                member = getattr(value, name)
                if inspect.isfunction(member):
                    member = _counted(f"{capability}.{name}", member)
                setattr(namespace, name, member)
            changes[capability] = namespace
        elif capability.startswith("install"):
            installer = value

            def install(model: Any, _installer: Any = installer, _cap: str = capability) -> Any:
                CALLS[_cap] += 1
                return _RecordedHandle(_installer(model), _cap)

            changes[capability] = install
        else:
            changes[capability] = _counted(capability, value)
    return replace(subject, name=f"{subject.name} (recording calls)", **changes)


RECORDING = recording(REFERENCE)
"""The reference, recording its capability calls: ``--rr-subject harness.testing.coverage:RECORDING``."""


def never_called(subject: Subject = REFERENCE) -> list[str]:
    """Public functions of ``subject``'s capabilities that ``CALLS`` has not seen."""
    names = [
        key
        for capability in CAPABILITIES
        if getattr(subject, capability) is not None and capability not in SPAWNED
        for key in public_functions(capability, getattr(subject, capability))
    ]
    return [name for name in names if CALLS[name] == 0]


def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Stop a coverage run (loaded with ``-p harness.testing.coverage``) once every public function has
    been called: the remaining tests could add no evidence, only minutes."""
    if not never_called():
        item.session.shouldstop = "every public capability function has been called"
