"""Running a subject's replay driver: patch once per process, control one model, tear down cleanly.

Isolation of global patches (DESIGN §4 "subject seam"):

- ``patch()`` runs once per process per driver (``ensure_patched``, or ``prepare``, which the suites
  call *before they build* the models a driver will control: a driver may patch a router class's
  constructor, as verl's ``apply_router_replay_patch`` patches ``TopKRouter.__init__``, and a model
  built — or deep-copied from one built — before the patch has routers that never saw it);
- every controller is disarmed — and its hooks removed when it is ``Removable`` — when its
  ``controlled`` block ends, so the next test gets a model that routes natively;
- ``unpatch_all()`` undoes every driver's patches at the end of a pytest session (the plugin calls
  it), so ``rrh mutants``, which runs each mutant's suites in the same process one after another,
  starts each subject unpatched;
- a driver without ``unpatch()`` cannot be undone: once it has patched, patching *another* driver
  that patches in the same process is a ``PatchIsolationError`` — run such subjects one per process
  (``rrh check --subject`` and the Megatron suites, which spawn fresh rank processes, already do). A
  bare ``model -> controller`` callable (``CallableDriver``) patches nothing and is never refused,
  nor is a driver that declares it patches nothing (``PatchesNothing``: Megatron-core's own replay).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from harness.errors import HarnessError
from harness.subjects.capabilities import (
    CallableDriver,
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


def patches(driver: Any) -> bool:
    """Whether ``driver`` may patch the process: every driver object may, unless it declares it patches
    nothing (``PatchesNothing``); a bare callable never does."""
    return not isinstance(driver, CallableDriver) and not bool(getattr(driver, "patches_nothing", False))


def ensure_patched(driver: Any) -> None:
    """Run ``driver.patch()`` unless it already ran in this process (nothing for a bare callable; a
    driver that patches nothing runs its no-op ``patch()`` and is not counted)."""
    if not isinstance(driver, CallableDriver) and not patches(driver):
        driver.patch()
        return
    if not patches(driver) or any(d is driver or d == driver for d in _patched):
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


@contextmanager
def unpatched(driver: Any) -> Iterator[bool]:
    """A block in which ``driver`` has not patched this process, so that what it builds is built as
    before ``patch()`` (the next ``prepare`` / ``ensure_patched`` patches again).

    Yields True when that holds: the driver never patched here, patches nothing (a bare callable),
    or patched last and can undo it (``unpatch()`` runs now). Yields False when it cannot be undone
    here (no ``unpatch()``, or another driver patched on top of it): the caller builds in a fresh
    process instead. A check of "a part built before the patch" that builds in an already-patched
    process would build a patched part and pass whatever the driver does with unpatched ones.
    """
    if not patches(driver):
        yield True
        return
    mine = [i for i, d in enumerate(_patched) if d is driver or d == driver]
    if not mine:
        yield True
        return
    if mine != [len(_patched) - 1] or not isinstance(driver, Unpatchable):
        yield False
        return
    _patched.pop()
    driver.unpatch()
    yield True


def prepare(capability: object, name: str = "install_replay") -> ReplayDriver:
    """``capability`` as a driver whose ``patch()`` has run: call it before building the models it
    will control (the protocol promises ``install`` models built after ``patch()``)."""
    driver: ReplayDriver = as_driver(capability, name)
    ensure_patched(driver)
    return driver


def install(capability: object, model: Any, name: str = "install_replay") -> ReplayController:
    """Patch (once) and install ``capability`` (a driver or a bare callable) on ``model``.

    The controller must have every ``ReplayController`` member; a missing one is ``MissingMember``
    naming it (the suites turn it into a skip).
    """
    controller = prepare(capability, name).install(model)
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
