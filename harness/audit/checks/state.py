"""The audit's mergeable state: every figure an accumulator (DESIGN §7).

``AuditState`` holds counts, exact sums (``harness.metrics.accumulator.ExactSum`` inside
``GapAccumulator``), per-(step, layer) count arrays, per-group row digests and bounded lists of
the first offenders. ``merge`` adds another state; the final figures are the same, to the last
bit, for any split of a run into units, any order of merging and any executor, because:

- counts and count arrays add;
- sums are exact, and each sample's own sums never depend on which batch carried it;
- offender lists keep the ``OFFENDERS`` smallest by (step, sample, row, layer), a total order;
- group digests merge by an order-free rule (a row agrees when every member's digest is equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks.shard_cover import ShardCover
from harness.metrics.accumulator import GapAccumulator
from harness.metrics.inputs import DEFAULT_TAU
from harness.trace import AgreementCounts

OFFENDER_SAMPLES = 20
"""Samples whose offenders an invariant keeps: the first, in (step, sample) order."""
OFFENDERS_PER_SAMPLE = 3
"""Offenders kept per sample: the first, in (row, layer) order (a broken sample does not crowd out the
others). Both caps are exact under merging: the samples and rows kept never depend on the split."""
OFFENDERS = OFFENDER_SAMPLES * OFFENDERS_PER_SAMPLE
WORST = 10
"""Worst samples kept per figure."""


@dataclass(frozen=True, order=True)
class Offender:
    """One violation: where (step, sample, row, layer) and both values.

    ``row``/``layer`` −1: not applicable.
    """

    step: int
    sample_key: str
    row: int
    layer: int
    expected: str
    actual: str
    where: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "sample_key": self.sample_key,
            "row": None if self.row < 0 else self.row,
            "layer": None if self.layer < 0 else self.layer,
            "expected": self.expected,
            "actual": self.actual,
            "where": self.where,
        }


def first_offenders(offenders: list[Offender]) -> list[Offender]:
    """The first ``OFFENDERS_PER_SAMPLE`` offenders of each of the first ``OFFENDER_SAMPLES`` samples."""
    kept: list[Offender] = []
    samples: dict[tuple[int, str], int] = {}
    for offender in sorted(set(offenders)):
        key = (offender.step, offender.sample_key)
        if key not in samples:
            if len(samples) == OFFENDER_SAMPLES:
                break
            samples[key] = 0
        if samples[key] < OFFENDERS_PER_SAMPLE:
            samples[key] += 1
            kept.append(offender)
    return kept


@dataclass
class Tally:
    """A strict invariant's count of samples checked and violated, with its first offenders."""

    checked: int = 0
    violated: int = 0
    offenders: list[Offender] = field(default_factory=list)

    def add(self, checked: int, offenders: list[Offender], violated: int | None = None) -> None:
        self.checked += checked
        self.violated += len({(o.step, o.sample_key) for o in offenders}) if violated is None else violated
        if offenders:
            self.offenders = first_offenders(self.offenders + offenders)

    def merge(self, other: Tally) -> None:
        self.add(other.checked, other.offenders, other.violated)


@dataclass
class StepFigures:
    """The metrics of one step, all counts and exact sums."""

    samples: int = 0
    rows: int = 0
    uncaptured_rows: int = 0
    agreement: AgreementCounts | None = None
    gap: GapAccumulator = field(default_factory=lambda: GapAccumulator(DEFAULT_TAU))
    gap_agreed: GapAccumulator = field(default_factory=lambda: GapAccumulator(DEFAULT_TAU))
    gap_flipped: GapAccumulator = field(default_factory=lambda: GapAccumulator(DEFAULT_TAU))
    load: npt.NDArray[np.int64] | None = None
    load_imbalance: npt.NDArray[np.float64] | None = None
    """Sealed (``AuditState.seal``): the per-layer load imbalance; ``load`` then holds only later load."""

    def merge(self, other: StepFigures) -> None:
        self.samples += other.samples
        self.rows += other.rows
        self.uncaptured_rows += other.uncaptured_rows
        if other.agreement is not None:
            if self.agreement is None:
                self.agreement = AgreementCounts(other.agreement.top_k)
            self.agreement.merge(other.agreement)
        self.gap.merge(other.gap)
        self.gap_agreed.merge(other.gap_agreed)
        self.gap_flipped.merge(other.gap_flipped)
        if other.load is not None:
            self.load = other.load.copy() if self.load is None else self.load + other.load


NO_ROUTE = np.uint64(0)
"""The digest of a prompt row with no captured route: it agrees and disagrees with nothing."""


