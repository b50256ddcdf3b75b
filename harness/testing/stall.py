"""A hang is a test that stops working, not one that works slowly: fail it when it stalls.

A wall-clock limit sized on a quiet machine fails slow-but-progressing work on a busy one (a
documented command installing an env took over pytest-timeout's 600 s under load 11, FACTS §6).
What a hang has that slowness has not is the absence of progress: a deadlocked rank, a socket
nobody answers, a subprocess waiting on a pipe use no CPU. This plugin watches each test's process
and every process it started (its descendants, read from ``/proc``): when together they have used
less than ``STALL_CPU_S`` seconds of CPU over ``--stall-timeout`` seconds (default 300), the test
fails at once, naming the stall, after every thread's stack is printed (``faulthandler``). A busy
neighbour slows a working test's CPU use but never stops it, so the limit holds on any machine.

The failure is raised in the test's main thread by a signal (``SIGUSR1``), which interrupts a
blocking system call as pytest-timeout's own signal method does; a subprocess the test was waiting
on is then killed by ``subprocess.run``'s own cleanup. A test spinning forever uses CPU and is left
to the generous wall-clock cap of pytest-timeout (``timeout`` in ``pyproject.toml``). Linux only
(``/proc``): elsewhere the plugin does nothing. Nested pytest sessions (the suites a mutant kill
runs in-process) share the outer test's watch.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

STALL_CPU_S = 2.0
"""CPU seconds, over the whole stall window, below which the test and its processes did nothing:
under 1% of a core over the default window, more than a loop polling a socket once a second uses."""
POLL_S = 5.0
"""How often the watch reads the CPU time of the test's processes (a quarter of a shorter window)."""
DEFAULT_STALL_S = 300.0

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_active = threading.Lock()


class Stalled(Exception):
    """Raised in a test's main thread when it and its processes stopped using the CPU."""


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, CPU seconds)`` of a live process from ``/proc/PID/stat``, or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used so far by ``root`` and every live process descended from it."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            seen = _stat(int(entry.name))
            if seen is not None:
                parents[int(entry.name)], cpu[int(entry.name)] = seen
    total, members = 0.0, {root}
    changed = True
    while changed:  # the descendants: parents already in the tree
        changed = False
        for pid, parent in parents.items():
            if parent in members and pid not in members:
                members.add(pid)
                changed = True
    for pid in members:
        total += cpu.get(pid, 0.0)
    return total


class TreeProgress:
    """Whether the process tree of ``pid`` still works: ``quiet_for()`` is how long (in calls'
    seconds) it has used less than ``STALL_CPU_S`` of CPU since it last did."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._last_cpu = tree_cpu_seconds(pid)
        self._last_work = time.monotonic()

    def quiet_for(self) -> float:
        now_cpu, now = tree_cpu_seconds(self.pid), time.monotonic()
        if now_cpu - self._last_cpu >= STALL_CPU_S:
            self._last_cpu, self._last_work = now_cpu, now
        return now - self._last_work

    def used_since_work(self) -> float:
        return tree_cpu_seconds(self.pid) - self._last_cpu


class _Watch:
    """One test's watch: a thread that signals the main thread when the tree's CPU stops growing."""

    def __init__(self, stall_s: float, name: str) -> None:
        self.stall_s, self.name = stall_s, name
        self.done = threading.Event()
        self.fired = False
        self.thread = threading.Thread(target=self._run, name="rrh-stall-watch", daemon=True)

    def _run(self) -> None:
        progress, poll = TreeProgress(os.getpid()), min(POLL_S, self.stall_s / 4)
        while not self.done.wait(poll):
            quiet = progress.quiet_for()
            if quiet >= self.stall_s:
                self.fired = True
                used = progress.used_since_work()
                sys.stderr.write(
                    f"\nrrh stall watch: {self.name} and its processes used {used:.2f} s of CPU in "
                    f"{quiet:.0f} s: stalled; every thread's stack:\n"
                )
                faulthandler.dump_traceback(all_threads=True)
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                return


def _raise_stalled(stall_s: float) -> Any:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Stalled(
            f"no progress: the test and its processes used less than {STALL_CPU_S} s of CPU in "
            f"{stall_s:.0f} s (a hang, not slowness; --stall-timeout)"
        )

    return handler


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stall-timeout",
        type=float,
        default=None,
        help=f"fail a test whose processes used under {STALL_CPU_S} s of CPU for this many seconds "
        f"(default {DEFAULT_STALL_S:.0f}; 0 turns the watch off)",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    stall_s = item.config.getoption("--stall-timeout")
    stall_s = DEFAULT_STALL_S if stall_s is None else stall_s
    usable = sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()
    if not usable or stall_s <= 0 or not _active.acquire(blocking=False):
        yield  # off, not Linux, or a nested session inside a watched test
        return
    previous = signal.signal(signal.SIGUSR1, _raise_stalled(stall_s))
    watch = _Watch(stall_s, item.nodeid)
    watch.thread.start()
    try:
        yield
    finally:
        watch.done.set()
        watch.thread.join()
        signal.signal(signal.SIGUSR1, previous)
        _active.release()
