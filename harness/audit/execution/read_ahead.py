"""Reading the next row group on a second thread while this one is checked (the serial executor).

A serial audit spends its time in two places: pyarrow decoding a row group (Zstandard) and the
checks scanning it (compiled kernels and numpy). Both release the GIL, so on a machine with a
second CPU they overlap: ``ReadAhead`` reads the row groups of every unit, in the units' order,
on one thread, and hands them over one at a time. That thread lets pyarrow decode a row group's
columns on its own threads, as pyarrow does by default, so that reading takes the CPU time the
checks leave: measured on ``rrh bench audit``'s run (2 CPUs, 8 paired rounds), the serial audit
reached 0.87× pyarrow's one-thread read of the same columns, against 0.77× with the reading on
one thread and 0.56× with no read-ahead. (Reading on one thread, the audit's handing Arrow's
memory back after each row group cost 0.66× against 0.77×, so an earlier try of a read-ahead was
dropped as slower; with pyarrow's threads it costs nothing measurable, 0.99× against 0.93×.) At
most ``depth`` row groups are read before the one being checked is done with, so memory stays
bounded by the row groups in flight (``depth + 1``), never by the run's size.

What each unit's reading raises (a ``LayoutError``: a damaged row group, a file that changed) is
raised again where that unit's tables are consumed, so a bad file is reported for its unit and
the units after it are still read. A unit whose checks stop early (a row group that does not
decode ends the unit) leaves its unread rest behind; the next unit's tables skip it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from harness.audit.layout.reader import Unit, read_unit
from harness.audit.layout.schema import LayoutError

_END = object()
"""The marker after a unit's last row group (a unit whose reading failed ends with its error)."""


class ReadAhead:
    """The row groups of ``units`` read on one background thread, ``depth`` ahead of the consumer
    (``use_threads``: pyarrow decodes each row group's columns in parallel).

    Use as a context manager; call ``tables(unit)`` for each unit, in the order given. Leaving the
    context early (``strict`` stopped at a violation, an interrupt) stops the thread after the row
    group it is reading.
    """

    def __init__(self, units: Sequence[Unit], depth: int = 1, use_threads: bool = True) -> None:
        if depth < 1:
            raise ValueError(f"depth: {depth}; expected at least 1 row group read ahead")
        self._units = list(units)
        self._order = {id(unit): i for i, unit in enumerate(self._units)}
        self._use_threads = use_threads
        self._items: queue.SimpleQueue[tuple[Unit, Any]] = queue.SimpleQueue()
        self._slots = threading.Semaphore(depth)  # a slot per row group read and not yet checked
        self._stop = threading.Event()
        self._holding = False  # whether the consumer holds a row group it has not given back
        self._thread = threading.Thread(target=self._read, name="rrh-read-ahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._slots.release()  # wake the reader if it waits for a slot
        self._thread.join()

    def _read(self) -> None:
        for unit in self._units:
            if self._stop.is_set():
                return
            try:
                for item in read_unit(unit, use_threads=self._use_threads):
                    self._items.put((unit, item))
                    self._slots.acquire()
                    if self._stop.is_set():
                        return
            except LayoutError as err:  # the unit's end: raised where it is consumed
                self._items.put((unit, err))
                continue
            except BaseException as err:  # an unexpected failure goes to the consumer, never lost
                self._items.put((unit, err))
                return
            self._items.put((unit, _END))

    def _give_back(self) -> None:
        if self._holding:
            self._holding = False
            self._slots.release()

    def tables(self, unit: Unit) -> Iterator[tuple[int, Any]]:
        """``(first row in the file, pyarrow.Table)`` of each row group of ``unit``, as ``read_unit``."""
        while True:
            self._give_back()
            owner, item = self._items.get()
            if owner is not unit:  # the rest of an earlier unit whose checks stopped early (they raised)
                if self._order[id(owner)] > self._order.get(id(unit), -1):
                    raise RuntimeError(f"read ahead: {unit.path} asked for out of the units' order")
                if item is not _END and not isinstance(item, BaseException):
                    self._slots.release()
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            self._holding = True
            # Handed over with no reference left here: once the consumer drops the row group it is
            # freed, before the next one is asked for (else three could be alive at once).
            box, item = [item], None
            yield box.pop()
