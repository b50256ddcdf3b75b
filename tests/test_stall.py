"""``harness.testing.stall``: a test that stops using the CPU fails; one that works slowly does not.

Each case runs pytest on a small test file in a subprocess with a 5-second stall window (the watch
polls a quarter of it), so a hang is failed in seconds instead of the default 300.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the watch reads /proc")

CASES = """
import subprocess, sys, threading, time

def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_blocked_on_an_event():
    threading.Event().wait(120)

def test_waiting_on_a_child_that_hangs():
    subprocess.run([sys.executable, "-c", "import threading; threading.Event().wait(120)"])

def test_working_slowly():
    _spin(1.5)

def test_waiting_on_a_child_that_works():
    spin = "import time\\nend = time.process_time() + 1.5\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", spin])
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("stall")
    (folder / "test_cases.py").write_text(CASES)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness.testing.stall", "--stall-timeout", "5", "-p",
         "no:cacheprovider", "-q", "-rA", "-n", "0", "--timeout", "100", str(folder / "test_cases.py")],
        cwd=folder, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"},
    )  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.parametrize("name", ["test_blocked_on_an_event", "test_waiting_on_a_child_that_hangs"])
def test_a_test_that_stops_using_the_cpu_fails_naming_the_stall(outcome: str, name: str) -> None:
    assert f"FAILED test_cases.py::{name} - harness.testing.stall.Stalled: no progress" in outcome, outcome
    assert "stalled; every thread's stack" in outcome, outcome


@pytest.mark.parametrize("name", ["test_working_slowly", "test_waiting_on_a_child_that_works"])
def test_a_test_that_works_slowly_passes(outcome: str, name: str) -> None:
    assert f"PASSED test_cases.py::{name}" in outcome, outcome
