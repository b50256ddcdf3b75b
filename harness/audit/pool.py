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
from multiprocessing import forkserver
from typing import Any

PRELOAD = ["harness.audit.executors", "harness.audit.warm"]
"""What the fork server imports before it forks a worker (by name: the warm-up is imported there only)."""


def pool_context() -> Any:
    """The multiprocessing context pool workers start from: the warm fork server, or spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # a server already running (started elsewhere) is kept as it is
    return context
