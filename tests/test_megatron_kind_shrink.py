"""Shrinking a failing Megatron-kind property test must not exhaust the machine (issue 34).

Each example of a Megatron-kind test builds a one-rank gloo world and a ``GPTModel``; a failing
example's traceback keeps its frames, hence the model and its process groups, alive for as long as
hypothesis keeps the failure (all of shrinking). One process reached 5,777 threads that way. The
kind now releases every model's process groups at the end of its session and holds torch's
intra-op pool to one thread inside it. Here a property test that fails on every example shrinks a
list to its smallest form (each step a world, a model, a forward, and a kept failure), under a
thread sampler: the process stays within a thread and a time budget.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.megatron

THREAD_BUDGET = 20
"""Threads above one session's peak (its gloo groups, ~50 here): each kept failing example held ~48
more before the fix."""
TIME_BUDGET_S = 120.0


def _threads() -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def _gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return sorted(n for n in names if "gloo" in n)


def test_a_failing_megatron_property_test_shrinks_within_a_thread_and_time_budget() -> None:
    pytest.importorskip("megatron.core")
    from harness.testing import megatron_kind as kind

    peak, examples = [0], [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _threads())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # One session first: its gloo groups' threads and torch's pools are the baseline, not a leak.
    with kind.megatron_session():
        kind.run(kind.build("softmax", "fp32", fresh=True), torch.zeros(1, 4, dtype=torch.long))
    time.sleep(0.1)
    one_session, peak[0] = peak[0], 0

    @settings(
        max_examples=5,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )
    @given(xs=st.lists(st.integers(0, 255), min_size=2, max_size=6))
    def fails_on_every_example(xs: list[int]) -> None:
        examples[0] += 1
        with kind.megatron_session():
            model = kind.build("softmax", "fp32", fresh=True)
            logits = kind.run(model, torch.tensor([xs], dtype=torch.long) % 60 + 3)
        assert logits.shape[1] == 0, f"a deliberate failure holding a model: {len(xs)} tokens"

    start = time.perf_counter()
    try:
        with kind.megatron_world(), pytest.raises(AssertionError, match="deliberate failure") as excinfo:
            fails_on_every_example()
    finally:
        done.set()
        sampler.join()
    elapsed = time.perf_counter() - start
    del excinfo
    gc.collect()
    left = _gloo_threads()
    assert examples[0] > 5, f"only {examples[0]} examples ran: hypothesis did not shrink"
    assert peak[0] - one_session <= THREAD_BUDGET, (
        f"{examples[0]} examples (shrinking a kept failure) reached {peak[0]} threads, one session "
        f"{one_session}, budget +{THREAD_BUDGET}: a kept example's process groups were not released"
    )
    assert not left, f"gloo threads outlive the world: {left} (a process forked now could deadlock on them)"
    assert elapsed <= TIME_BUDGET_S, (
        f"{examples[0]} examples took {elapsed:.0f} s, budget {TIME_BUDGET_S:.0f} s"
    )
