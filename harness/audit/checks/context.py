"""The shared context of one batch's checks, and the helpers every family of ``harness.audit.checks`` uses.

``BatchContext`` holds what every family reads (the batch's engine routes, which rows were captured,
each row's sample and step, the rows each sample should have) and the figures one family computes
for another (``row_differs`` for the log-prob gap, the prompt rows' digests for prefix agreement).
``Offenders`` collects one invariant's offenders of a batch the same way for every family.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.checks import kernels as audit_kernels
from harness.audit.checks.invariants import DETECTORS
from harness.audit.checks.state import OFFENDER_SAMPLES, OFFENDERS_PER_SAMPLE, WORST, AuditState, Offender
from harness.audit.layout.batch import Batch, ListColumn


class Offenders:
    """Collects one invariant's offenders of a batch, keeping the first by location (``Tally``'s caps)."""

    def __init__(self, batch: Batch, order: npt.NDArray[np.int64]) -> None:
        self.batch, self.order = batch, order
        self.items: list[Offender] = []
        self.samples: set[int] = set()

    def cells(
        self,
        sample: npt.NDArray[np.int64],
        row: npt.NDArray[np.int64],
        layer: npt.NDArray[np.int64],
        describe: Any,
    ) -> None:
        """Record violations at (sample, row, layer) cells.

        ``describe(i)`` gives (expected, actual) of cell i.
        """
        if sample.size == 0:
            return
        self.samples.update(np.unique(sample).tolist())
        # What ``Tally`` keeps (``state.first_offenders``): the first cells of each of the first
        # samples. Taking the same here, per sample, keeps the result independent of the split.
        ordered = np.lexsort((layer, row, self.order[sample]))
        run = np.cumsum(np.diff(sample[ordered], prepend=-1) != 0) - 1
        starts = np.flatnonzero(np.diff(run, prepend=-1))
        rank = np.arange(ordered.size) - starts[run]
        first = ordered[(rank < OFFENDERS_PER_SAMPLE) & (run < OFFENDER_SAMPLES)]
        for i in first.tolist():
            s = int(sample[i])
            expected, actual = describe(i)
            self.items.append(
                Offender(
                    int(self.batch.step[s]), self.batch.sample_key[s], int(row[i]), int(layer[i]),
                    expected, actual, self.batch.place(s, int(row[i])),
                )
            )  # fmt: skip

    def one(self, s: int, expected: str, actual: str, row: int = -1, layer: int = -1) -> None:
        """Record one violation of sample ``s`` (at ``row`` and ``layer`` where it has them)."""
        self.samples.add(s)
        b = self.batch
        self.items.append(
            Offender(int(b.step[s]), b.sample_key[s], row, layer, expected, actual, b.place(s, row))
        )


def owned(column: ListColumn, samples: npt.NDArray[np.bool_]) -> Any:
    """Which entries of ``column.values`` belong to the lists of ``samples`` (a slice when all do)."""
    if samples.all():
        return slice(None)
    return np.repeat(samples, column.lengths())


def expand(
    column: ListColumn, owners: npt.NDArray[np.int64], total: int, fill: Any, dtype: Any
) -> npt.NDArray[Any]:
    """A flat array over ``total`` entries owned by samples (``owners[i]``: sample of entry i) with
    the column's values where the sample's list is not null, ``fill`` elsewhere (lengths already checked)."""
    if column.valid.all() and column.values.size == total:
        return np.asarray(column.values, dtype=dtype)
    out = np.full(total, fill, dtype=dtype)
    where = column.valid[owners]
    out[where] = column.values[owned(column, column.valid)]
    return out


def offsets(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """The start of each list of ``lengths`` in their concatenation, and the total at the end."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


class BatchContext:
    """One batch under audit and the figures its families share (``fold_batch`` makes one per batch)."""

    def __init__(self, batch: Batch, state: AuditState) -> None:
        self.b, self.state = batch, state
        n = batch.size
        self.order = np.argsort(
            np.lexsort((np.array(batch.sample_key, dtype=object).astype(str), batch.step))
        )
        self.violations = np.zeros(n, dtype=np.int64)
        self.expected_rows = batch.prompt_len + batch.response_len - 1 - batch.routes_start
        self.moe = batch.moe_slots
        self.engine = batch.routes["engine"]
        self.engine_rows = np.diff(self.engine.row_offsets)
        self.row_owner = np.repeat(np.arange(n), self.engine_rows)
        captured = batch.engine_captured
        if captured.valid.any():
            self.captured = expand(captured, self.row_owner, self.row_owner.size, True, bool)
        else:
            self.captured = np.ones(self.row_owner.size, dtype=bool)
        self.uncaptured = np.bincount(self.row_owner[~self.captured], minlength=n)
        # The batch's steps: ``row_group[r]`` is the index in ``self.steps`` of engine row r's step.
        self.steps, self.sample_group = np.unique(batch.step, return_inverse=True)
        self.sample_group = self.sample_group.reshape(-1).astype(np.int64)
        self.row_group = self.sample_group[self.row_owner]
        self.row_differs: npt.NDArray[np.bool_] | None = None
        self.sample_disagreement = np.full(n, np.nan)
        self._counts: audit_kernels.Counts | None = None
        # Set by the families that compute them, read by those that run after (``fold_batch``'s order).
        self.prompt_rows = np.zeros(n, dtype=np.int64)  # ``counts``: prompt rows with a digest, per sample
        self.digests: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)  # ``load``: per engine row
        self.resp_offsets = np.zeros(n + 1, dtype=np.int64)  # ``logprobs``: the flat response tokens
        self.resp_owner = np.zeros(0, dtype=np.int64)
        self.mask = np.zeros(0, dtype=bool)
        self.flat: dict[str, npt.NDArray[np.float32]] = {}
        self.sample_gap = np.full(n, np.nan)

    def finish(self, name: str, found: Offenders, checked: int) -> None:
        """Fold invariant ``name``'s offenders of this batch, ``checked`` samples judged, into the state."""
        self.state.tally(name).add(checked, found.items, len(found.samples))
        if name in DETECTORS:  # a suspicion, not a violation of the sample
            return
        for s in found.samples:
            self.violations[s] += 1

    def counts(self) -> audit_kernels.Counts:
        """The engine routes' id counts per step and the prompt rows' digests (one pass, made once)."""
        if self._counts is None:
            b = self.b
            # Prompt rows of samples with a group: the first min(rows, prompt_len − routes_start).
            self.prompt_rows = np.where(
                self.engine.valid & np.array([g is not None for g in b.group_key], dtype=bool),
                np.minimum(self.engine_rows, np.maximum(0, b.prompt_len - b.routes_start)),
                0,
            ).astype(np.int64)
            local = np.arange(self.row_owner.size) - self.engine.row_offsets[:-1][self.row_owner]
            # A prompt row with no captured route gets no digest (``NO_ROUTE``): filler is never compared.
            prompt = (local < self.prompt_rows[self.row_owner]) & self.captured
            self._counts = audit_kernels.Counts(
                self.engine.routes,
                self.moe,
                self.captured,
                self.row_group,
                self.steps.size,
                b.num_experts,
                prompt,
            )
        return self._counts

    def worst_samples(self, score: npt.NDArray[np.float64]) -> list[int]:
        """The batch's ``WORST`` samples by ``score`` (finite and > 0; ties by step and sample key): a
        superset of the run's worst that lie in this batch."""
        b = self.b
        chosen = np.flatnonzero(np.isfinite(score) & (score > 0)).tolist()
        chosen.sort(key=lambda s: (-float(score[s]), int(b.step[s]), b.sample_key[s]))
        return chosen[:WORST]
