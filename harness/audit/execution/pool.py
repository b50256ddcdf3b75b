"""The audit's process pool: how its workers start (the executors' pool and the generator's), and
how units are run in it so that a worker that dies or stalls loses no unit (``processes``).

Workers fork from a server that imported the audit and warmed its kernels
(``harness.audit.synthetic.warm``). A spawned worker imports numpy, pyarrow, numba and the harness and loads
the compiled kernels on its own (about a CPU-second each); workers forked from a server that
already did start at once. The server is a fresh process with no threads (never a fork of this
one, whose pyarrow or numba threads may hold locks). Where there is no fork server (Windows),
workers are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from harness.audit.checks.fold import AuditOptions
from harness.audit.checks.state import AuditState
from harness.audit.layout.reader import Unit
from harness.audit.layout.schema import LayoutError, shown

PRELOAD = ["harness.audit.execution.executors", "harness.audit.synthetic.warm"]
"""What the fork server imports before it forks a worker (by name: the warm-up is imported there only)."""


def pool_context() -> Any:
    """The multiprocessing context pool workers start from: the warm fork server, or spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    _forget_dead_server()
    forkserver.ensure_running()  # a server already running (started elsewhere) is kept as it is
    return context


def _forget_dead_server() -> None:
    """Forget a fork server that is dead or a zombie but not this process's child (one inherited from
    the process this one was forked from): ``ensure_running`` notices only the death of its own child,
    and would hand every new worker to the dead server's socket (connection refused)."""
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    pid = server._forkserver_pid
    if pid is None:
        return
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, parent = fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        state, parent = "gone", -1
    if parent == os.getpid():
        return  # this process's child: ensure_running reaps it and starts another when it died
    if state in ("Z", "X", "gone"):
        forget_forkserver()


def forget_forkserver() -> None:
    """Drop this process's handle on its fork server (close its copy of the "alive" fd, clear its
    pid and address) without stopping it, so the next ``ensure_running`` starts one of its own.

    For a server this process cannot ``waitpid`` (not its child: inherited by a fork) that is dead,
    or that another process still uses."""
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        if server._forkserver_alive_fd is not None:
            os.close(server._forkserver_alive_fd)
        server._forkserver_pid = server._forkserver_address = server._forkserver_alive_fd = None


UNIT_SECONDS_ENV = "RRH_UNIT_SECONDS"
"""Environment variable: the base time budget of one unit of work in a pool or on Ray (seconds)."""
UNIT_SECONDS = 600.0
UNIT_BYTES_PER_SECOND = 4 << 20
"""A unit's budget grows by a second per this many of its compressed bytes (a unit is ~64 MiB)."""


def unit_seconds(units: Iterable[Unit]) -> float:
    """How long the slowest of ``units`` may take before its worker is taken for stuck."""
    text = os.environ.get(UNIT_SECONDS_ENV)
    try:
        base = UNIT_SECONDS if text is None else float(text)
    except ValueError:
        raise LayoutError(f"{UNIT_SECONDS_ENV}={text!r}: expected a number of seconds") from None
    if not base > 0:
        raise LayoutError(f"{UNIT_SECONDS_ENV}={text!r}: expected a positive number of seconds")
    return base + max((u.nbytes for u in units), default=0) / UNIT_BYTES_PER_SECOND


def lost(unit: Unit, why: str) -> AuditState:
    """The state of a unit that was not audited: an input error saying so, so that the audit is not
    reported complete (exit 2, never the violation code)."""
    state = AuditState()
    state.files.add(unit.path)
    rows = f"row groups {unit.row_groups[0]}–{unit.row_groups[-1]}" if unit.row_groups else "no row group"
    state.input_errors.append(f"{shown(unit.path)} {rows} (rows {unit.first_row}…): not audited: {why}")
    state.bytes_read = unit.nbytes
    return state


