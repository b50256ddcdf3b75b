"""Naming what a group's prompt-row digests only count (DESIGN §7: a metric that moves because of
particular samples names the worst of them), and the wrap detector that needs the same rows.

Members of a GRPO group share their prompt, so their prompt rows route alike. ``GroupDigests``
keeps, exactly and order-free, which member's row differs from which (eight bytes a row); at the
end of an audit the samples that disagree with their group's majority most often are read again
from the run layout — a bounded re-read, ``OFFENDER_SAMPLES`` samples and one sibling each — to
name each differing (row, MoE layer) with both sets of ids:

- ``prefix_agreement``: the worst samples (most prompt rows that differ from the group's majority),
  each at its first differing cells;
- ``wrapped_ids`` (strict, a detector): a sample's MoE layer whose ids never reach 256 while, at the
  prompt rows it shares with a sibling, the sibling's ids are its own plus multiples of 256 — ids
  stored modulo 256 (an int16 → uint8 cast, verl #7407's class). Only a model with more than 256
  experts can show it. Named only when the relation explains at least one differing row and no
  fewer than the rows it does not, and the layer holds at least two captured rows: a chance match of
  every id modulo 256 is implausible on a correct dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks.state import (
    NO_ROUTE,
    OFFENDER_SAMPLES,
    OFFENDERS_PER_SAMPLE,
    WORST,
    AuditState,
    Member,
    Offender,
    Tally,
    differing_rows,
    first_offenders,
)
from harness.audit.layout.schema import LayoutError

WRAP = 256
"""The width of the byte an id was wrapped into."""


@dataclass
class _Odd:
    """A member whose prompt rows differ from its group's majority: which rows, and a sibling that
    holds the majority at the first of them."""

    step: int
    group: str
    key: str
    member: Member
    rows: list[int] = field(default_factory=list)
    peer: tuple[str, Member] | None = None
    tie: bool = False
    """At some of its rows no digest has a majority."""


@dataclass
class Named:
    """What ``name_groups`` found: the ``prefix_agreement`` cells (score: rows that differ) and the
    ``wrapped_ids`` tally, with why it is not checkable where it is not: first that the model has 256
    experts or fewer (no id can wrap), then that no group holds two samples (or none has a key)."""

    prefix: list[tuple[float, Offender]]
    wrapped: Tally
    wrap_missing: list[str]


@dataclass
class _Sample:
    routes: npt.NDArray[Any]
    captured: npt.NDArray[np.bool_]
    slots: npt.NDArray[np.intp]
    layers: tuple[int, ...]
    where: Any


def _odd_members(state: AuditState) -> list[_Odd]:
    """Every member that disagrees with its group's majority at some prompt row, ranked by rows that
    differ. Where no digest has a majority (a tie: two members, one each), every member disagrees,
    each against the smallest-keyed member holding another digest: the audit cannot tell which is
    right, so it names both. Vectorised per group (members² × rows that differ)."""
    found: list[_Odd] = []
    for (step, group), digests in state.groups.items():
        if len(digests.members) < 2 or not any(m.diff_rows.size for m in digests.members.values()):
            continue
        keys, table = digests.table()
        columns = np.flatnonzero(differing_rows(table))
        if not columns.size:
            continue
        sub = table[:, columns]
        held = sub != NO_ROUTE
        same = (sub[:, None, :] == sub[None, :, :]) & held[:, None, :] & held[None, :, :]
        votes = same.sum(axis=1)  # members holding each member's digest, per column
        best = votes.argmax(axis=0)
        leader = sub[best, np.arange(columns.size)]
        tie = ((votes == votes.max(axis=0)) & held & (sub != leader)).any(axis=0)
        odd = held & ((sub != leader) | tie)
        for i in np.flatnonzero(odd.any(axis=1)).tolist():
            mine = np.flatnonzero(odd[i])
            c = int(mine[0])
            peers = held[:, c] & (sub[:, c] != sub[i, c]) & (tie[c] | (sub[:, c] == leader[c]))
            peer = int(np.flatnonzero(peers)[0])
            member = _Odd(step, group, keys[i], digests.members[keys[i]], columns[mine].tolist())
            member.peer = (keys[peer], digests.members[keys[peer]])
            member.tie = bool(tie[mine].any())
            found.append(member)
    return sorted(found, key=lambda o: (-len(o.rows), o.step, o.key))


class _Reader:
    """Samples read again from their layout file, a row group decoded once however many it serves."""

    def __init__(self) -> None:
        self.batches: dict[tuple[str, int], Any] = {}

    def sample(self, member: Member) -> _Sample | None:
        import pyarrow.parquet as pq

        from harness.audit.layout.decode import decode
        from harness.audit.layout.reader import AUDIT_COLUMNS

        try:
            handle = pq.ParquetFile(member.file)
            first = 0
            for index in range(handle.metadata.num_row_groups):
                rows = handle.metadata.row_group(index).num_rows
                if first <= member.file_row < first + rows:
                    break
                first += rows
            else:
                return None
            key = (member.file, index)
            if key not in self.batches:
                names = [c for c in AUDIT_COLUMNS if c in set(handle.schema_arrow.names)]
                self.batches[key] = decode(handle.read_row_group(index, columns=names), member.file, first)
            batch = self.batches[key]
        except (LayoutError, OSError, ValueError):
            return None  # the file changed or went away since it was audited: the figure stays unnamed
        i = member.file_row - first
        column = batch.routes["engine"]
        if not 0 <= i < batch.size or not column.valid[i]:
            return None
        lo, hi = int(column.row_offsets[i]), int(column.row_offsets[i + 1])
        captured = np.ones(hi - lo, dtype=bool)
        if batch.engine_captured.valid[i]:
            captured = batch.engine_captured.values[
                batch.engine_captured.offsets[i] : batch.engine_captured.offsets[i + 1]
            ].astype(bool)
        return _Sample(column.routes[lo:hi], captured, batch.moe_slots, batch.moe_layers, (batch, i))

    def place(self, sample: _Sample, row: int) -> str:
        batch, i = sample.where
        return str(batch.place(i, row))


def _differing_cells(odd: _Odd, mine: _Sample, theirs: _Sample) -> list[Offender]:
    """The first (row, MoE layer) cells of ``odd``'s differing rows, with both sets of ids."""
    out: list[Offender] = []
    peer = odd.peer[0] if odd.peer else ""
    for row in odd.rows:
        if row >= min(mine.routes.shape[0], theirs.routes.shape[0]):
            continue
        for j, slot in enumerate(mine.slots.tolist()):
            a, b = sorted(mine.routes[row, slot].tolist()), sorted(theirs.routes[row, slot].tolist())
            if a != b:
                out.append(
                    Offender(
                        odd.step, odd.key, row, int(mine.layers[j]),
                        f"ids {b}, as sample {peer} of group {odd.group} holds at this prompt row"
                        + (" (no majority: the group is split evenly)" if odd.tie else ""),
                        f"ids {a} ({len(odd.rows)} prompt rows differ from the group's "
                        + ("other members)" if odd.tie else "majority)"),
                        "",
                    )
                )  # fmt: skip
                if len(out) == OFFENDERS_PER_SAMPLE:
                    return out
    return out


