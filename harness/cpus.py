"""How many CPUs this process may use: the one count behind the trace kernels' thread pool and the
report's ``cores``.

The affinity mask, not the machine's core count: a CI container or ``taskset`` may give the
process 2 of 64 cores, and threads beyond those only oversubscribe them. (Python 3.13's
``os.process_cpu_count`` is this function; the project supports 3.10.)
"""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one (Linux), else all; >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity mask on this OS (macOS, Windows)
        return os.cpu_count() or 1