class _PoolRound:
    """One process pool auditing some units: ``run`` yields each unit that finished and its state;
    the units that did not (their worker died, or stalled past the budget) are left in ``left``,
    with what happened in ``why``."""

    def __init__(
        self, units: list[Unit], options: AuditOptions, workers: int, work: Callable[..., AuditState]
    ) -> None:
        self.units, self.options, self.workers, self.work = units, options, workers, work
        self.left: list[Unit] = []
        self.why = ""

    def run(self) -> Iterator[tuple[Unit, AuditState]]:
        pool: ProcessPoolExecutor | None = None
        pending: dict[Future[AuditState], Unit] = {}
        unsubmitted = list(self.units)
        try:
            pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=pool_context())
            while unsubmitted:
                pending[pool.submit(self.work, unsubmitted[0], self.options)] = unsubmitted[0]
                unsubmitted.pop(0)
            while pending:
                budget = unit_seconds(pending.values())
                done, _ = wait(pending, timeout=budget, return_when=FIRST_COMPLETED)
                if not done:
                    self.why = (
                        f"no unit finished in {budget:.0f} s ({UNIT_SECONDS_ENV} sets the budget): stuck"
                    )
                    break
                for future in done:
                    try:
                        state = future.result()
                    except BrokenProcessPool:
                        self.why = f"a worker process died ({_exit_of(pool)})"
                        raise _Broken from None
                    except Exception as err:  # the worker raised: this unit is reported, the others go on
                        state = lost(
                            pending[future], f"the worker raised {type(err).__name__}: {first_line(err)}"
                        )
                    yield pending.pop(future), state
        except _Broken:
            pass
        except (BrokenProcessPool, EOFError, OSError) as err:  # the pool or its fork server failed
            self.why = f"the process pool failed ({type(err).__name__}: {first_line(err)})"
        finally:
            self.left = list(pending.values()) + unsubmitted
            if pool is not None:
                _stop(pool)


class _Broken(Exception):
    """A pool broke: its pending units are left for the next round."""


def first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:200]


def _exit_of(pool: ProcessPoolExecutor) -> str:
    """How the pool's dead workers ended (``SIGKILL``, ``SIGSEGV``, an exit status), as far as known."""
    import signal

    codes = sorted(
        {
            p.exitcode
            for p in (getattr(pool, "_processes", None) or {}).values()
            if p.exitcode not in (None, 0)
        }
    )
    names = []
    for code in codes:
        try:
            names.append(signal.Signals(-code).name if code < 0 else f"exit status {code}")
        except ValueError:
            names.append(f"exit status {code}")
    return ", ".join(names) or "killed"


def _stop(pool: ProcessPoolExecutor) -> None:
    """Shut ``pool`` down without waiting on a stuck worker: its processes are killed first."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


RETRIES = 2
"""Pool rounds before the units a broken or stuck pool left are isolated, one per single-worker pool."""


def processes(
    units: list[Unit], options: AuditOptions, workers: int, work: Callable[..., AuditState]
) -> Iterator[tuple[Unit, AuditState]]:
    """Units in a process pool. A worker that dies (killed, a crash) breaks the pool: the units it
    left run again in a fresh pool, and after ``RETRIES`` such rounds each is audited alone in a
    pool of one worker, so that a unit that kills its worker every time is found and reported as not
    audited, while the others are audited. A pool in which no unit finishes within the budget
    (``unit_seconds``: a stopped or hung worker) is killed and treated the same way."""
    left = units
    for _ in range(RETRIES):
        attempt = _PoolRound(left, options, workers, work)
        yield from attempt.run()
        left = attempt.left
        if not left:
            return
    # Isolation: each remaining unit in its own one-worker pool, ``workers`` of them at a time.
    for start in range(0, len(left), workers):
        rounds = [_PoolRound([u], options, 1, work) for u in left[start : start + workers]]
        for attempt in rounds:
            yield from attempt.run()
            for unit in attempt.left:
                yield unit, lost(unit, f"{attempt.why} in {RETRIES + 1} tries")
