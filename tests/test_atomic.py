"""Atomic writes (``harness.atomic``): no partial target, no temporary file left, the umask's mode."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import atomic
from harness.trace import RoutingTrace

TRACE = RoutingTrace(np.array([[[0, 1]]], np.uint8), num_experts=4)


def test_saved_files_get_the_umask_mode_and_are_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    old = os.umask(0o022)
    try:
        TRACE.save(tmp_path / "t.rrt")
    finally:
        os.umask(old)
    assert (tmp_path / "t.rrt").stat().st_mode & 0o777 == 0o644
    assert synced, "the data was renamed into place without an fsync"
    assert RoutingTrace.load(tmp_path / "t.rrt") == TRACE


def test_an_exception_while_writing_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "t.rrt"
    TRACE.save(target)
    before = target.read_bytes()

    def fail(handle: object) -> None:
        handle.write(b"partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write(target, fail)
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["t.rrt"]


def test_a_writer_killed_with_sigkill_leaves_a_temporary_the_next_write_removes(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: the named temporary stays until the next write of the same target."""
    target = tmp_path / "t.rrt"
    TRACE.save(target)
    before = target.read_bytes()
    child = (
        "import os, signal, sys\n"
        "from harness import atomic\n"
        "def die(handle):\n"
        "    handle.write(b'partial'); handle.flush(); os.kill(os.getpid(), signal.SIGKILL)\n"
        f"atomic.atomic_write({str(target)!r}, die)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", child], env=env, timeout=120, check=False)
    assert result.returncode == -signal.SIGKILL
    leftovers = [p for p in os.listdir(tmp_path) if atomic.TMP_MARK in p]
    assert len(leftovers) == 1 and leftovers[0].startswith(".t.rrt" + atomic.TMP_MARK), leftovers
    assert target.read_bytes() == before, "a killed write changed the target"
    TRACE.save(target)  # the next write of the target cleans the dead writer's temporary
    assert os.listdir(tmp_path) == ["t.rrt"]


def test_a_live_writers_temporary_is_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "t.rrt"
    mine = tmp_path / f".t.rrt{atomic.TMP_MARK}{atomic._host()}-{os.getpid()}-abcd"
    other_host = tmp_path / f".t.rrt{atomic.TMP_MARK}otherhost-1-abcd"
    mine.write_bytes(b"")
    other_host.write_bytes(b"")
    TRACE.save(target)
    assert mine.exists() and other_host.exists()
