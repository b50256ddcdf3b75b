"""``rrh audit --follow``: audit a run while it is written, a step as soon as it is complete.

The loop polls a source (``harness.audit.follow.sources``) every ``poll`` seconds, audits each new
run-layout file as a one-shot audit does (the same units, ``audit_unit``) and merges its state
into one ``AuditState``: the merge is exact and order-free, so the state of a followed run is the
state of the finished run, and the result equals the one-shot audit's. A reported step is sealed
(``AuditState.seal``): of its expert load, layers × experts counts, only the per-layer imbalance is
kept and the counts join the run's sum. What grows with the run is what the one-shot result holds
per step (its figures) and per sample (a figure, a digest per prompt row); the row groups are
released as in any audit.

A step is *reported* (``on_step``: its row of the time series) once the source says it is
complete. A strict violation is a *finding* (``on_finding``) as soon as the file holding it is
audited: a unit's violated tallies, a (step, sample) written twice, and a sample's shards that do not
cover it once its step is complete. A detector's suspicion is never a finding (it is judged across
the whole run, at the end). The loop ends on ``fail_fast`` at the first finding, once ``until_step``
is complete, after ``idle`` seconds without a new file (then everything present is final), or on
Ctrl-C (likewise).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from harness.audit.checks.fold import AuditOptions
from harness.audit.checks.invariants import DETECTORS
from harness.audit.checks.state import AuditState, first_offenders
from harness.audit.execution.executors import EVERY_ROW, run_units
from harness.audit.follow.series import step_series
from harness.audit.follow.sources import Poll
from harness.audit.layout.reader import Model, Unit, first_model, plan_units
from harness.audit.layout.schema import LayoutError

FINDING_FORMAT = "rrh-audit-finding/1"


class Source(Protocol):
    """What ``harness.audit.follow.sources`` provides: new files, and the last step complete."""

    def poll(self, final: bool = False) -> Poll: ...

    def complete(self, latest: int | None, final: bool = False) -> int | None: ...


@dataclass(frozen=True)
class FollowOptions:
    """When the loop looks again and when it ends (``None``: never on that account)."""

    poll: float = 1.0
    until_step: int | None = None
    idle: float | None = None
    fail_fast: bool = False


@dataclass
class Followed:
    """What a follow leaves: the merged state, the steps reported, and why it ended (``idle``,
    ``until-step``, ``interrupted``, ``fail-fast``)."""

    state: AuditState
    reported: list[int]
    ended: str


def finding(invariant: str, violated: int, offender: dict[str, Any]) -> dict[str, Any]:
    """A finding as ``--on-violation`` receives it on stdin (JSON): the invariant, how many samples of
    the file just audited broke it, and the first offender's place and values."""
    return {"format": FINDING_FORMAT, "invariant": invariant, "violated": violated, **offender}


def unit_findings(part: AuditState, held: AuditState) -> list[dict[str, Any]]:
    """The strict violations ``part`` (one unit's state) adds to ``held`` (everything before it)."""
    out = []
    for name, tally in sorted(part.tallies.items()):
        if name not in DETECTORS and tally.violated and tally.offenders:
            out.append(finding(name, tally.violated, tally.offenders[0].as_dict()))
    twice = [key for key, (count, _) in part.seen.items() if count > 1 or key in held.seen]
    if twice:
        step, key = min(twice)
        places = sorted({*part.seen[step, key][1], *held.seen.get((step, key), (0, ()))[1]})
        out.append(finding("unique_sample", len(twice), {
            "step": step, "sample_key": key, "row": None, "layer": None,
            "expected": "one row per (step, sample)",
            "actual": f"written again: {', '.join(places)}", "where": places[0],
        }))  # fmt: skip
    return out


def shard_findings(state: AuditState, step: int) -> list[dict[str, Any]]:
    """``shard_union`` of the samples of a complete step: their shards cover each row once."""
    from harness.audit.checks.state import Offender

    offenders = [
        Offender(s, key, row, -1, expected, actual, where)
        for (s, key), cover in state.shards.items()
        if s == step
        for row, expected, actual, where in cover.problems()
    ]
    if not offenders:
        return []
    first = first_offenders(offenders)
    return [finding("shard_union", len({o.sample_key for o in offenders}), first[0].as_dict())]


