"""Atomic file writes: a temporary file next to the target, ``fsync``, then ``os.replace``.

A reader sees the old file or the new one, never a partial one, and a crash never leaves a
partial target. What each way of dying leaves behind:

- an exception (``KeyboardInterrupt`` included) while writing: the temporary file is removed;
- ``SIGKILL``, an out-of-memory kill or a power loss: no code runs, so the temporary file stays.
  Its name says what it is (``.<target>.rrh-tmp-<host>-<pid>-<random>``) and the next write of the
  same target removes every such file whose writer process (same host) no longer exists; a
  temporary file of a live writer, or of another host sharing the directory, is left alone.

The file gets the mode ``open(..., "w")`` would give it (``0o666`` less the umask), not ``mkstemp``'s
``0o600``; data and then the directory entry are flushed to disk (``fsync``) so that a rename that
survived a crash names complete data.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["TMP_MARK", "atomic_write", "remove_stale_temporaries"]

TMP_MARK = ".rrh-tmp-"
"""What every temporary file of ``atomic_write`` has in its name, after ``.<target name>``."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, under another user; anything else: keep the file
        return True
    return True


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary files of earlier writes of ``target`` whose writer is gone; return them."""
    removed = []
    prefix = f".{target.name}{TMP_MARK}"
    for path in target.parent.glob(glob.escape(prefix) + "*"):
        host, _, rest = path.name[len(prefix) :].rpartition("-")[0].rpartition("-")
        if host != _host() or not rest.isdigit() or _alive(int(rest)):
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another writer cleaned it first
            continue
        removed.append(path)
    return removed


def _fsync_directory(directory: Path) -> None:
    """Flush the directory entry of a rename (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` atomically: ``write(handle)`` fills a temporary file that then replaces it.

    The directory must exist. See the module docstring for what a killed writer leaves behind.
    """
    target = Path(path)
    remove_stale_temporaries(target)
    tmp = target.with_name(f".{target.name}{TMP_MARK}{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as for any new file
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)
    return target
