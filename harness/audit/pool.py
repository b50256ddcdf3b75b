"""The audit's process pool: how its workers start (the executors' pool and the generator's).

Workers fork from a server that imported the audit and warmed its kernels
(``harness.audit.warm``). A spawned worker imports numpy, pyarrow, numba and the harness and loads
the compiled kernels on its own (about a CPU-second each); workers forked from a server that
already did start at once. The server is a fresh process with no threads (never a fork of this
one, whose pyarrow or numba threads may hold locks). Where there is no fork server (Windows),
workers are spawned.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

PRELOAD = ["harness.audit.executors", "harness.audit.warm"]
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
