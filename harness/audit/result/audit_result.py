"""The result of an audit: each invariant checked, violated or not checkable, and the metrics.

``AuditResult.of(state)`` turns the merged ``AuditState`` into plain figures: a status per strict
invariant with its first offenders (a detector's, kind ``suspicion``, is ``suspect``, never
``violated``), per-step and per-layer metrics, drift flags and the worst
samples. It is what the terminal summary, ``--json``, ``--html`` and ``--summary`` print.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from harness.audit.checks.invariants import DETECTORS, METRICS, NEEDS, STRICT
from harness.audit.checks.state import AuditState, SampleFigure, Tally, nan_if_empty
from harness.audit.result.tables import drift, layer_rows, prefix_figures, step_row, worst

HINTS: dict[str, str] = {
    "engine_routes": "the engine's routed experts "
    "(vLLM enable_return_routed_experts, SGLang return_routed_experts)",
    "engine_logprobs": "the engine's log-probs of the sampled tokens (SamplingParams logprobs)",
    "trainer_logprobs": "the old-log-prob pass (SkyRL trainer.dump_data_batch=true writes it; "
    "verl's RolloutSkip dump is taken before it); harness.audit.tap writes it",
    "trainer_tokens": "the tokens the trainer consumed, apart from the engine's (harness.audit.tap writes "
    "them; of the frameworks' dumps, slime's --save-debug-train-data does)",
    "trainer_routes": "what the trainer dispatched: no framework dumps it; harness.audit.tap writes it",
    "replay": "the replay mode (none, R2, R3) of each row; harness.audit.tap writes it",
    "group_key": "the prompt's GRPO group of each sample",
    "attempt payloads": "each attempt's own engine payload: harness.audit.tap writes them",
    "shard positions": "per-rank shards with their positions: harness.audit.tap writes them",
    "replayed rows": "rows trained with replay R2 or R3 (every row here has replay = none: no target to be "
    "faithful to)",
    "more than 256 experts": "a model with more than 256 experts (with 256 or fewer, no id can wrap at 256)",
    "groups of two or more samples": "GRPO groups of two or more samples of one prompt (every group of this "
    "dump holds one sample, as with rollout.n = 1)",
}
"""What writes each column an invariant may be missing."""


THRESHOLD_FIGURES = (
    "mean_abs_diff", "mean_abs_diff_agreed", "mean_abs_diff_flipped", "k3", "extreme_fraction",
    "disagreement", "token_disagreement", "fallback_fraction",
)  # fmt: skip
"""The per-step figures ``rrh audit --fail-on FIGURE=VALUE`` may set a threshold on."""


@dataclass
class InvariantResult:
    name: str
    kind: str
    """``strict`` (an invariant), ``suspicion`` (a detector, ``DETECTORS``) or ``metric``."""
    status: str
    """``checked``, ``violated`` (a strict invariant broken), ``suspect`` (a detector named a sample) or
    ``not checkable``."""
    checked: int = 0
    violated: int = 0
    offenders: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    summary: str = ""
    """A metric's figures over the whole run, in a few words."""

    def line(self, hints: dict[str, str] | None = None, step_name: str = "step") -> str:
        """The terminal line; ``hints`` (an importer's ``HINTS``) say what writes a missing column,
        ``step_name`` what a step is in the dump (``AuditResult.step_name``)."""
        if self.status == "not checkable":
            said = {**HINTS, **(hints or {})}
            why = "; ".join(f"{m}: {said.get(m, 'not in this dump')}" for m in self.missing)
            return f"{self.name:<19} not checkable from this dump — missing {why}"
        if self.status == "violated":
            return (
                f"{self.name:<19} VIOLATED in {self.violated} of {self.checked} samples; first at "
                f"{_offender_text(self.offenders[0], step_name)}"
            )
        if self.status == "suspect":
            return (
                f"{self.name:<19} SUSPECT in {self.violated} of {self.checked} samples (a detector's "
                f"suspicion, not a broken invariant); first at {_offender_text(self.offenders[0], step_name)}"
            )
        if self.kind == "metric":
            worst = f"; worst: {_offender_text(self.offenders[0], step_name)}" if self.offenders else ""
            return f"{self.name:<19} measured: {self.summary}{worst}"
        if self.kind == "suspicion":
            return f"{self.name:<19} checked: {self.checked} samples, nothing suspect"
        return f"{self.name:<19} checked: {self.checked} samples, no violation"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "status": self.status,
            "checked": self.checked,
            "violated": self.violated,
            "offenders": self.offenders,
            "missing": self.missing,
            "summary": self.summary,
        }


