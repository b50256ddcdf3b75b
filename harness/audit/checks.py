"""The invariants of a run (DESIGN §7), folded batch by batch into an ``AuditState``.

Strict invariants name every offender (step, sample, row, layer, both values); metrics are
counts and exact sums per step. The work per batch is vectorised over the batch's samples: the
routes of a whole row group are one array, validated and compared by ``harness.trace``'s kernels
in one call each; offenders are located only in a batch that failed the fast check.

Rows and layers in offenders: ``row`` is the index in the sample's trace (position
``routes_start + row``), ``layer`` the decoder index of the MoE layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit import kernels as audit_kernels
from harness.audit.reader import Batch, ListColumn, RouteColumn
from harness.audit.state import (
    OFFENDER_SAMPLES,
    OFFENDERS_PER_SAMPLE,
    WORST,
    AuditState,
    GroupDigests,
    Offender,
    SampleFigure,
    ShardCover,
)
from harness.metrics.accumulator import GapTerms
from harness.metrics.inputs import LOGPROB_TOLERANCE
from harness.trace import AgreementCounts, LayerAxis
from harness.trace import kernels as trace_kernels

STRICT = (
    "unique_sample",
    "coverage",
    "ids_valid",
    "dense_empty",
    "moe_layer_nonzero",
    "wrapped_ids",
    "repeated_rows",
    "tokens_match",
    "logprobs_valid",
    "replay_fidelity",
    "splice_consistency",
    "shard_union",
)
"""Every strict invariant, in report order. ``wrapped_ids`` and ``repeated_rows`` are detectors of what a
dump alone shows (``harness.audit.findings``; ``_BatchAudit.repeated``): each names a fault only under
conditions that make it implausible on a correct dump."""

REPEAT_ALPHA = 1e-6
"""``repeated_rows`` names a segment only when a repeat of its length is less likely than this by chance,
given how often the sample's own rows repeat (``_BatchAudit.repeated``)."""

LOCATE_ROWS = 4096
"""Rows of a batch whose offenders are located at once (only in a batch that failed a fast check)."""

METRICS = ("fallback", "agreement", "logprob_gap", "prefix_agreement", "expert_load")

NEEDS: dict[str, tuple[str, ...]] = {
    "coverage": ("engine_routes",),
    "ids_valid": ("engine_routes",),
    "dense_empty": ("engine_routes",),
    "moe_layer_nonzero": ("engine_routes",),
    "wrapped_ids": ("group_key",),
    "repeated_rows": ("engine_routes",),
    "tokens_match": ("trainer_tokens",),
    "logprobs_valid": ("engine_logprobs",),
    "replay_fidelity": ("trainer_routes", "replay"),
    "splice_consistency": ("attempt payloads",),
    "shard_union": ("shard positions",),
    "agreement": ("engine_routes", "trainer_routes"),
    "logprob_gap": ("engine_logprobs", "trainer_logprobs"),
    "prefix_agreement": ("engine_routes", "group_key"),
    "fallback": ("engine_routes",),
    "expert_load": ("engine_routes",),
}
"""The columns each invariant reads: when no sample of a run has them, it is not checkable."""


@dataclass(frozen=True)
class AuditOptions:
    """What to audit: a step filter and a hash-selected fraction of samples (sampling for huge runs)."""

    steps: frozenset[int] | None = None
    every: int = 1
    samples: float = 1.0