@dataclass
class Member:
    """One member of a GRPO group: where it is, and where its prompt-row digests differ from the group's
    reference member (``GroupDigests.reference``)."""

    rows: int
    """Prompt rows the member has."""
    where: str
    file: str
    """The layout file holding it and its row there (read again to name a row that differs)."""
    file_row: int
    diff_rows: npt.NDArray[np.int64]
    diff_digests: npt.NDArray[np.uint64]

    def digests(self, reference: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """Its own digest of each of its prompt rows."""
        out = np.full(self.rows, NO_ROUTE, dtype=np.uint64)
        common = min(self.rows, reference.size)
        out[:common] = reference[:common]
        out[self.diff_rows] = self.diff_digests
        return out

    def against(self, reference: npt.NDArray[np.uint64], own: npt.NDArray[np.uint64]) -> None:
        """Keep ``own`` (its digests) as the rows where they differ from ``reference``."""
        common = min(self.rows, reference.size)
        differ = np.flatnonzero(own[:common] != reference[:common])
        rows = np.concatenate([differ, np.arange(common, self.rows)])
        self.diff_rows = rows.astype(np.int64)
        self.diff_digests = own[self.diff_rows]


@dataclass
class GroupDigests:
    """Prompt rows of one GRPO group (its members share them): a digest per row of one member, the
    *reference* (the smallest sample key), and each member's rows that differ from it.

    Exact and order-free under ``merge``: the reference is the smallest key whatever the order, and
    each member's differences are its own digests against it. A member's row with no captured route
    (``NO_ROUTE``) differs from nothing.
    """

    reference: str
    digests: npt.NDArray[np.uint64]
    members: dict[str, Member]

    @classmethod
    def single(
        cls, key: str, digests: npt.NDArray[np.uint64], where: str, file: str, file_row: int
    ) -> GroupDigests:
        empty = np.zeros(0, np.int64)
        member = Member(digests.size, where, file, file_row, empty, np.zeros(0, np.uint64))
        return cls(key, digests, {key: member})

    def merge(self, other: GroupDigests) -> None:
        if other.reference < self.reference:
            mine, theirs = other, self
        else:
            mine, theirs = self, other
        # Re-express the other side's members against the reference kept.
        members = dict(mine.members)
        for key, member in theirs.members.items():
            own = member.digests(theirs.digests)
            moved = Member(member.rows, member.where, member.file, member.file_row, member.diff_rows,
                           member.diff_digests)  # fmt: skip
            moved.against(mine.digests, own)
            held = members.get(key)
            if held is None or (moved.file, moved.file_row) < (held.file, held.file_row):
                members[key] = moved  # a sample written twice (unique_sample names it): one copy
        self.reference, self.digests, self.members = mine.reference, mine.digests, members

    def table(self) -> tuple[list[str], npt.NDArray[np.uint64]]:
        """Member keys (sorted) and their digests ``[members, rows]`` (``NO_ROUTE`` past a member's rows)."""
        keys = sorted(self.members)
        rows = max(m.rows for m in self.members.values())
        out = np.full((len(keys), rows), NO_ROUTE, dtype=np.uint64)
        for i, key in enumerate(keys):
            member = self.members[key]
            out[i, : member.rows] = member.digests(self.digests)
        return keys, out

    def figures(self) -> tuple[int, int]:
        """``(rows, rows where two members' captured routes differ)``."""
        rows = max(m.rows for m in self.members.values())
        if not any(m.diff_rows.size for m in self.members.values()):
            return rows, 0
        _, table = self.table()
        return rows, int(differing_rows(table).sum())


def differing_rows(table: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
    """Per column of ``table [members, rows]``: two members hold different digests (``NO_ROUTE`` aside)."""
    held = table != NO_ROUTE
    high = np.where(held, table, np.uint64(0)).max(axis=0)
    low = np.where(held, table, np.uint64(np.iinfo(np.uint64).max)).min(axis=0)
    return held.any(axis=0) & (high != low)


@dataclass
class SharedEvidence:
    """What the run-wide detectors (``harness.audit.checks.shared``) count across samples, for faults
    every sample shares: all integers and order-free rules, so any split of a run gives one verdict.

    - ``openings``: per prompt opening (a digest of the tokens up to the second trace row; samples
      that share it share those rows by construction, so they are one piece of evidence),
      ``[1 if every sample of it has row 1 equal to row 0, samples]``; ``opening_offenders``, the
      first of them; ``adjacent``: ``[pairs, equal]`` of later adjacent rows whose tokens differ
      (how often rows repeat by chance);
    - ``layer_rows`` maps a sample's count of distinct captured rows to how many samples have it;
      per adjacent MoE layer pair ``i`` (layer slots ``i − 1`` and ``i``), ``layer_copied[i]`` counts
      the samples whose layer ``i`` equals layer ``i − 1`` at every captured row,
      ``layer_offenders[i]`` the first of them, and ``misaligned[i]``: ``[pairs, equal]`` of layer
      ``i`` at row ``j + 1`` against layer ``i − 1`` at row ``j`` (how often two layers coincide).
    """

    openings: dict[int, list[int]] = field(default_factory=dict)
    opening_offenders: dict[int, list[Offender]] = field(default_factory=dict)
    adjacent: list[int] = field(default_factory=lambda: [0, 0])
    layer_rows: dict[int, int] = field(default_factory=dict)
    layer_copied: dict[int, int] = field(default_factory=dict)
    layer_offenders: dict[int, list[Offender]] = field(default_factory=dict)
    misaligned: dict[int, list[int]] = field(default_factory=dict)
    checked: int = 0

    def opening(self, digest: int, repeats: bool, offender: Offender | None) -> None:
        held = self.openings.setdefault(digest, [1, 0])
        held[0] &= int(repeats)
        held[1] += 1
        if offender is not None:
            held_offenders = self.opening_offenders.get(digest, [])
            self.opening_offenders[digest] = first_offenders([*held_offenders, offender])

    def merge(self, other: SharedEvidence) -> None:
        for digest, (repeats, samples) in other.openings.items():
            held = self.openings.setdefault(digest, [1, 0])
            held[0] &= repeats
            held[1] += samples
        for digest, found in other.opening_offenders.items():
            held_offenders = self.opening_offenders.get(digest, [])
            self.opening_offenders[digest] = first_offenders([*held_offenders, *found])
        self.adjacent = [a + b for a, b in zip(self.adjacent, other.adjacent, strict=True)]
        for rows, count in other.layer_rows.items():
            self.layer_rows[rows] = self.layer_rows.get(rows, 0) + count
        for i, count in other.layer_copied.items():
            self.layer_copied[i] = self.layer_copied.get(i, 0) + count
        for i, found in other.layer_offenders.items():
            self.layer_offenders[i] = first_offenders([*self.layer_offenders.get(i, []), *found])
        for i, (pairs, equal) in other.misaligned.items():
            held = self.misaligned.setdefault(i, [0, 0])
            held[0] += pairs
            held[1] += equal
        self.checked += other.checked


@dataclass(frozen=True, order=True)
class SampleFigure:
    """One sample's summary row (also what the worst-samples lists hold)."""

    step: int
    sample_key: str
    group_key: str
    rows: int
    response_tokens: int
    mean_abs_diff: float
    disagreement: float
    uncaptured_rows: int
    violations: int
    where: str = ""
    """Where the user finds the sample (``Batch.where``): the framework's own file and index, or the
    layout file and row."""

    def as_dict(self) -> dict[str, Any]:
        """Field → value; an undefined figure (nan: no token, no trainer route) is ``None``, as in JSON."""
        return {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in ((k, getattr(self, k)) for k in self.__dataclass_fields__)
        }


@dataclass
class AuditState:
    """Everything an audit has learnt from the units folded in so far (see the module docstring)."""

    tallies: dict[str, Tally] = field(default_factory=dict)
    steps: dict[int, StepFigures] = field(default_factory=dict)
    groups: dict[tuple[int, str], GroupDigests] = field(default_factory=dict)
    seen: dict[tuple[int, str], tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    samples: list[SampleFigure] = field(default_factory=list)
    input_errors: list[str] = field(default_factory=list)
    missing: dict[str, set[str]] = field(default_factory=dict)
    sources: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    bytes_read: int = 0
    rows_read: int = 0
    moe_layers: tuple[int, ...] = ()
    shards: dict[tuple[int, str], ShardCover] = field(default_factory=dict)
    worst_cells: dict[str, list[tuple[float, Offender]]] = field(default_factory=dict)
    """Per metric, the ``WORST`` samples that move it most (score, their worst cell): ``add_worst``."""
    num_experts: int = 0
    shared: SharedEvidence = field(default_factory=SharedEvidence)
    sealed_load: npt.NDArray[np.int64] | None = None
    """The expert load of the sealed steps, summed (``seal``)."""

    def seal(self, step: int) -> None:
        """Keep of a reported step's expert load only its per-layer imbalance, the counts summed into
        ``sealed_load``: a follow holds layers × experts counts once, not once a step (48 × 256 int64:
        96 KiB). Load reaching the step later counts for the run; the step's own imbalance is unknown."""
        f = self.steps.get(step)
        if f is None or f.load is None or f.load_imbalance is not None:
            return
        shape = (len(self.moe_layers),) if self.sealed_load is None else self.sealed_load.shape
        if f.load.shape[: len(shape)] != shape:
            return  # another layer or expert count: left as it is
        f.load_imbalance = imbalance(f.load)
        self.sealed_load = f.load.copy() if self.sealed_load is None else self.sealed_load + f.load
        f.load = None

    def add_worst(self, name: str, items: list[tuple[float, Offender]]) -> None:
        """Keep the ``WORST`` highest-scoring samples of metric ``name`` (one cell each; ties by step,
        sample, row, layer): the same for any split, since each sample's cell comes from one batch."""
        if not items and name in self.worst_cells:
            return
        ranked = sorted(
            set(self.worst_cells.get(name, [])) | set(items),
            key=lambda x: (-x[0], x[1].step, x[1].sample_key, x[1].row, x[1].layer, x[1]),
        )
        kept: list[tuple[float, Offender]] = []
        seen: set[tuple[int, str]] = set()
        for score, offender in ranked:
            if (offender.step, offender.sample_key) not in seen and len(kept) < WORST:
                seen.add((offender.step, offender.sample_key))
                kept.append((score, offender))
        self.worst_cells[name] = kept

    def tally(self, name: str) -> Tally:
        return self.tallies.setdefault(name, Tally())

    def step(self, step: int) -> StepFigures:
        figures = self.steps.get(step)
        if figures is None:  # not setdefault: a StepFigures (three accumulators) only when new
            figures = self.steps[step] = StepFigures()
        return figures

    def note_missing(self, invariant: str, column: str) -> None:
        self.missing.setdefault(invariant, set()).add(column)

    def see(self, step: int, key: str, where: str) -> None:
        count, places = self.seen.get((step, key), (0, ()))
        self.seen[step, key] = (count + 1, tuple(sorted((*places, where)))[:2])

    def merge(self, other: AuditState) -> None:
        for name, tally in other.tallies.items():
            self.tally(name).merge(tally)
        for step, figures in other.steps.items():
            self.step(step).merge(figures)
        for key, group in other.groups.items():
            if key in self.groups:
                self.groups[key].merge(group)
            else:
                self.groups[key] = group
        for key, (count, places) in other.seen.items():
            mine, where = self.seen.get(key, (0, ()))
            self.seen[key] = (mine + count, tuple(sorted((*where, *places)))[:2])
        self.samples.extend(other.samples)
        self.input_errors.extend(other.input_errors)
        for name, columns in other.missing.items():
            self.missing.setdefault(name, set()).update(columns)
        self.sources |= other.sources
        self.files |= other.files
        self.bytes_read += other.bytes_read
        self.rows_read += other.rows_read
        self.moe_layers = self.moe_layers or other.moe_layers
        self.num_experts = self.num_experts or other.num_experts
        self.shared.merge(other.shared)
        if other.sealed_load is not None:
            mine = self.sealed_load
            self.sealed_load = other.sealed_load.copy() if mine is None else mine + other.sealed_load
        for name, items in other.worst_cells.items():
            self.add_worst(name, items)
        for key, cover in other.shards.items():
            if key in self.shards:
                self.shards[key].merge(cover)
            else:
                self.shards[key] = cover

    def shard_offenders(self) -> list[Offender]:
        """Offenders of ``shard_union``: the shards of a sample leave a row uncovered, or overlap."""
        return sorted(
            Offender(step, key, row, -1, expected, actual, where)
            for (step, key), cover in self.shards.items()
            for row, expected, actual, where in cover.problems()
        )

    def duplicates(self) -> list[Offender]:
        """Offenders of ``unique_sample``: every (step, sample) written more than once."""
        return sorted(
            Offender(
                step,
                key,
                -1,
                -1,
                "one row per (step, sample)",
                f"{count} rows: {', '.join(places)}",
                places[0],
            )
            for (step, key), (count, places) in self.seen.items()
            if count > 1
        )


def imbalance(load: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """Per layer of ``load [layers, experts]``: the busiest expert's count over the mean (nan: no id)."""
    mean = load.mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, load.max(axis=1) / np.where(mean > 0, mean, 1), np.nan)


def nan_if_empty(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan
