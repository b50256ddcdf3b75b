"""harness.cpus: the CPU count is the affinity mask's, with a fallback where the OS has none."""

from __future__ import annotations

import os

import pytest

from harness.cpus import available_cpus


def test_the_count_is_the_affinity_mask_not_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5}, raising=False)  # taskset -c 0,5
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert available_cpus() == 2


def test_without_an_affinity_mask_the_count_is_every_cpu_and_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert available_cpus() == 7
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # "undetermined", says os.cpu_count
    assert available_cpus() == 1