def _wraps(
    step: int, key: str, group: str, mine: _Sample, theirs: _Sample, peer: str, rows: int
) -> list[Offender]:
    """``wrapped_ids`` cells of ``mine`` against its sibling ``theirs`` over their shared prompt rows."""
    out: list[Offender] = []
    shared = min(rows, mine.routes.shape[0], theirs.routes.shape[0])
    both = mine.captured[:shared] & theirs.captured[:shared]
    for j, slot in enumerate(mine.slots.tolist()):
        own = mine.routes[mine.captured, slot]
        if own.shape[0] < 2 or int(own.max()) >= WRAP:
            continue
        a = np.sort(mine.routes[:shared, slot].astype(np.int64), axis=1)
        b = np.sort(theirs.routes[:shared, slot].astype(np.int64), axis=1)
        differ = both & (a != b).any(axis=1)
        if not differ.any():
            continue
        wrapped = np.sort(b % WRAP, axis=1)
        explained = differ & (wrapped == a).all(axis=1) & (b >= WRAP).any(axis=1)
        if explained.sum() >= 1 and explained.sum() >= (differ & ~explained).sum():
            row = int(np.flatnonzero(explained)[0])
            out.append(
                Offender(
                    step, key, row, int(mine.layers[j]),
                    f"ids {b[row].tolist()}, as sample {peer} of group {group} holds at this prompt row",
                    f"ids {a[row].tolist()}: the same modulo {WRAP} at {int(explained.sum())} shared rows, "
                    f"and layer {int(mine.layers[j])} of this sample never reaches {WRAP} "
                    f"(ids stored modulo {WRAP})",
                    "",
                )
            )  # fmt: skip
    return out


def name_groups(state: AuditState) -> Named:
    """Name the worst prompt-row disagreements within groups, and the wraps among them (a bounded
    re-read of the samples involved; see the module docstring)."""
    grouped = [g for g in state.groups.values() if len(g.members) > 1]
    wrapped = Tally()
    missing: list[str] = []
    wide = state.num_experts > WRAP
    if state.num_experts and not wide:  # 256 experts or fewer: no id can wrap at 256, whatever the groups
        missing = ["more than 256 experts"]
    elif not grouped:
        missing = ["groups of two or more samples"] if state.groups else ["group_key"]
    else:
        wrapped.checked = sum(len(g.members) for g in grouped)
    odd = _odd_members(state)
    if not odd:
        return Named([], wrapped, missing)
    reader = _Reader()
    prefix: list[tuple[float, Offender]] = []
    named = 0
    found: list[Offender] = []
    for entry in odd[:OFFENDER_SAMPLES]:
        if entry.peer is None:
            continue
        mine, theirs = reader.sample(entry.member), reader.sample(entry.peer[1])
        if mine is None or theirs is None:
            continue
        if named < WORST:
            cells = _differing_cells(entry, mine, theirs)
            named += bool(cells)
            prefix += [(float(len(entry.rows)), _placed(cell, reader, mine)) for cell in cells]
        if wide:
            rows = min(entry.member.rows, entry.peer[1].rows)
            pairs = ((mine, theirs, entry.key, entry.peer[0]), (theirs, mine, entry.peer[0], entry.key))
            for a, b, ka, kb in pairs:
                found += [_placed(c, reader, a) for c in _wraps(entry.step, ka, entry.group, a, b, kb, rows)]
    if found:
        kept = first_offenders(found)
        wrapped.add(0, kept, len({(o.step, o.sample_key) for o in found}))
    return Named(prefix, wrapped, missing)


def _placed(cell: Offender, reader: _Reader, sample: _Sample) -> Offender:
    return Offender(cell.step, cell.sample_key, cell.row, cell.layer, cell.expected, cell.actual,
                    reader.place(sample, cell.row))  # fmt: skip
