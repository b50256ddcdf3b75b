"""Running a subject's replay driver: patch once per process, control one model, tear down cleanly.

Isolation of global patches (DESIGN §4 "subject seam"):

- ``patch()`` runs once per process per driver (``ensure_patched``), before the first model is
  handed to ``install``;
- every controller is disarmed — and its hooks removed when it is ``Removable`` — when its
  ``controlled`` block ends, so the next test gets a model that routes natively;
- ``unpatch_all()`` undoes every driver's patches at the end of a pytest session (the plugin calls
  it), so ``rrh mutants``, which runs each mutant's suites in the same process one after another,
  starts each subject unpatched;
- a driver without ``unpatch()`` cannot be undone: once it has patched, patching *another* driver in
  the same process is a ``PatchIsolationError`` — run such subjects one per process (``rrh check
  --subject`` and the Megatron suites, which spawn fresh rank processes, already do).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.errors import HarnessError
from harness.subjects.capabilities import (
    MissingMember,
    Removable,
    ReplayController,
    ReplayDriver,
    Unpatchable,
    as_driver,
    missing_members,
)


class PatchIsolationError(HarnessError, RuntimeError):
    """Two drivers' global patches would meet in one process and one of them cannot be undone."""


_patched: list[Any] = []  # drivers whose patch() ran in this process, in order


def ensure_patched(driver: Any) -> None:
    """Run ``driver.patch()`` unless it already ran in this process."""
    if any(d is driver or d == driver for d in _patched):
        return
    stuck = [d for d in _patched if not isinstance(d, Unpatchable)]
    if stuck:
        raise PatchIsolationError(
            f"{type(stuck[0]).__name__} patched this process and has no unpatch(); run "
            f"{type(driver).__name__} in its own process (one subject per process)"
        )
    driver.patch()
    _patched.append(driver)


def unpatch_all() -> None:
    """Undo every undoable driver's patches, newest first (the pytest plugin calls it at session end)."""
    while _patched:
        driver = _patched[-1]
        if not isinstance(driver, Unpatchable):
            return  # cannot be undone: later drivers are refused by ensure_patched
        _patched.pop()
        driver.unpatch()


def install(capability: object, model: Any, name: str = "install_replay") -> ReplayController:
    """Patch (once) and install ``capability`` (a driver or a bare callable) on ``model``.

    The controller must have every ``ReplayController`` member; a missing one is ``MissingMember``
    naming it (the suites turn it into a skip).
    """
    driver: ReplayDriver = as_driver(capability, name)
    ensure_patched(driver)
    controller = driver.install(model)
    missing = missing_members(controller, ReplayController)
    if missing:
        raise MissingMember(
            f"{name}: the controller {type(controller).__name__} has no "
            f"{', '.join(repr(m) for m in missing)} "
            "(ReplayController)"
        )
    return controller


def teardown(controller: object) -> None:
    """Native routing again: disarm, and take the hooks off when the controller can."""
    try:
        controller.disarm()  # type: ignore[attr-defined]
    finally:
        if isinstance(controller, Removable):
            controller.remove()


@contextmanager
def controlled(capability: object, model: Any, name: str = "install_replay") -> Iterator[ReplayController]:
    """``install`` for the duration of a block; ``teardown`` after it, whatever happened."""
    controller = install(capability, model, name)
    try:
        yield controller
    finally:
        teardown(controller)
