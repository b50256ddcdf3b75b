"""A suite's verdict must not depend on what ran before it in the process (issue 34).

``test_a_part_built_before_the_patch_is_replayed_or_refused`` builds a part "before the driver's
patch": after an earlier test patched the process, that part would be built patched and a driver that
leaves pre-patch routers native would pass. The check undoes an undoable driver's patch for the
build, and builds in a fresh process for a driver without ``unpatch()``. Here each case runs after a
test that patches first (the deep-model case comes earlier in the file), in both orders, and the
plugin's seeded shuffle (``--rr-order-seed``) is checked to be a permutation that a seed fixes.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Any

import pytest

from harness.check.suites import CheckOutcome, run_suites, suites_dir
from harness.mutants.drivers import Bug, ConstructorPatchDriver
from harness.pytest_plugin import shuffled
from harness.subjects.reference import REFERENCE
from reference_impl.model import MoELM


class _NoUnpatch:
    """A driver whose patch cannot be undone (no ``unpatch()``): the constructor-patch driver inside."""

    def __init__(self, inner: ConstructorPatchDriver) -> None:
        self._inner = inner

    def patch(self) -> None:
        self._inner.patch()

    def install(self, model: MoELM) -> Any:
        return self._inner.install(model)


STUCK_NATIVE = replace(
    REFERENCE,
    name="stuck-tagged-driver-leaving-pre-patch-routers-native",
    install_replay=_NoUnpatch(ConstructorPatchDriver(Bug.SKIPS_UNPATCHED_ROUTERS, by_tag=True)),
)
"""Leaves routers built before its patch routing natively, and cannot be unpatched: a bug."""
STUCK_CORRECT = replace(
    REFERENCE, name="stuck-tagged-driver", install_replay=_NoUnpatch(ConstructorPatchDriver(by_tag=True))
)
"""Refuses routers built before its patch loudly, and cannot be unpatched: correct."""

PATCH_FIRST = "reference and (deep_model or part_built)"
"""The deep-model case patches the process; the part-built case comes after it in the file."""
PART_BUILT = "test_a_part_built_before_the_patch_is_replayed_or_refused[reference]"


def _outcomes(spec: str, *extra: str) -> dict[str, str]:
    ran: list[CheckOutcome] = []  # in the order they ran (run_suites reports the suites' order)
    _, log = run_suites(
        spec,
        paths=[str(suites_dir() / "test_replay.py")],
        keyword=PATCH_FIRST,
        extra=["--hypothesis-profile", "mutants-ci", *extra],
        progress=lambda _done, _total, outcome: ran.append(outcome),
    )
    got = {o.nodeid.split("::", 1)[-1]: o.outcome for o in ran}
    assert len(got) == 2, f"{spec}: expected the deep-model and part-built cases, ran {got}\n{log[-2000:]}"
    return got  # in the order they ran


def _in_own_process(spec: str, *extra: str) -> dict[str, str]:
    """``_outcomes`` in a forked process: a driver without ``unpatch()`` patches that one, not this."""
    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_child, args=(spec, extra, send))
    child.start()
    send.close()
    try:
        result: dict[str, str] | str = receive.recv()
    finally:
        child.join()
    assert isinstance(result, dict), result
    return result


def _child(spec: str, extra: tuple[str, ...], send: Any) -> None:
    from harness.testing.ranks import forget_inherited_forkserver

    forget_inherited_forkserver()  # a fresh-process check needs a fork server this process owns
    try:
        send.send(_outcomes(spec, *extra))
    except BaseException as err:  # report, never hang the parent
        send.send(f"{type(err).__name__}: {err}")
    send.close()


@pytest.mark.parametrize(("seed", "part_built_first"), [(0, False), (1, True)])
def test_a_driver_that_can_be_undone_is_caught_in_either_order(seed: int, part_built_first: bool) -> None:
    got = _outcomes(
        "harness.mutants.registry:tagged-routers-built-before-patch-left-native", "--rr-order-seed", str(seed)
    )
    assert (next(iter(got)) == PART_BUILT) is part_built_first, f"seed {seed} ran {list(got)}"
    assert got[PART_BUILT] == "failed", got


@pytest.mark.slow  # two forked processes, each starting its own rank fork server (~15 s)
def test_a_driver_that_cannot_be_undone_is_checked_in_a_fresh_process() -> None:
    spec = f"{__name__}:"
    got = _in_own_process(spec + "STUCK_NATIVE")
    assert got[PART_BUILT] == "failed", got
    got = _in_own_process(spec + "STUCK_CORRECT")
    assert set(got.values()) == {"passed"}, got


def test_the_seeded_order_is_a_permutation_fixed_by_its_seed() -> None:
    class Item:
        def __init__(self, nodeid: str) -> None:
            self.nodeid = nodeid

    items: list[Any] = [Item(f"suites/m{m}.py::t{t}") for m in range(4) for t in range(6)]
    one, again, other = shuffled(items, 3), shuffled(items, 3), shuffled(items, 4)
    assert [i.nodeid for i in one] == [i.nodeid for i in again]
    assert sorted(i.nodeid for i in one) == sorted(i.nodeid for i in items)
    assert [i.nodeid for i in one] != [i.nodeid for i in other]
    modules = [i.nodeid.split("::")[0] for i in one]
    assert len([m for k, m in enumerate(modules) if k == 0 or m != modules[k - 1]]) == 4, "modules split"
    kept = shuffled(items, 3, only=lambda i: i.nodeid.startswith("suites/m1"))
    assert [i.nodeid for i in kept[:6]] == [i.nodeid for i in items[:6]]
    assert [i.nodeid for i in kept[12:]] == [i.nodeid for i in items[12:]]
    assert sorted(i.nodeid for i in kept[6:12]) == sorted(i.nodeid for i in items[6:12])
    assert [i.nodeid for i in kept[6:12]] != [i.nodeid for i in items[6:12]]