def sample_hash(step: int, key: str) -> float:
    """A number in [0, 1) fixed by (step, sample key): two audits of one run sample the same rows."""
    import hashlib

    digest = hashlib.blake2b(f"{step}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class _Offenders:
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
        self.samples.add(s)
        b = self.batch
        self.items.append(
            Offender(int(b.step[s]), b.sample_key[s], row, layer, expected, actual, b.place(s, row))
        )


def _owned(column: ListColumn, samples: npt.NDArray[np.bool_]) -> Any:
    """Which entries of ``column.values`` belong to the lists of ``samples`` (a slice when all do)."""
    if samples.all():
        return slice(None)
    return np.repeat(samples, column.lengths())


def _expand(
    column: ListColumn, owners: npt.NDArray[np.int64], total: int, fill: Any, dtype: Any
) -> npt.NDArray[Any]:
    """A flat array over ``total`` entries owned by samples (``owners[i]``: sample of entry i) with
    the column's values where the sample's list is not null, ``fill`` elsewhere (lengths already checked)."""
    if column.valid.all() and column.values.size == total:
        return np.asarray(column.values, dtype=dtype)
    out = np.full(total, fill, dtype=dtype)
    where = column.valid[owners]
    out[where] = column.values[_owned(column, column.valid)]
    return out


def _offsets(lengths: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


class _BatchAudit:
    """The per-batch work of ``fold_batch``, split by invariant."""

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
            self.captured = _expand(captured, self.row_owner, self.row_owner.size, True, bool)
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

    def finish(self, name: str, found: _Offenders, checked: int) -> None:
        self.state.tally(name).add(checked, found.items, len(found.samples))
        for s in found.samples:
            self.violations[s] += 1

    # --- strict ----------------------------------------------------------------------------------

    def coverage(self) -> None:
        b = self.b
        found = _Offenders(b, self.order)
        checked = 0
        for name, column in b.routes.items():
            rows = np.diff(column.row_offsets)
            bad = column.valid & (rows != self.expected_rows)
            checked += int(column.valid.sum()) if name == "engine" else 0
            for s in np.flatnonzero(bad).tolist():
                found.one(
                    s,
                    f"{int(self.expected_rows[s])} rows (prompt_len + response_len − 1 − routes_start)",
                    f"{int(rows[s])} rows in {name}_routes",
                    row=int(min(rows[s], self.expected_rows[s])),
                )
        if not self.engine.valid.any():
            self.state.note_missing("coverage", "engine_routes")
        self.finish("coverage", found, checked)

    def ids(self) -> None:
        """``ids_valid``, ``moe_layer_nonzero`` and ``dense_empty`` on the engine's captured rows."""
        b, routes = self.b, self.engine.routes
        checked = int(self.engine.valid.sum())
        for name in ("ids_valid", "moe_layer_nonzero", "dense_empty"):
            if not checked:
                self.state.note_missing(name, "engine_routes")
        valid_found, zero_found, dense_found = (_Offenders(b, self.order) for _ in range(3))
        if routes.shape[0]:
            # Ids in range: read off the counts (uint8 ids); no repeated id: one compiled pass (routes
            # that fit a word). Either may also flag uncaptured rows: _locate_ids keeps captured ones.
            out_of_range = self.counts().out_of_range()
            repeats = audit_kernels.repeats(routes, self.moe) if b.top_k > 1 else False
            if out_of_range is not None and repeats is not None:
                failed = out_of_range or repeats
            else:
                selected = routes if self.captured.all() else routes[self.captured]
                moe_mask = np.zeros(routes.shape[1], dtype=bool)
                moe_mask[self.moe] = True
                failed = audit_kernels.ids_invalid(selected, b.num_experts, moe_mask)
            if failed or b.top_k == 1:
                self._locate_ids(routes, valid_found, zero_found)
            dense = np.setdiff1d(np.arange(routes.shape[1]), self.moe)
            # Rows with no captured route hold filler (the dump's, zeroed or not): never judged.
            if b.layer_axis is LayerAxis.DECODER and dense.size and routes[:, dense].any():
                cells = np.argwhere(routes[:, dense].any(axis=2) & self.captured[:, None])
                self._cells(dense_found, cells[:, 0], dense[cells[:, 1]], "0 (dense layer: no route)",
                            lambda r, s: f"ids {routes[r, s].tolist()}", slot_is_decoder=True)  # fmt: skip
        self.finish("ids_valid", valid_found, checked)
        self.finish("moe_layer_nonzero", zero_found, checked)
        self.finish("dense_empty", dense_found, checked)

    def _cells(
        self,
        found: _Offenders,
        rows: Any,
        slots: Any,
        expected: str,
        actual: Any,
        slot_is_decoder: bool = False,
    ) -> None:
        """Offenders at global engine rows ``rows`` and layer slots ``slots``."""
        owner = self.row_owner[rows]
        local = rows - self.engine.row_offsets[owner]
        layer = (
            slots
            if slot_is_decoder
            else np.asarray(self.b.moe_layers)[slots]
            if self.b.layer_axis is LayerAxis.MOE_ORDINAL
            else slots
        )
        found.cells(owner, local, np.asarray(layer, dtype=np.int64),
                    lambda i: (expected, actual(int(rows[i]), int(slots[i]))))  # fmt: skip

    def _locate_ids(self, routes: npt.NDArray[Any], valid_found: _Offenders, zero_found: _Offenders) -> None:
        """The offenders of ``ids_valid`` and ``moe_layer_nonzero``, over spans of whole samples of
        about ``LOCATE_ROWS`` rows (the temporaries stay the size of a span, not of the batch)."""
        offsets = self.engine.row_offsets
        marks = np.searchsorted(offsets, np.arange(0, offsets[-1], LOCATE_ROWS), side="right") - 1
        spans = [*np.unique(np.concatenate([[0], marks])).tolist(), self.b.size]
        for s0, s1 in itertools.pairwise(spans):
            if s1 > s0:
                self._locate_span(routes, int(s0), int(s1), valid_found, zero_found)

    def _locate_span(
        self, routes: npt.NDArray[Any], s0: int, s1: int, valid_found: _Offenders, zero_found: _Offenders
    ) -> None:
        b = self.b
        r0, r1 = int(self.engine.row_offsets[s0]), int(self.engine.row_offsets[s1])
        moe_routes = routes[r0:r1, self.moe]
        captured = self.captured[r0:r1]
        bad = (moe_routes >= b.num_experts).any(axis=2)
        if b.top_k > 1:
            bad |= trace_kernels.repeated_pairs(np.ascontiguousarray(moe_routes))
        bad &= captured[:, None]
        cells = np.argwhere(bad)
        slots = self.moe[cells[:, 1]]
        self._cells(valid_found, cells[:, 0] + r0, slots, f"{b.top_k} distinct ids in [0, {b.num_experts})",
                    lambda r, s: f"ids {routes[r, s].tolist()}")  # fmt: skip
        # A (sample, MoE layer) whose captured rows are all zero: a capture that never ran.
        zero = ~moe_routes.any(axis=2) | ~captured[:, None]
        rows = self.engine_rows[s0:s1]
        has = (rows > 0) & self.engine.valid[s0:s1]
        if not has.any():
            return
        starts = self.engine.row_offsets[s0:s1][has] - r0
        all_zero = np.logical_and.reduceat(zero, starts, axis=0)
        some_captured = np.add.reduceat(captured.astype(np.int64), starts) > 0
        all_zero &= some_captured[:, None] & (rows[has] > 1)[:, None]
        pairs = np.argwhere(all_zero)
        samples = s0 + np.flatnonzero(has)[pairs[:, 0]]
        layer = np.asarray(b.moe_layers)[pairs[:, 1]]
        zero_found.cells(
            samples,
            np.zeros(samples.size, np.int64),
            layer.astype(np.int64),
            lambda i: ("a captured route", f"every row of MoE layer {int(layer[i])} is 0"),
        )

    def repeated(self) -> None:
        """``repeated_rows``: a segment of m ≥ 2 captured rows equal, byte for byte in every layer, to the
        m rows just before it, within the sample's coverage — the shape a duplicated resume leaves when
        the framework cuts the rows back to ``P + R − 1``. Named only when the tokens of the two
        segments differ (a repeated text may legitimately route the same) and a repeat of that length
        is implausible by chance given how often the sample's own rows repeat: with ``n`` captured
        rows and ``c`` other equal pairs among them, ``n · q^m ≤ REPEAT_ALPHA`` for
        ``q = (c + 1) / (n(n − 1)/2 + 1)`` (low-entropy routing, where rows often repeat, needs a
        long segment before anything is named)."""
        b = self.b
        found = _Offenders(b, self.order)
        checked = int(self.engine.valid.sum())
        if not checked:
            self.state.note_missing("repeated_rows", "engine_routes")
        lo = self.engine.row_offsets[:-1]
        cover = np.where(self.engine.valid, np.clip(self.expected_rows, 0, self.engine_rows), 0)
        start, length, pairs = audit_kernels.repeated_runs(self.engine.routes, self.captured, lo, lo + cover)
        for s in np.flatnonzero(length >= 2).tolist():
            a, m = int(start[s]), int(length[s])
            rows = self.engine.routes[lo[s] : lo[s] + cover[s]]
            if not np.array_equal(rows[a : a + m], rows[a + m : a + 2 * m]):
                continue  # two hashes collided
            tokens = b.tokens.values[b.tokens.offsets[s] : b.tokens.offsets[s + 1]]
            p = int(b.routes_start[s]) + a
            if np.array_equal(tokens[p : p + m], tokens[p + m : p + 2 * m]):
                continue  # the text itself repeats
            n = int(self.captured[lo[s] : lo[s] + cover[s]].sum())
            q = (max(0, int(pairs[s]) - m) + 1) / (n * (n - 1) / 2 + 1)
            if n * q**m > REPEAT_ALPHA:
                continue
            found.one(
                s,
                f"new routes at rows [{a + m}, {a + 2 * m}) (their tokens differ from rows [{a}, {a + m}))",
                f"rows [{a + m}, {a + 2 * m}) repeat rows [{a}, {a + m}) in every layer "
                "(a duplicated resume?)",
                row=a + m,
            )
        self.finish("repeated_rows", found, checked)

    def tokens(self) -> None:
        b = self.b
        found = _Offenders(b, self.order)
        trainer = b.trainer_tokens
        checked = int(trainer.valid.sum())
        if not checked:
            self.state.note_missing("tokens_match", "trainer_tokens")
        else:
            # Both lists have prompt_len + response_len entries (checked on decoding): compare them
            # flat, the engine's entries of the samples whose trainer list is not null.
            kept = np.flatnonzero(trainer.valid)
            mine = b.tokens.values[_owned(b.tokens, trainer.valid)]
            theirs = trainer.values[_owned(trainer, trainer.valid)]
            differ = np.flatnonzero(mine != theirs)
            if differ.size:
                starts = _offsets(b.tokens.lengths()[kept])
                owner = np.searchsorted(starts, differ, side="right") - 1
                first = np.flatnonzero(np.diff(owner, prepend=-1))  # each sample's first difference
                for i, j in zip(differ[first].tolist(), owner[first].tolist(), strict=True):
                    found.one(
                        int(kept[j]), f"engine token {int(mine[i])}",
                        f"trainer token {int(theirs[i])} at position {i - int(starts[j])}",
                    )  # fmt: skip
        self.finish("tokens_match", found, checked)

    def logprobs(self) -> None:
        """``logprobs_valid``; returns the flat mask and log-probs the gap metrics reuse."""
        b = self.b
        response = b.response_len
        self.resp_offsets = _offsets(response)
        owners = np.repeat(np.arange(b.size), response)
        self.resp_owner = owners
        self.mask = _expand(b.loss_mask, owners, owners.size, True, bool)
        found = _Offenders(b, self.order)
        # Samples with log-probs of either side: counted per sample, so the sum over batches is
        # the same for any split of the run.
        checked = int((b.engine_logprobs.valid | b.trainer_logprobs.valid).sum())
        self.flat: dict[str, npt.NDArray[np.float32]] = {}
        for name in ("engine_logprobs", "trainer_logprobs"):
            column: ListColumn = getattr(b, name)
            values = _expand(column, owners, owners.size, np.nan, np.float32)
            self.flat[name] = values
            present = column.valid[owners] & self.mask
            with np.errstate(invalid="ignore"):
                bad = present & ~(np.isfinite(values) & (values <= LOGPROB_TOLERANCE))
            idx = np.flatnonzero(bad)
            owner = owners[idx]
            local = idx - self.resp_offsets[owner]
            found.cells(owner, b.prompt_len[owner] + local, np.full(idx.size, -1, np.int64),
                        lambda i, v=values, idx=idx, n=name: ("a finite log-prob <= 0",
                                                          f"{n} {float(v[idx[i]])!r}"))  # fmt: skip
        if not checked:
            self.state.note_missing("logprobs_valid", "engine_logprobs")
        self.finish("logprobs_valid", found, checked)

    def replay(self) -> None:
        """``replay_fidelity`` and the ``agreement`` metric: the trainer's routes against the targets."""
        b = self.b
        trainer, recorded = b.routes["trainer"], b.routes["recorded"]
        found = _Offenders(b, self.order)
        checked = 0
        if not trainer.valid.any():
            self.state.note_missing("replay_fidelity", "trainer_routes")
            self.state.note_missing("agreement", "trainer_routes")
        modes = np.array([m or "" for m in b.replay])
        if trainer.valid.any() and not np.isin(modes, ("R2", "R3", "none")).any():
            self.state.note_missing("replay_fidelity", "replay")
        elif trainer.valid.any() and not np.isin(modes, ("R2", "R3")).any():
            self.state.note_missing("replay_fidelity", "replayed rows")
        aligned = trainer.valid & self.engine.valid & (np.diff(trainer.row_offsets) == self.engine_rows)
        if aligned.any():
            overlap = self._overlap(self.engine, trainer, aligned)
            self._agreement(overlap, aligned)
            self.state.add_worst("agreement", self._agreement_cells(overlap, trainer, aligned))
            r3 = aligned & (modes == "R3")
            checked += int(r3.sum())
            # Cells are located only in rows that differ somewhere (``row_differs``, one pass).
            assert self.row_differs is not None
            rows_bad = self.row_differs & self.captured & r3[self.row_owner]
            if rows_bad.any():
                bad = (overlap < b.top_k) & rows_bad[:, None]
                self._replay_offenders(found, bad, self.engine, trainer, "engine")
        r2 = (
            trainer.valid
            & recorded.valid
            & (modes == "R2")
            & (np.diff(trainer.row_offsets) == np.diff(recorded.row_offsets))
        )
        if r2.any():
            overlap = self._overlap(recorded, trainer, r2)
            checked += int(r2.sum())
            owner = np.repeat(np.arange(b.size), np.diff(recorded.row_offsets))
            bad = (overlap < b.top_k) & r2[owner][:, None]
            self._replay_offenders(found, bad, recorded, trainer, "recorded", owner=owner)
        self.finish("replay_fidelity", found, checked)

    def _overlap(self, a: RouteColumn, t: RouteColumn, which: npt.NDArray[np.bool_]) -> npt.NDArray[np.uint8]:
        """``|A ∩ B|`` per (row of ``a``, MoE layer); rows of samples not in ``which`` hold ``top_k``."""
        b = self.b
        ra, rt = a.routes, t.routes
        if not which.all() or not np.array_equal(a.row_offsets, t.row_offsets):
            out = np.full((ra.shape[0], self.moe.size), b.top_k, dtype=np.uint8)
            for s in np.flatnonzero(which).tolist():
                lo, hi = a.row_offsets[s], a.row_offsets[s + 1]
                tl = t.row_offsets[s]
                out[lo:hi] = audit_kernels.overlap(
                    np.ascontiguousarray(ra[lo:hi][:, self.moe]),
                    np.ascontiguousarray(rt[tl : tl + hi - lo][:, self.moe]),
                    b.num_experts,
                )
            return out
        if self.moe.size != ra.shape[1]:
            ra, rt = np.ascontiguousarray(ra[:, self.moe]), np.ascontiguousarray(rt[:, self.moe])
        return audit_kernels.overlap(ra, rt, b.num_experts)

    def _replay_offenders(
        self,
        found: _Offenders,
        bad: Any,
        target: RouteColumn,
        trainer: RouteColumn,
        what: str,
        owner: Any = None,
    ) -> None:
        if not bad.any():
            return
        cells = np.argwhere(bad)
        rows = cells[:, 0]
        owner = self.row_owner if owner is None else owner
        s = owner[rows]
        local = rows - target.row_offsets[s]
        slots = self.moe[cells[:, 1]]
        layer = np.asarray(self.b.moe_layers)[cells[:, 1]]
        t_rows = trainer.row_offsets[s] + local

        def describe(i: int) -> tuple[str, str]:
            want = sorted(target.routes[rows[i], slots[i]].tolist())
            got = sorted(trainer.routes[t_rows[i], slots[i]].tolist())
            return f"{what} experts {want}", f"dispatched {got}"

        found.cells(s, local, layer.astype(np.int64), describe)

    def _agreement(self, overlap: npt.NDArray[np.uint8], aligned: npt.NDArray[np.bool_]) -> None:
        """The ``agreement`` metric per step, each sample's disagreement and ``row_differs``: one pass."""
        b = self.b
        keep = self.captured & aligned[self.row_owner]
        figures = audit_kernels.agreement(
            overlap, keep, self.row_group, self.steps.size, self.row_owner, b.size, b.top_k
        )
        self.row_differs = figures["row_differs"]
        per_sample = figures["sample_differs"].astype(np.float64)
        cells = figures["sample_rows"].astype(np.float64) * self.moe.size
        with np.errstate(invalid="ignore", divide="ignore"):
            self.sample_disagreement = np.where(cells > 0, per_sample / np.maximum(cells, 1), np.nan)
        for g in np.flatnonzero(figures["positions"]).tolist():
            counts = AgreementCounts(
                top_k=b.top_k,
                positions=int(figures["positions"][g]),
                differs_per_layer=figures["differs_per_layer"][g].copy(),
                tokens_differ=int(figures["tokens_differ"][g]),
                overlap_sum=int(figures["overlap_sum"][g]),
            )
            step = self.state.step(int(self.steps[g]))
            if step.agreement is None:
                step.agreement = AgreementCounts(b.top_k)
            step.agreement.merge(counts)

    def _agreement_cells(
        self, overlap: npt.NDArray[np.uint8], trainer: RouteColumn, aligned: npt.NDArray[np.bool_]
    ) -> list[tuple[float, Offender]]:
        """Each worst sample by trainer–engine disagreement, at its first differing (row, MoE layer)."""
        b, items = self.b, []
        score = np.where(aligned, self.sample_disagreement, np.nan)
        for s in self._worst_samples(score):
            lo, hi = int(self.engine.row_offsets[s]), int(self.engine.row_offsets[s + 1])
            bad = np.argwhere((overlap[lo:hi] < b.top_k) & self.captured[lo:hi, None])
            if not bad.size:
                continue
            row, j = int(bad[0, 0]), int(bad[0, 1])
            slot = int(self.moe[j])
            engine = sorted(self.engine.routes[lo + row, slot].tolist())
            mine = sorted(trainer.routes[int(trainer.row_offsets[s]) + row, slot].tolist())
            items.append((float(score[s]), Offender(
                int(b.step[s]), b.sample_key[s], row, int(b.moe_layers[j]), f"engine experts {engine}",
                f"trainer {mine} ({float(score[s]):.1%} of the sample's (row, MoE layer) routes differ)",
                b.place(s, row),
            )))  # fmt: skip
        return items

    def splice(self) -> None:
        """``splice_consistency`` (DESIGN §3.4): each attempt's own rows of the spliced engine routes
        are that attempt's payload, as sets — prompt rows from the first attempt that added tokens,
        then each attempt's new positions ``[P + e_{j−1} − 1, P + e_j − 1)``."""
        b = self.b
        payloads = b.attempts
        found = _Offenders(b, self.order)
        which = payloads.valid & self.engine.valid & b.attempt_ends.valid
        if not payloads.valid.any():
            self.state.note_missing("splice_consistency", "attempt payloads")
        moe = self.moe
        for s in np.flatnonzero(which).tolist():
            ends = b.attempt_ends.values[b.attempt_ends.offsets[s] : b.attempt_ends.offsets[s + 1]]
            rows = b.attempt_rows.values[b.attempt_rows.offsets[s] : b.attempt_rows.offsets[s + 1]]
            first_row = int(payloads.row_offsets[s])
            spliced = self.engine.routes[self.engine.row_offsets[s] : self.engine.row_offsets[s + 1]]
            captured = self.captured[self.engine.row_offsets[s] : self.engine.row_offsets[s + 1]]
            prompt, start = int(b.prompt_len[s]), int(b.routes_start[s])
            before, first = 0, True
            for j, (end, count) in enumerate(zip(ends.tolist(), rows.tolist(), strict=True)):
                payload = payloads.routes[first_row : first_row + count]
                first_row += count
                if end <= before:
                    before = max(before, end)
                    continue  # an attempt with no new token contributes nothing
                lo = max(0, (0 if first else prompt + before - 1) - start)
                hi = min(prompt + end - 1 - start, spliced.shape[0])
                first, before = False, end
                if count < hi:
                    expected = f"attempt {j}'s payload covering rows [{lo}, {hi})"
                    found.one(s, expected, f"{count} rows", row=count)
                    break
                overlap = audit_kernels.overlap(
                    np.ascontiguousarray(spliced[lo:hi][:, moe]),
                    np.ascontiguousarray(payload[lo:hi][:, moe]),
                    b.num_experts,
                )  # fmt: skip
                bad = np.argwhere((overlap < b.top_k) & captured[lo:hi, None])
                if bad.size:
                    cells_row = bad[:, 0] + lo
                    cells_slot = moe[bad[:, 1]]
                    found.cells(
                        np.full(bad.shape[0], s, np.int64), cells_row.astype(np.int64),
                        np.asarray(b.moe_layers, np.int64)[bad[:, 1]],
                        lambda i, j=j, p=payload, q=spliced, r=cells_row, c=cells_slot: (
                            f"attempt {j}'s experts {sorted(p[r[i], c[i]].tolist())}",
                            f"spliced {sorted(q[r[i], c[i]].tolist())}",
                        ),
                    )  # fmt: skip
        self.finish("splice_consistency", found, int(which.sum()))

    # --- metrics ---------------------------------------------------------------------------------

    def gap(self) -> None:
        b = self.b
        engine, trainer = self.flat["engine_logprobs"], self.flat["trainer_logprobs"]
        both = b.engine_logprobs.valid & b.trainer_logprobs.valid
        if not both.any():
            for column in ("engine_logprobs", "trainer_logprobs"):
                if not getattr(b, column).valid.any():
                    self.state.note_missing("logprob_gap", column)
            self.sample_gap = np.full(b.size, np.nan)
            return
        with np.errstate(invalid="ignore"):
            ok = self.mask & both[self.resp_owner] & np.isfinite(engine) & np.isfinite(trainer)
            ok &= (engine <= LOGPROB_TOLERANCE) & (trainer <= LOGPROB_TOLERANCE)
        agreed = flipped = None
        if self.row_differs is not None:
            local = np.arange(self.resp_owner.size) - self.resp_offsets[self.resp_owner]
            owner = self.resp_owner
            row = b.prompt_len[owner] + local - 1 - b.routes_start[owner]
            inside = (row >= 0) & (row < self.engine_rows[owner]) & b.routes["trainer"].valid[owner]
            global_row = np.where(inside, self.engine.row_offsets[owner] + row, 0)
            inside &= self.captured[global_row]
            differs = self.row_differs[global_row]
            agreed, flipped = inside & ~differs, inside & differs
        absd = np.where(ok, np.abs(trainer.astype(np.float64) - engine), 0.0)
        counts = np.bincount(self.resp_owner, weights=ok, minlength=b.size)
        sums = np.bincount(self.resp_owner, weights=absd, minlength=b.size)
        with np.errstate(invalid="ignore", divide="ignore"):
            self.sample_gap = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
        self.state.add_worst("logprob_gap", self._gap_cells(engine, trainer, ok, absd))
        # The terms of every kept token once; each accumulator folds its tokens, a segment per sample.
        kept = np.flatnonzero(ok)
        tokens = GapTerms(trainer[kept].astype(np.float64), engine[kept].astype(np.float64))
        owners, steps = self.resp_owner[kept], b.step[self.resp_owner[kept]]
        for step in np.unique(b.step[both]).tolist():
            in_step = steps == step
            figures = self.state.step(step)
            targets = [(figures.gap, in_step)]
            if agreed is not None and flipped is not None:
                targets += [
                    (figures.gap_agreed, in_step & agreed[kept]),
                    (figures.gap_flipped, in_step & flipped[kept]),
                ]
            for acc, sel in targets:
                idx = np.flatnonzero(sel)
                if not idx.size:
                    continue
                starts = np.flatnonzero(np.diff(owners[idx], prepend=-1)).astype(np.int64)
                acc.add_terms(tokens, idx, starts)

    def _gap_cells(
        self, engine: npt.NDArray[Any], trainer: npt.NDArray[Any], ok: npt.NDArray[np.bool_], absd: Any
    ) -> list[tuple[float, Offender]]:
        """Each worst sample by mean |Δ|, at its token of largest |Δ| (row: the token's position)."""
        b, items = self.b, []
        for s in self._worst_samples(self.sample_gap):
            lo, hi = int(self.resp_offsets[s]), int(self.resp_offsets[s + 1])
            j = int(np.argmax(np.where(ok[lo:hi], absd[lo:hi], -1.0)))
            position = int(b.prompt_len[s]) + j
            gap = float(self.sample_gap[s])
            items.append((gap, Offender(
                int(b.step[s]), b.sample_key[s], position, -1, f"engine log-prob {float(engine[lo + j]):.6g}",
                f"trainer log-prob {float(trainer[lo + j]):.6g} (|Δ| {float(absd[lo + j]):.3g}; the sample's "
                f"mean |Δ| {gap:.3g})", b.place(s, position - int(b.routes_start[s])),
            )))  # fmt: skip
        return items

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

    def fallback_and_load(self) -> None:
        """``fallback`` and ``expert_load`` per step, and the prompt rows' digests (``prefix``)."""
        n_steps = self.steps.size
        counts = self.counts()
        load, self.digests = counts.load(), counts.digests
        rows = np.bincount(self.row_group, minlength=n_steps)
        uncaptured = np.bincount(self.row_group[~self.captured], minlength=n_steps)
        in_steps = np.zeros(n_steps, dtype=bool)
        in_steps[self.sample_group[self.engine.valid]] = True
        for g in np.flatnonzero(in_steps).tolist():
            figures = self.state.step(int(self.steps[g]))
            figures.rows += int(rows[g])
            figures.uncaptured_rows += int(uncaptured[g])
            figures.load = load[g] if figures.load is None else figures.load + load[g]
        self.state.add_worst("fallback", self._fallback_cells())

    def _worst_samples(self, score: npt.NDArray[np.float64]) -> list[int]:
        """The batch's ``WORST`` samples by ``score`` (finite and > 0; ties by step and sample key): a
        superset of the run's worst that lie in this batch."""
        b = self.b
        chosen = np.flatnonzero(np.isfinite(score) & (score > 0)).tolist()
        chosen.sort(key=lambda s: (-float(score[s]), int(b.step[s]), b.sample_key[s]))
        return chosen[:WORST]

    def _fallback_cells(self) -> list[tuple[float, Offender]]:
        """Each worst sample by rows without a captured route, at its first such row."""
        b, items = self.b, []
        for s in self._worst_samples(self.uncaptured.astype(np.float64)):
            lo, hi = int(self.engine.row_offsets[s]), int(self.engine.row_offsets[s + 1])
            row = int(np.flatnonzero(~self.captured[lo:hi])[0])
            count = int(self.uncaptured[s])
            items.append((float(count), Offender(
                int(b.step[s]), b.sample_key[s], row, -1, "a captured route",
                f"no route captured at {count} of {hi - lo} rows, the first this one", b.place(s, row),
            )))  # fmt: skip
        return items

    def prefix(self) -> None:
        b = self.b
        starts = self.engine.row_offsets
        for s in np.flatnonzero(self.engine.valid).tolist():
            group = b.group_key[s]
            if group is None:
                continue
            lo = int(starts[s])
            rows = int(self.prompt_rows[s])
            entry = GroupDigests.single(
                b.sample_key[s], self.digests[lo : lo + rows].copy(), b.where(s), b.path, int(b.file_rows[s])
            )
            key = (int(b.step[s]), group)
            if key in self.state.groups:
                self.state.groups[key].merge(entry)
            else:
                self.state.groups[key] = entry
        if not any(g is not None for g in b.group_key):
            self.state.note_missing("prefix_agreement", "group_key")

    def samples(self) -> None:
        b = self.b
        for s in range(b.size):
            step = int(b.step[s])
            self.state.step(step).samples += 1
            self.state.samples.append(
                SampleFigure(
                    step, b.sample_key[s], b.group_key[s] or "", int(self.engine_rows[s]),
                    int(b.response_len[s]), float(self.sample_gap[s]), float(self.sample_disagreement[s]),
                    int(self.uncaptured[s]), int(self.violations[s]), b.where(s),
                )
            )  # fmt: skip


def fold_batch(batch: Batch, state: AuditState) -> None:
    """Check one decoded batch and fold its figures into ``state``."""
    state.rows_read += batch.size
    state.sources.update(batch.source)
    if batch.size and not state.moe_layers:
        state.moe_layers = batch.moe_layers
    if batch.size:
        state.num_experts = state.num_experts or batch.num_experts
    for s in range(batch.size):
        state.see(int(batch.step[s]), batch.sample_key[s], batch.where(s))
    work = _BatchAudit(batch, state)
    work.coverage()
    work.ids()
    work.repeated()
    work.tokens()
    work.logprobs()
    work.replay()
    work.splice()
    work.gap()
    work.fallback_and_load()
    work.prefix()
    work.samples()


def fold_shards(batch: Batch, state: AuditState) -> None:
    """Fold a batch of shard rows (layout v2: a CP/SP rank's part of a sample) into ``state``'s
    shard covers; ``shard_union`` is judged on the merged covers (``AuditState.shard_offenders``).

    A position outside the sample's route rows is an offender at once."""
    state.rows_read += batch.size
    state.sources.update(batch.source)
    found = _Offenders(batch, np.argsort(np.lexsort((np.array(batch.sample_key, dtype=str), batch.step))))
    expected = batch.prompt_len + batch.response_len - 1 - batch.routes_start
    for s in range(batch.size):
        key = (int(batch.step[s]), batch.sample_key[s])
        rows = batch.positions.values[batch.positions.offsets[s] : batch.positions.offsets[s + 1]]
        outside = (rows < 0) | (rows >= expected[s])
        if outside.any():
            found.one(s, f"route rows in [0, {int(expected[s])})", f"row {int(rows[outside][0])}",
                      row=int(rows[outside][0]))  # fmt: skip
            rows = rows[~outside]
        cover = state.shards.get(key)
        if cover is None:
            cover = ShardCover(int(expected[s]), int(batch.shards[s]), where=batch.where(s))
            state.shards[key] = cover
        cover.shards = max(cover.shards, int(batch.shards[s]))
        cover.claim(int(batch.shard[s]), int(batch.rank[s]), rows.astype(np.int64))
    state.tally("shard_union").add(0, found.items, len(found.samples))