def human_size(nbytes: int) -> str:
    """Bytes in the largest unit that keeps a digit before the point: ``812 B``, ``41.3 KiB``, ``2.0 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _offender_text(o: dict[str, Any], step_name: str = "step") -> str:
    """``step S sample K row R layer L: expected E, got A (where)`` (``rollout id S`` for slime)."""
    at = f"{step_name} {o['step']} sample {o['sample_key']}"
    at += f" row {o['row']}" if o["row"] is not None else ""
    at += f" layer {o['layer']}" if o["layer"] is not None else ""
    return f"{at}: expected {o['expected']}, got {o['actual']} ({o['where']})"


@dataclass
class AuditResult:
    """The figures of an audit (see the module docstring)."""

    invariants: list[InvariantResult]
    steps: list[dict[str, Any]]
    layers: list[dict[str, Any]]
    worst: dict[str, list[dict[str, Any]]]
    samples: list[SampleFigure]
    drift: list[str]
    input_errors: list[str]
    files: int
    rows: int
    bytes_read: int
    sources: list[str]
    moe_layers: list[int]
    step_layers: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)
    """What the tap's manifests say of the run (a run cut short), ``harness.audit.tap.manifest``, and what
    the importer's dump cannot show (its ``NOTES``)."""
    inferred: list[str] = field(default_factory=list)
    """Model facts the dump does not record, as the importer inferred them (printed first)."""
    hints: dict[str, str] = field(default_factory=dict)
    """What writes each missing column, said for the framework that wrote the dump (``hints_for``)."""
    step_name: str = "step"
    """What a step is in the dump the run came from: ``rollout id`` for slime (``step_name_for``)."""
    dump_files: int | None = None
    """How many files of a framework's dump the import read (``None``: the run layout was audited as it
    is); ``files`` counts the run-layout files it was imported into."""

    @property
    def violated(self) -> list[InvariantResult]:
        """The strict invariants broken (what makes ``rrh audit`` exit 1); never a detector's suspicion."""
        return [r for r in self.invariants if r.status == "violated"]

    @property
    def suspected(self) -> list[InvariantResult]:
        """The detectors that named a sample (``suspect``): worth a look, not a broken invariant."""
        return [r for r in self.invariants if r.status == "suspect"]

    def over(self, thresholds: list[tuple[str, float]]) -> list[str]:
        """One line per (figure, step) whose value exceeds the user's threshold for it."""
        return [
            f"{name} at {self.step_name} {s['step']} is {s[name]:.4g}, over --fail-on {name}={limit:g}"
            for name, limit in thresholds
            for s in self.steps
            if s.get(name) is not None and s[name] > limit
        ]

    def counted(self) -> str:
        """How many samples were read: ``19 samples``, with the records where a tapped run's shard
        rows make more (``19 samples (57 records)``: each sample's engine record and two ranks'
        shard records)."""
        samples = len(self.samples)
        return f"{samples} samples" + (f" ({self.rows} records)" if self.rows != samples else "")

    def files_read(self) -> str:
        """The files read, singular or plural: ``2 files`` of the run layout, or for an imported dump
        ``2 files of the dump`` (the files the framework wrote, not the temporary layout's)."""
        count = self.files if self.dump_files is None else self.dump_files
        what = "" if self.dump_files is None else " of the dump"
        return f"{count} file{'s' * (count != 1)}{what}"

    def lines(self) -> list[str]:
        """The terminal summary: what was inferred, one line per invariant, then drift and notes (input
        errors are the caller's to print first: ``rrh audit`` writes them to stderr)."""
        out = [f"inferred: {x}" for x in self.inferred]
        out += [r.line(self.hints, self.step_name) for r in self.invariants]
        out += [f"drift: {d}" for d in self.drift]
        out += [f"note: {x}" for x in self.notes]
        return out

    @classmethod
    def of(cls, state: AuditState) -> AuditResult:
        # The state is read, never changed: a followed run's result is taken again after each step.
        invariants = []
        duplicates = state.duplicates()
        unique = Tally(checked=len(state.seen))
        unique.add(0, duplicates, len(duplicates))
        resolved = {"unique_sample": unique}
        if state.shards:
            union = Tally(checked=len(state.shards))
            shard_offenders = state.shard_offenders()
            union.add(0, shard_offenders, len({(o.step, o.sample_key) for o in shard_offenders}))
            resolved["shard_union"] = union
        from harness.audit import importers
        from harness.audit.result.findings import name_groups

        named = name_groups(state)
        run_wide = _run_wide_tallies(state) | {"wrapped_ids": named.wrapped} | resolved
        for name in (*STRICT, *METRICS):
            kind = "suspicion" if name in DETECTORS else "strict" if name in STRICT else "metric"
            tally = run_wide.get(name, state.tallies.get(name))
            missing = named.wrap_missing if name == "wrapped_ids" else sorted(state.missing.get(name, set()))
            if kind != "metric":
                checked = tally.checked if tally else 0
                if checked == 0 and name != "unique_sample":
                    status = "not checkable"
                    missing = missing or list(NEEDS.get(name, ()))
                elif tally and tally.violated:
                    status = "suspect" if kind == "suspicion" else "violated"
                else:
                    status = "checked"
                invariants.append(
                    InvariantResult(
                        name, kind, status, checked, tally.violated if tally else 0,
                        [o.as_dict() for o in (tally.offenders if tally else [])],
                        missing if status == "not checkable" else [],
                    )
                )  # fmt: skip
            else:
                checkable = _metric_checkable(name, state)
                cells = named.prefix if name == "prefix_agreement" else state.worst_cells.get(name, [])
                invariants.append(
                    InvariantResult(
                        name,
                        kind,
                        "checked" if checkable else "not checkable",
                        0,
                        0,
                        [o.as_dict() for _, o in cells] if checkable else [],
                        [] if checkable else (missing or _unmet(name, state)),
                    )
                )
        prefix = prefix_figures(state)
        steps = [step_row(step, state, prefix.get(step, (0, 0, 0))) for step in sorted(state.steps)]
        layers, step_layers = layer_rows(state)
        summaries = _metric_summaries(state, layers, prefix)
        for result in invariants:
            if result.kind == "metric" and result.status == "checked":
                result.summary = summaries[result.name]
        return cls(
            invariants=invariants,
            steps=steps,
            layers=layers,
            worst=worst(state.samples),
            samples=sorted(state.samples),
            drift=drift(steps, importers.step_name_for(state.sources)),
            input_errors=sorted(state.input_errors),
            files=len(state.files),
            rows=state.rows_read,
            bytes_read=state.bytes_read,
            sources=sorted(state.sources),
            moe_layers=list(state.moe_layers),
            step_layers=step_layers,
            hints=importers.hints_for(state.sources),
            step_name=importers.step_name_for(state.sources),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "inferred": self.inferred,
            "files": self.files,
            "dump_files": self.dump_files,
            "rows": self.rows,
            "bytes_read": self.bytes_read,
            "sources": self.sources,
            "input_errors": self.input_errors,
            "invariants": [r.as_dict() for r in self.invariants],
            "steps": self.steps,
            "layers": self.layers,
            "drift": self.drift,
            "notes": self.notes,
            "worst": self.worst,
        }


