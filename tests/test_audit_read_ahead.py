"""The serial audit's read-ahead (``harness.audit.execution.read_ahead``): row groups arrive in order, no
more than one ahead of the one being checked; a unit's read error is raised at that unit and the
next units are still read, as are the next units after a unit whose checks stopped early; leaving
early stops the reading thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from harness.audit import audit_run
from harness.audit.execution import read_ahead
from harness.audit.layout.reader import Unit
from harness.audit.layout.schema import LayoutError
from harness.audit.synthetic.generate import FAULTS, RunShape, generate_run


class _Group:
    """A stand-in row group that counts how many of its kind are alive."""

    alive = 0
    most = 0
    two_alive = threading.Event()

    def __init__(self) -> None:
        _Group.alive += 1
        _Group.most = max(_Group.most, _Group.alive)
        if _Group.alive == 2:
            _Group.two_alive.set()

    def __del__(self) -> None:
        _Group.alive -= 1


def _units(groups: list[int]) -> list[Unit]:
    return [Unit(path=f"u{i}.parquet", row_groups=tuple(range(n)), first_row=0, nbytes=n) for i, n in
            enumerate(groups)]  # fmt: skip


def _fake_reader(broken: str | None = None) -> Any:
    """``read_unit`` over stand-ins: ``(row, _Group)`` per row group; unit ``broken`` fails after one."""

    def read_unit(unit: Unit, use_threads: bool) -> Iterator[tuple[int, _Group]]:
        for index in unit.row_groups:
            if unit.path == broken and index == 1:
                raise LayoutError(f"{unit.path} row group 1: unreadable")
            yield index, _Group()

    return read_unit


def test_row_groups_arrive_in_order_and_at_most_one_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "read_unit", _fake_reader())
    _Group.alive = _Group.most = 0
    _Group.two_alive.clear()
    units = _units([3, 1, 4])
    total = sum(len(u.row_groups) for u in units)
    seen = []
    with read_ahead.ReadAhead(units) as reader:
        for unit in units:
            for row, group in reader.tables(unit):
                seen.append((unit.path, row))
                if len(seen) < total:  # while this one is checked, the reader reads the next...
                    assert _Group.two_alive.wait(10), f"row group {len(seen) + 1} was not read ahead"
                # ...and never a third: the one checked before is freed once the consumer drops it.
                threading.Event().wait(0.01)
                assert _Group.alive <= 2
                del group
                if len(seen) < total:  # dropped, it is freed: only the one read ahead is left
                    assert _Group.alive == 1
                _Group.two_alive.clear()
    assert seen == [(u.path, r) for u in units for r in u.row_groups]
    assert _Group.most == 2


def test_a_units_read_error_is_raised_at_that_unit_and_the_next_units_are_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(read_ahead, "read_unit", _fake_reader(broken="u1.parquet"))
    units = _units([2, 3, 2])
    got: dict[str, Any] = {}
    with read_ahead.ReadAhead(units) as reader:
        for unit in units:
            rows = []
            try:
                for row, _ in reader.tables(unit):
                    rows.append(row)
            except LayoutError as err:
                rows.append(str(err))
            got[unit.path] = rows
    assert got == {"u0.parquet": [0, 1], "u1.parquet": [0, "u1.parquet row group 1: unreadable"],
                   "u2.parquet": [0, 1]}  # fmt: skip


def test_a_unit_whose_checks_stop_early_leaves_the_next_units_their_own_row_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(read_ahead, "read_unit", _fake_reader())
    units = _units([4, 3, 2])
    got: dict[str, list[int]] = {}
    with read_ahead.ReadAhead(units) as reader:
        for unit in units:
            rows = got.setdefault(unit.path, [])
            try:
                for row, _ in reader.tables(unit):
                    rows.append(row)
                    if unit.path == "u0.parquet" and row == 1:
                        raise LayoutError("u0.parquet row group 1: undecodable")  # as a check would
            except LayoutError:
                pass
    assert got == {"u0.parquet": [0, 1], "u1.parquet": [0, 1, 2], "u2.parquet": [0, 1]}


def test_leaving_early_stops_the_reading_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "read_unit", _fake_reader())
    units = _units([50, 50])
    with read_ahead.ReadAhead(units) as reader:
        next(reader.tables(units[0]))
    assert not reader._thread.is_alive()


def test_a_strict_audit_that_stops_at_a_violation_leaves_no_reading_thread(tmp_path: Path) -> None:
    shape = RunShape(steps=3, prompts=2, group_size=4, prompt_len=5, response_len=6, layers=3, experts=16,
                     top_k=2)  # fmt: skip
    generate_run(tmp_path, shape, seed=3, faults=FAULTS, file_bytes=3_000, row_group_bytes=1_500)
    strict = audit_run(tmp_path, executor="serial", strict=True, read_ahead=True)
    assert strict.violated
    assert not [t for t in threading.enumerate() if t.name == "rrh-read-ahead"]


def test_units_asked_for_out_of_order_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read_ahead, "read_unit", _fake_reader())
    units = _units([1, 1, 1])
    with read_ahead.ReadAhead(units) as reader:
        assert [row for row, _ in reader.tables(units[1])] == [0]  # unit 0 skipped, as if abandoned
        with pytest.raises(RuntimeError, match="out of the units' order"):
            next(reader.tables(units[0]))
