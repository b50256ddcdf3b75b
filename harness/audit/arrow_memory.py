"""When to hand the memory Arrow freed back to the system, so an audit's memory stays bounded by
the row groups in flight, never by the run's size.

Arrow's allocator keeps what a row group freed for the next one, which may not fit in it, so
over many row groups the kept memory can add up. Handing it back after every row group bounds it
but costs the next read its pages afresh: on ``rrh bench audit``'s run (2 CPUs, paired rounds),
the serial audit reading ahead on one thread gave 0.66× the read floor releasing after each row
group and 0.77× releasing only when needed. So it is handed back only when the process's resident
memory has grown past what it was after the last release by more than ``SLACK_GROUPS`` of the
largest row groups seen (Linux's ``/proc/self/statm``); where that cannot be read, after every row
group. On the bench's 4 GiB run (228 row groups), a slack of 1, 2 and 4 row groups released 156,
53 and 15 times, for a peak of 429, 436 and 496 MiB (402, 414 and 446 MiB on its first GiB).
"""

from __future__ import annotations

import os

SLACK_GROUPS = 2
"""Row groups (the largest seen) the resident memory may grow by before Arrow's is handed back: as
many as the serial audit holds in flight when it reads ahead."""


def resident_bytes() -> int | None:
    """This process's resident memory (Linux), else None."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release() -> None:
    """Hand every byte Arrow's default pool holds unused back to the system."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


class ArrowMemory:
    """Called after each row group is done with: releases Arrow's unused memory when the resident
    memory grew by more than ``SLACK_GROUPS`` of the largest row groups since the last release."""

    def __init__(self) -> None:
        self.after_release: int | None = None
        self.largest = 0

    def done_with(self, row_group_bytes: int) -> None:
        """A row group of ``row_group_bytes`` (its table's ``nbytes``) is no longer referenced."""
        self.largest = max(self.largest, row_group_bytes)
        resident = resident_bytes()
        if (
            resident is None
            or self.after_release is None
            or (resident > self.after_release + SLACK_GROUPS * self.largest)
        ):
            release()
            self.after_release = resident_bytes()


PROCESS = ArrowMemory()
"""The one policy of this process (the memory is the process's, whichever unit read it)."""