def _metric_summaries(
    state: AuditState, layers: list[dict[str, Any]], prefix: dict[int, tuple[int, int, int]]
) -> dict[str, str]:
    """One line of figures per metric over the whole run (exact merges of every step's figures)."""
    from harness.metrics.accumulator import GapAccumulator
    from harness.trace import AgreementCounts

    figures = list(state.steps.values())
    rows = sum(f.rows for f in figures)
    uncaptured = sum(f.uncaptured_rows for f in figures)
    agreement: AgreementCounts | None = None
    gap, agreed, flipped = GapAccumulator(), GapAccumulator(), GapAccumulator()
    for f in figures:
        if f.agreement is not None and f.agreement.positions:
            if agreement is None:
                agreement = AgreementCounts(f.agreement.top_k)
            agreement.merge(f.agreement)
        gap.merge(f.gap)
        agreed.merge(f.gap_agreed)
        flipped.merge(f.gap_flipped)
    prefix_rows = sum(rows for rows, _, _ in prefix.values())
    groups = sum(count for _, _, count in prefix.values())
    prefix_differ = sum(differ for _, differ, _ in prefix.values())
    prefix_agree = 1 - prefix_differ / prefix_rows if prefix_rows else math.nan
    g, a, fl = gap.result(), agreed.result(), flipped.result()
    loads = [r for r in layers if r.get("load_max_over_mean") is not None]
    busiest = max(loads, key=lambda r: float(r["load_max_over_mean"])) if loads else None  # first on ties
    return {
        "fallback": f"{uncaptured} of {rows} rows without a captured route "
        f"({nan_if_empty(uncaptured, rows):.4f})",
        "agreement": (
            f"set agreement {1 - agreement.disagreement:.4f} per (position, layer), "
            f"{1 - agreement.token_disagreement:.4f} per token (all layers), "
            f"over {agreement.positions} positions"
            if agreement
            else ""
        ),
        "logprob_gap": f"mean |Δ| {g.mean_abs_diff:.3e}, k3 {g.k3:.3e} over {g.n_tokens} tokens; "
        + (
            f"routes agreed: {_part_gap(a)}, flipped: {_part_gap(fl)}"
            if agreement is not None
            else "split by whether the routes agreed: not available, the dump has no trainer routes"
        ),
        "prefix_agreement": f"{prefix_agree:.4f} of prompt rows agree within their group ({groups} groups)",
        "expert_load": (
            f"busiest expert / mean, worst layer {busiest['layer']}: {busiest['load_max_over_mean']:.2f}"
            if busiest
            else ""
        ),
    }


