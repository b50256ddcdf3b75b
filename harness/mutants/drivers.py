"""A framework-shaped replay driver for the reference model, correct, and its one-bug forms.

Frameworks do not drive replay through the model's own helpers: they patch a router class's
constructor (verl's ``apply_router_replay_patch`` patches ``TopKRouter.__init__``; Megatron-core's
``TopKRouter`` appends each ``RouterReplay`` to a class-level list in build order), keep the routers
in process-global state, order them by walking module names, and keep per-micro-batch state in a
controller. ``ConstructorPatchDriver`` does all of that correctly:

- ``patch()`` wraps ``Router.__init__`` so that every router built afterwards registers itself in a
  process-global registry; ``unpatch()`` restores the constructor;
- ``install(model)`` refuses, loudly, a model holding a router the patch never saw (built, or deep-
  copied from one built, before ``patch()``: an MTP head, a critic);
- each controller keeps its own model's routers, in layer order, and ``disarm()`` gives each router a
  fresh replay state.

Each ``Bug`` flips exactly one of those choices to what shipped somewhere (``harness.mutants.replay``
lists the mutants, ``harness.mutants.benign`` the correct driver).
"""

from __future__ import annotations

import enum
import re
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from reference_impl import MoELM, RoutingMode
from reference_impl.routers import ReplayError, Router, RouterReplay, pop_recording, set_replay_targets


class Bug(enum.Enum):
    """The one wrong choice a ``ConstructorPatchDriver`` makes (``NONE``: it is correct)."""

    NONE = "none"
    SKIPS_UNPATCHED_ROUTERS = "routers built before patch() are left routing natively, silently"
    GLOBAL_BY_LAYER = (
        "routers kept in a process-global registry keyed by layer: the last installed model wins"
    )
    NAME_ORDER = "routers ordered by module name as strings (layers.10 < layers.2)"
    DISARM_KEEPS_TARGETS = "disarm() clears the recompute queue and recordings, leaves the routers replaying"


_BUILT: weakref.WeakSet[Router] = weakref.WeakSet()
"""Every router constructed while a ``ConstructorPatchDriver`` patch was on (process-global)."""
_BY_LAYER: dict[int, Router] = {}
"""``Bug.GLOBAL_BY_LAYER``'s registry: decoder layer → the router installed last."""


def _layer_key(name: str) -> tuple[int, ...]:
    """Natural order of a module name: the integers in it (``layers.2`` before ``layers.10``)."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


class RegistryController:
    """One model's replay control over the routers a ``ConstructorPatchDriver`` registered."""

    def __init__(self, model: MoELM, routers: list[Router | None], bug: Bug) -> None:
        self.model, self.bug = model, bug
        self._routers = routers  # slot i ↔ MoE layer i; None: a router this controller leaves alone
        self._layers = [r.layer if r is not None else None for r in routers]

    def _live(self) -> list[Router | None]:
        if self.bug is Bug.GLOBAL_BY_LAYER:
            return [None if layer is None else _BY_LAYER.get(layer) for layer in self._layers]
        return self._routers

    def _states(self) -> list[RouterReplay]:
        return [r.replay for r in self._live() if r is not None]

    def _slots(self) -> list[int]:
        return [i for i, r in enumerate(self._live()) if r is not None]

    def _set_mode(self, mode: RoutingMode) -> None:
        for state in self._states():
            state.mode = mode

    def record(self) -> None:
        for state in self._states():
            state.clear()
        self._set_mode(RoutingMode.RECORD)

    def recording(self) -> Tensor:
        routes = pop_recording(self._states())
        self._set_mode(RoutingMode.NATIVE)
        return routes

    def replay(self, targets: Tensor, mask: Tensor | None = None) -> None:
        targets = torch.as_tensor(targets)
        if targets.ndim != 3 or targets.shape[1] != len(self._routers):
            raise ReplayError(
                f"replay targets have shape {list(targets.shape)}, expected [tokens, {len(self._routers)}, k]"
            )
        slots = self._slots()
        layers = [layer for i in slots if (layer := self._layers[i]) is not None]  # a live slot has one
        set_replay_targets(self._states(), targets[:, slots, :], mask, layers)
        self._set_mode(RoutingMode.REPLAY_FORWARD)

    def prepare_backward(self) -> None:
        self._set_mode(RoutingMode.REPLAY_BACKWARD)

    def disarm(self) -> None:
        for router in self._live():
            if router is None:
                continue
            if self.bug is Bug.DISARM_KEEPS_TARGETS:
                router.replay.backward_targets.clear()
                router.replay.recorded.clear()
            else:  # a fresh state, as a framework re-creating its per-router replay object would
                old = router.replay
                router.replay = RouterReplay(old.where, old.num_experts, old.top_k)


_TAG = "_rrh_built_under_patch"
"""The attribute a tagging ``ConstructorPatchDriver``'s patched constructor sets on each router."""


class ConstructorPatchDriver:
    """Replay through a patched ``Router.__init__`` and a process-global registry (see the module).

    ``by_tag``: the patched constructor marks each router with an attribute and ``install`` knows the
    routers by it (as a patch that sets a flag on ``self`` does); a deep copy keeps the mark, so a
    part is "built before the patch" only when it was built while this process had no patch on.
    """

    def __init__(self, bug: Bug = Bug.NONE, *, by_tag: bool = False) -> None:
        self.bug = bug
        self.by_tag = by_tag
        self._original: Callable[..., None] | None = None

    def _seen(self, router: Router) -> bool:
        return bool(getattr(router, _TAG, False)) if self.by_tag else router in _BUILT

    def patch(self) -> None:
        if self._original is not None:
            return
        original = Router.__init__
        self._original = original

        def registering_init(router: Router, *args: Any, **kwargs: Any) -> None:
            original(router, *args, **kwargs)
            _BUILT.add(router)
            setattr(router, _TAG, True)

        Router.__init__ = registering_init  # type: ignore[method-assign,assignment]

    def unpatch(self) -> None:
        if self._original is not None:
            Router.__init__ = self._original  # type: ignore[method-assign]
            self._original = None

    def install(self, model: MoELM) -> RegistryController:
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, Router)]
        if self.bug is Bug.NAME_ORDER:
            named.sort(key=lambda item: item[0])
        else:
            named.sort(key=lambda item: _layer_key(item[0]))
        unseen = [m.layer for _, m in named if not self._seen(m)]
        if unseen and self.bug is not Bug.SKIPS_UNPATCHED_ROUTERS:
            raise ReplayError(
                f"routers of decoder layers {unseen} were built before patch() (or copied from such a "
                "model): they cannot replay; build the model after patch()"
            )
        routers: list[Router | None] = [m if self._seen(m) else None for _, m in named]
        if self.bug is Bug.GLOBAL_BY_LAYER:
            _BY_LAYER.update({r.layer: r for r in routers if r is not None})
        return RegistryController(model, routers, self.bug)
