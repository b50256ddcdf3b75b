"""Run the suites against every mutant (each must be killed) and every benign variant (each must pass
them all: a failure is a false alarm); the reference must pass them all too.

The suites of a capability are the tests that declare it (``@pytest.mark.capability``), chosen at
collection (``--rr-capability``): no table here to fall out of date. This is the suite runner's
layer (DESIGN §4): the zoo itself (``harness.mutants``) is subjects and imports no runner.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harness.check.suites import run_suites, suites_dir
from harness.mutants import Mutant, benign
from harness.mutants.benign import Benign
from harness.outcomes import count_outcomes
from harness.subjects import DEFAULT_SUBJECT


@dataclass(frozen=True)
class MutantOutcome:
    """Whether the suites killed one mutant, and which tests did."""

    name: str
    bug_class: str
    capability: str
    killed: bool
    killers: tuple[str, ...]
    tests_run: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class BenignOutcome:
    """Whether one benign variant passed every suite of its capabilities (no false alarm)."""

    name: str
    capabilities: tuple[str, ...]
    passed: bool
    false_alarms: tuple[str, ...]
    tests_run: int
    seconds: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def run_mutant(
    mutant: Mutant,
    *,
    first_kill_only: bool = False,
    named_killer_only: bool = False,
    extra: Sequence[str] = (),
) -> MutantOutcome:
    """Run the tests that declare the mutant's capability against it (stop at the first kill if
    asked), or only the invariant it names as its killer (``Mutant.killed_by``)."""
    start = time.perf_counter()
    args = [*extra, "-x"] if first_kill_only else list(extra)
    if named_killer_only:
        outcomes, _ = run_suites(
            mutant.subject_spec, paths=[str(suites_dir() / mutant.killed_by)], extra=args
        )
    else:
        outcomes, _ = run_suites(mutant.subject_spec, capabilities=(mutant.capability,), extra=args)
    killers = tuple(o.nodeid.split("::", 1)[-1] for o in outcomes if o.outcome == "failed")
    return MutantOutcome(
        mutant.name,
        mutant.bug_class,
        mutant.capability,
        bool(killers),
        killers,
        count_outcomes(o.outcome for o in outcomes).ran,
        time.perf_counter() - start,
    )


def run_benign(variant: Benign, *, extra: Sequence[str] = (), keyword: str | None = None) -> BenignOutcome:
    """Run the tests that declare the variant's capabilities against it: each must pass or skip. A
    variant that ships a driver without ``unpatch()`` runs in a forked process, so that its patch
    cannot refuse the drivers of the subjects this process runs after it. ``keyword`` (``-k``) keeps
    a part of those tests."""
    if variant.own_process:
        # A plain (non-daemonic) child, not a Pool worker: the suites it runs spawn ranks of their own.
        # Forked from the ranks' fork server, never from this process: a fork of a process with live
        # threads (gloo's, a pool's) inherits their locks, and a child that then uses gloo (the
        # Megatron kind) can deadlock on one.
        from harness.testing.ranks import ensure_rank_server

        context = multiprocessing.get_context("forkserver")
        ensure_rank_server(context)
        receive, send = context.Pipe(duplex=False)
        child = context.Process(
            target=_run_benign_by_name,
            args=(variant.name, tuple(extra), keyword, dict(os.environ), send),
        )
        child.start()
        send.close()
        try:
            outcome: BenignOutcome = receive.recv()
        except EOFError:
            child.join()
            raise RuntimeError(f"{variant.name}: its process died (exit code {child.exitcode})") from None
        finally:
            receive.close()
        child.join()
        return outcome
    return _run_benign(variant, extra, keyword)


def _run_benign_by_name(
    name: str, extra: Sequence[str], keyword: str | None, environment: dict[str, str], send: Any
) -> None:
    from harness.testing.ranks import forget_inherited_forkserver

    os.environ.clear()  # the caller's environment, not the fork server's (as the ranks do)
    os.environ.update(environment)
    forget_inherited_forkserver()  # the suites' ranks need a fork server this process owns
    send.send(_run_benign(benign.get(name), extra, keyword))
    send.close()


def _run_benign(variant: Benign, extra: Sequence[str], keyword: str | None) -> BenignOutcome:
    start = time.perf_counter()
    outcomes, _ = run_suites(
        variant.subject_spec, capabilities=variant.capabilities, extra=list(extra), keyword=keyword
    )
    alarms = tuple(f"{o.nodeid.split('::', 1)[-1]}: {o.detail}" for o in outcomes if o.outcome == "failed")
    ran = count_outcomes(o.outcome for o in outcomes).ran
    return BenignOutcome(
        variant.name, variant.capabilities, ran > 0 and not alarms, alarms, ran, time.perf_counter() - start
    )


def reference_failures(extra: Sequence[str] = ()) -> list[str]:
    """The suites' failures on the reference subject (must be none)."""
    outcomes, _ = run_suites(DEFAULT_SUBJECT, extra=extra)
    return [o.nodeid for o in outcomes if o.outcome == "failed"]


def kill_args(seed: int | None) -> list[str]:
    """pytest arguments of a kill run: no shrinking; derandomized, or seeded with ``seed``."""
    if seed is None:
        return ["--hypothesis-profile", "mutants-ci"]
    return ["--hypothesis-profile", "mutants", f"--hypothesis-seed={seed}"]