class Follow:
    """One follow of ``source`` (see the module docstring)."""

    def __init__(
        self,
        source: Source,
        *,
        on_step: Callable[[dict[str, Any], list[dict[str, Any]]], None],
        on_finding: Callable[[dict[str, Any]], None],
        on_poll: Callable[[AuditState, int | None], None] | None = None,
        options: AuditOptions = EVERY_ROW,
        follow: FollowOptions = FollowOptions(),
        executor: str = "serial",
        workers: int | None = None,
        ray_address: str | None = None,
        stop: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source, self.on_step, self.on_finding, self.on_poll = source, on_step, on_finding, on_poll
        self.options, self.follow = options, follow
        self.executor, self.workers, self.ray_address = executor, workers, ray_address
        self.stop = stop or threading.Event()
        self.clock = clock
        self.state = AuditState()
        self.reported: list[int] = []
        self._violations: Counter[int] = Counter()
        self._errors: set[str] = set()
        self._model: Model | None = None

    def run(self) -> Followed:
        """Follow until the run ends (see ``FollowOptions``); Ctrl-C ends it as ``--idle`` would."""
        try:
            return self._loop()
        except KeyboardInterrupt:
            self._pass(final=True)
            return Followed(self.state, self.reported, "interrupted")

    def _loop(self) -> Followed:
        last_new = self.clock()
        while True:
            new, failed = self._pass(final=False)
            if failed:
                return Followed(self.state, self.reported, "fail-fast")
            until = self.follow.until_step
            if until is not None and until in self.reported:
                return Followed(self.state, self.reported, "until-step")
            if new:
                last_new = self.clock()
            elif self.follow.idle is not None and self.clock() - last_new >= self.follow.idle:
                _, failed = self._pass(final=True)
                return Followed(self.state, self.reported, "fail-fast" if failed else "idle")
            if self.stop.wait(self.follow.poll):
                self._pass(final=True)
                return Followed(self.state, self.reported, "interrupted")

    def _pass(self, final: bool) -> tuple[bool, bool]:
        """One poll: audit what is new, report the complete steps; ``(anything new, fail_fast stopped)``."""
        poll = self.source.poll(final=final)
        for error in poll.errors:
            if error not in self._errors:  # a file that stays broken is one input error
                self._errors.add(error)
                self.state.input_errors.append(error)
        if self._audit(poll.files):
            return True, True
        complete = self.source.complete(max(self.state.steps, default=None), final)
        at = None
        for step in sorted(s for s in self.state.steps if s not in self.reported):
            if complete is None or step > complete:
                break
            row, layers = step_series(self.state, step, self._violations[step])
            self.state.seal(step)  # its expert load folded into the run's: the state stays flat
            self.reported.append(step)
            at = step
            self.on_step(row, layers)
            for found in shard_findings(self.state, step):
                self.on_finding(found)
                if self.follow.fail_fast:
                    return True, True
        if self.on_poll is not None and (poll.files or at is not None):
            self.on_poll(self.state, self.reported[-1] if self.reported else None)
        return bool(poll.files), False

    def _units(self, files: list[Path]) -> list[Unit]:
        units: list[Unit] = []
        for path in files:
            try:
                if self._model is None:
                    self._model = first_model(path)
                units.extend(plan_units(path, model=self._model))
            except LayoutError as err:
                self.state.input_errors.append(str(err))
        return units

    def _audit(self, files: list[Path]) -> bool:
        """Audit ``files`` into the state, calling ``on_finding``; whether ``fail_fast`` stops here."""
        units = self._units(files)
        if not units:
            return False
        stream = run_units(units, self.options, self.executor, self.workers, self.ray_address)
        for _, part in stream:
            found = unit_findings(part, self.state)
            for figure in part.samples:
                if figure.violations:
                    self._violations[figure.step] += 1
            self.state.merge(part)
            for item in found:
                self.on_finding(item)
            if found and self.follow.fail_fast:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
                return True
        return False
