"""Which route rows of one sample the shard rows of a run claimed, and by which ranks (DESIGN §7).

A rank of a CP/SP trainer taps its shard of every sample into its own files; ``shard_union`` holds
when the shards of a sample claim every route row exactly once. ``ShardCover`` is the mergeable
record of that for one (step, sample): part of ``harness.audit.checks.state.AuditState``, folded by
``harness.audit.checks.coverage``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass
class ShardCover:
    """The shard rows of one (step, sample) seen so far: how often each route row was claimed, by whom.

    Merging adds the counts, so any split of the run gives the same cover; a row claimed twice
    keeps the two lowest ranks that claimed it (order-free). Shard rows of one sample may declare
    different route rows (``prompt_len + response_len − 1 − routes_start``: one shard with
    ``routes_start`` 1, the others 0): the cover spans the most any declares, keeps the fewest and
    the most with the first place declaring each (order-free too), and reports the disagreement.
    """

    expected: int
    """The most route rows a shard row of the sample declares: the length of the counts."""
    shards: int
    seen: set[int] = field(default_factory=set)
    counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    owners: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """Lowest rank claiming each row (``NO_RANK`` where none)."""
    second: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    """Second-lowest rank claiming each row (``NO_RANK`` where fewer than two did)."""
    where: str = ""
    fewest: tuple[int, str] = (0, "")
    """The fewest route rows a shard row of the sample declares, and the first place declaring them."""
    most: tuple[int, str] = (0, "")
    """The most route rows a shard row declares, and the first place declaring them."""
    outside: tuple[int, int, str] | None = None
    """The lowest claimed position outside ``[0, rows declared)``: ``(position, rows, place)``."""

    NO_RANK = np.iinfo(np.int64).max

    def __post_init__(self) -> None:
        if not self.counts.size:
            self.counts = np.zeros(self.expected, np.int64)
            self.owners = np.full(self.expected, self.NO_RANK, np.int64)
            self.second = np.full(self.expected, self.NO_RANK, np.int64)
        if not self.fewest[1] and not self.most[1]:
            self.fewest = self.most = (self.expected, self.where)

    def declare(self, rows: int, where: str) -> None:
        """A shard row at ``where`` declares ``rows`` route rows for the sample: the counts grow to
        the most declared (a later claim within them never falls outside)."""
        self.fewest = min(self.fewest, (rows, where))
        self.most = min(self.most, (rows, where), key=lambda d: (-d[0], d[1]))
        self._grow(rows)

    def _grow(self, rows: int) -> None:
        if rows > self.expected:
            more = rows - self.expected
            self.counts = np.concatenate([self.counts, np.zeros(more, np.int64)])
            self.owners = np.concatenate([self.owners, np.full(more, self.NO_RANK, np.int64)])
            self.second = np.concatenate([self.second, np.full(more, self.NO_RANK, np.int64)])
            self.expected = rows

    def claim_outside(self, position: int, rows: int, where: str) -> None:
        """A shard row at ``where`` claims ``position``, outside the ``rows`` route rows it declares:
        the sample's offence, kept once however many rows and shards claim outside (the lowest)."""
        seen = (position, rows, where)
        self.outside = seen if self.outside is None else min(self.outside, seen)

    def claim(self, shard: int, rank: int, rows: npt.NDArray[np.int64]) -> None:
        """Shard ``shard`` on ``rank`` holds route ``rows`` (each within ``[0, expected)``)."""
        self.seen.add(shard)
        np.add.at(self.counts, rows, 1)
        ranks = np.full(rows.size, rank, np.int64)
        self._fold(rows, ranks, ranks if np.unique(rows).size < rows.size else None)

    def _fold(self, rows: Any, lowest: Any, second: Any) -> None:
        nobody = np.full(rows.size, self.NO_RANK, np.int64)
        both = np.stack([self.owners[rows], self.second[rows], lowest, nobody if second is None else second])
        both.sort(axis=0)
        self.owners[rows], self.second[rows] = both[0], both[1]

    def merge(self, other: ShardCover) -> None:
        self.declare(*other.fewest)
        self.declare(*other.most)
        other._grow(self.expected)  # both now span the most route rows either saw declared
        self.seen |= other.seen
        self.counts += other.counts
        rows = np.arange(self.expected)
        self._fold(rows, other.owners, other.second)
        self.where = min(self.where, other.where) if self.where and other.where else self.where or other.where
        if other.outside is not None:
            self.claim_outside(*other.outside)

    def problems(self) -> list[tuple[int, str, str, str]]:
        """``(row, expected, actual, place)`` of a position claimed outside the route rows, the first
        gap, the first overlap and each missing shard (the sample is one offender however many)."""
        out: list[tuple[int, str, str, str]] = []
        if self.outside is not None:
            position, rows, at = self.outside
            out.append((position, f"route rows in [0, {rows})", f"row {position}", at))
        (fewest, at_fewest), (most, at_most) = self.fewest, self.most
        if fewest != most:  # then a gap is measured against a length the shards do not agree on
            out.append((fewest, f"every shard row of the sample declaring its {most} route rows "
                                f"(prompt_len + response_len − 1 − routes_start) like {at_most}",
                        f"{fewest} route rows at {at_fewest}", self.where))  # fmt: skip
        gap = np.flatnonzero(self.counts == 0) if fewest == most else np.zeros(0, np.int64)
        if gap.size:
            held = f"{gap.size} rows held by no shard, first row {int(gap[0])}"
            out.append((int(gap[0]), "every route row held by one shard", held, self.where))
        overlap = np.flatnonzero(self.counts > 1)
        if overlap.size:
            r = int(overlap[0])
            out.append((r, "each route row held by exactly one shard",
                        f"row {r} claimed {int(self.counts[r])} times (ranks {int(self.owners[r])} and "
                        f"{int(self.second[r])}); {overlap.size} rows overlap", self.where))  # fmt: skip
        missing = self.first_missing()
        if missing is not None:
            out.append((-1, f"shards 0..{self.shards - 1}", f"no row of shard {missing}", self.where))
        return out

    def first_missing(self) -> int | None:
        """The lowest shard in ``[0, shards)`` no row was seen of (``None`` if none): found in the
        shards seen, never in a set of the ``shards`` a row declares."""
        for i, shard in enumerate(sorted(self.seen)):
            if shard != i:
                return i
        return len(self.seen) if len(self.seen) < self.shards else None