def _part_gap(part: Any) -> str:
    """One part of the gap split by routing; a part with no token says so instead of printing nan."""
    return f"{part.mean_abs_diff:.3e} ({part.n_tokens} tokens)" if part.n_tokens else "no token"


def _unmet(name: str, state: AuditState) -> list[str]:
    """What metric ``name`` lacks where no batch noted a missing column, as far as the run shows it:
    ``prefix_agreement`` with grouped samples lacks groups of two or more (every group holds one), with
    group keys but no group the engine's routes; else the columns it reads."""
    if name == "prefix_agreement":
        if state.groups:
            return ["groups of two or more samples"]
        if any(sample.group_key for sample in state.samples):
            return ["engine_routes"]
    return list(NEEDS.get(name, ()))


def _run_wide_tallies(state: AuditState) -> dict[str, Tally]:
    """The detectors judged across the whole run (``harness.audit.checks.shared``): ``copied_layers``,
    and ``repeated_rows`` with the one-row shift every sample shares added to its per-sample finds."""
    from harness.audit.checks import shared

    repeated = Tally()
    if "repeated_rows" in state.tallies:
        repeated.merge(state.tallies["repeated_rows"])
    shift = shared.shifted_openings(state)
    if shift is not None:
        repeated.add(0, shift.offenders, shift.violated)
    return {"repeated_rows": repeated, "copied_layers": shared.copied_layers(state)}


def _metric_checkable(name: str, state: AuditState) -> bool:
    figures = state.steps.values()
    if name == "agreement":
        return any(f.agreement is not None and f.agreement.positions for f in figures)
    if name == "logprob_gap":
        return any(f.gap.n_tokens for f in figures)
    if name == "prefix_agreement":
        return any(len(g.members) > 1 for g in state.groups.values())
    return any(f.rows for f in figures)
