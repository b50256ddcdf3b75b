"""Every fault class an audit can find, planted one at a time in dumps the frameworks' own code wrote
(issue 32), and named at its place: the step, the sample, the row and layer, and the framework's own
file and index (verl: the step's ``gen_batch.dp``, batch row and token column; SkyRL:
``global_step_N_training_input.pkl``, batch row and token column; slime: ``rollout_data/{id}.pt``
and the sample's index) — with the model's facts given and without them, and nothing strict named on
the clean dump. An id the run layout cannot store is the one fault that is no invariant's: one import
error names its cell, and the other samples of its file are audited.

The rollout: two steps of two GRPO groups of four samples (members share their prompt's tokens and
routes), a model of 4 decoder layers (layer 0 dense), top-2, 16 experts — 384 for the wrap, which only
a model with more than 256 experts can show. Each fault is planted in step 1 (the step whose samples
decide an inferred layout) in sample 5. The dumps are written three ways: by verl 0.9.1's agent loop
and ``RolloutSkip`` and by SkyRL 0.3.0's preprocess and ``TrainingInputBatch.save`` (``release``,
skipping and naming the tox env where the release is not installed), the same files without the
frameworks (``synthetic``, the default run), and slime's ``torch.save`` of ``Sample.to_dict()`` dicts
with its format_version 2 train dump (slime is not on PyPI; ``tests/test_audit_import_sources``).

"Without the facts": verl and SkyRL are given the expert count (their importers never infer it: an
id wrapped into ``[E, 256)`` would raise it and hide itself) and infer the MoE layers; slime infers
both. Either way the layout most samples agree on is the one judged, so one bad sample is named and
the healthy ones are not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from harness.audit.checks.invariants import DETECTORS
from harness.audit.checks.state import OFFENDERS_PER_SAMPLE
from harness.audit.execution.executors import audit_run
from harness.audit.importers import import_dump
from harness.audit.importers.model_shape import MOE_LAYERS_ENV, NUM_EXPERTS_ENV
from harness.audit.layout.schema import LayoutError
from harness.audit.result.audit_result import AuditResult
from tests.test_audit_import_frameworks import (
    Sample,
    _skyrl_modules,
    _skyrl_release,
    _skyrl_synthetic,
    _verl_release,
    _verl_synthetic,
    verl_run,
)
from tests.test_audit_import_sources import _sample_dict, _train_payload

LAYERS, TOP_K, MOE = 4, 2, (1, 2, 3)
GROUPS, MEMBERS = 2, 4
STEPS = (1, 2)
STEP, TARGET = 1, 5
"""Where every fault is planted: the first step (it decides an inferred layout), a member of group 1."""
NARROW, WIDE = 16, 384
"""Expert counts: the wrap at 256 needs more than 256 experts."""


def rollout(experts: int, step: int) -> list[Sample]:
    """One step's samples: GRPO groups sharing their prompt's tokens and routes, each payload the
    ``P + R − 1`` rows of its positions, ids distinct per route on the MoE layers, 0 on layer 0."""
    rng = np.random.default_rng([experts, step])

    def routes(rows: int) -> npt.NDArray[np.int32]:
        out = np.zeros((rows, LAYERS, TOP_K), np.int32)
        first = rng.integers(0, experts, size=(rows, len(MOE)))
        out[:, MOE, 0] = first
        out[:, MOE, 1] = (first + rng.integers(1, experts, size=first.shape)) % experts
        return out

    samples = []
    for group in range(GROUPS):
        p = int(rng.integers(8, 13))
        prompt, shared = rng.integers(2, 1000, size=p), routes(p)
        for _ in range(MEMBERS):
            r = int(rng.integers(24, 33))
            own = np.concatenate([shared, routes(r - 1)])
            logprobs = -rng.uniform(0.05, 2.0, size=r).astype(np.float32)
            samples.append(Sample(group, prompt, rng.integers(2, 1000, size=r), own, logprobs))
    return samples


# --- the faults ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """Where a fault must be named: the invariant (strict, or a metric's worst offender), the row (a
    position of the sample) and the decoder layer (``None``: a per-token or per-sample finding)."""

    invariant: str
    row: int
    layer: int | None


@dataclass(frozen=True)
class Fault:
    """A fault class: the model it needs, how it is planted in a sample (for ``framework``), the cells
    that must name it, and the frameworks where it moves the sample's layer signature (the layers it
    routes on: the inference note names the sample there)."""

    name: str
    plant: Callable[[Sample, str], list[Cell]]
    experts: int = NARROW
    odd_layers: tuple[str, ...] = ()
    frameworks: tuple[str, ...] = ("verl", "skyrl", "slime")


def _repeated(s: Sample, framework: str) -> list[Cell]:
    """A duplicated resume: the six rows before the resume point appended again, the rows after them
    following, the payload cut back to its length, so the row count is right and only the repeat
    shows. SkyRL's own preprocess cuts it to ``P + R`` rows: the last is a real row for the last
    token, which only a response truncated at its budget may hold (§3.1), and sample 5's is shorter
    than the batch's longest, so coverage names it too; for verl and slime the cut payload is planted."""
    a, m = len(s.prompt) + 4, 6
    s.routes = np.concatenate([s.routes[: a + m], s.routes[a : a + m], s.routes[a + m :]])
    if framework != "skyrl":
        s.routes = s.routes[: s.length - 1]
        return [Cell("repeated_rows", a + m, None)]
    return [Cell("repeated_rows", a + m, None), Cell("coverage", s.length - 1, None)]


def _zero_layer(s: Sample, framework: str) -> list[Cell]:
    """MoE layer 2 all zero in one sample (a capture that never ran; its zeros repeat an id too)."""
    s.routes[:, 2] = 0
    return [Cell("moe_layer_nonzero", 0, 2), Cell("ids_valid", 0, 2)]


def _dense_shift(s: Sample, framework: str) -> list[Cell]:
    """One sample's routes one layer early: on the dense layer 0, its last MoE layer empty."""
    s.routes[:, :-1] = s.routes[:, 1:].copy()
    s.routes[:, -1] = 0
    return [Cell("dense_empty", 0, 0), Cell("moe_layer_nonzero", 0, 3), Cell("ids_valid", 0, 3)]


def _filler_row(s: Sample, framework: str) -> list[Cell]:
    """The framework's missing-row filler inside the payload, at a row the engine did process: verl's
    and SkyRL 0.3.0's zero row (its zeros repeat an id), slime's replay filler ``arange(K) % E`` on
    every layer (the dense one included)."""
    row = len(s.prompt) + 3
    if framework == "slime":
        s.routes[row] = np.arange(TOP_K)
        return [Cell("dense_empty", row, 0)]
    s.routes[row] = 0
    return [Cell("ids_valid", row, 1)]


def _trailing_filler(s: Sample, framework: str) -> list[Cell]:
    """A zero row at the end of a zero-filled payload (verl, SkyRL 0.3.0): no dump tells it from a
    row the engine never returned, so it is "no route captured", named by ``fallback``'s worst sample."""
    s.routes[-1] = 0
    return [Cell("fallback", len(s.routes) - 1, None)]


def _id_past(s: Sample, framework: str) -> list[Cell]:
    """One id past the model's experts (stored: it fits the dump's dtype)."""
    row = len(s.prompt) + 2
    s.routes[row, 3, 0] = NARROW + 100
    return [Cell("ids_valid", row, 3)]


def _id_past_dtype(s: Sample, framework: str) -> list[Cell]:
    """An id the run layout cannot store (300 with 16 experts: past the uint8 ids it stores): an input
    error naming the cell, the sample left out, the others of its file still audited."""
    row = len(s.prompt) + 2
    s.routes[row, 3, 0] = 300
    return [Cell(INPUT, row, 3)]


def _wrapped(s: Sample, framework: str) -> list[Cell]:
    """The sample's ids stored modulo 256 (an int16 → uint8 cast); its siblings hold the ids at the
    shared prompt rows. Named on each MoE layer at the first prompt row whose ids reach 256; a route
    whose ids ``x`` and ``x + 256`` became one repeats an id, named by ``ids_valid`` too."""
    cells = []
    for layer in MOE:
        rows = np.flatnonzero((s.routes[: len(s.prompt), layer] >= 256).any(axis=1))
        assert rows.size >= 1, "the seed must give each MoE layer a prompt row with an id past 255"
        cells.append(Cell("wrapped_ids", int(rows[0]), layer))
    s.routes %= 256
    ids = np.sort(s.routes, axis=2)
    repeated = np.argwhere((ids[:, :, 1:] == ids[:, :, :-1]).any(axis=2))
    repeated = repeated[np.isin(repeated[:, 1], MOE)]
    if repeated.size:
        cells.append(Cell("ids_valid", int(repeated[0, 0]), int(repeated[0, 1])))
    return cells


def _nan_logprob(s: Sample, framework: str) -> list[Cell]:
    s.logprobs[3] = np.nan
    return [Cell("logprobs_valid", len(s.prompt) + 3, None)]


def _positive_logprob(s: Sample, framework: str) -> list[Cell]:
    s.logprobs[3] = 0.5
    return [Cell("logprobs_valid", len(s.prompt) + 3, None)]


def _gap_outlier(s: Sample, framework: str) -> list[Cell]:
    """One token whose trainer log-prob is 2 below the engine's (the others 1e-3): the gap metric's
    worst sample, at that token."""
    s.trainer_logprobs = s.trainer().copy()
    s.trainer_logprobs[3] = s.logprobs[3] - 2.0
    return [Cell("logprob_gap", len(s.prompt) + 3, None)]


def _prompt_row(s: Sample, framework: str) -> list[Cell]:
    """One prompt row of one layer differs from the three siblings': ``prefix_agreement`` drops and
    names this sample, at that row and layer."""
    s.routes[2, 1] = (s.routes[2, 1] + 1) % NARROW
    return [Cell("prefix_agreement", 2, 1)]


FAULTS = [
    Fault("clean", lambda s, framework: []),
    Fault("clean-wide", lambda s, framework: [], experts=WIDE),
    Fault("repeated-rows", _repeated),
    Fault("zero-moe-layer", _zero_layer, odd_layers=("verl", "skyrl", "slime")),
    Fault("dense-shift", _dense_shift, odd_layers=("verl", "skyrl", "slime")),
    Fault("filler-row", _filler_row, odd_layers=("slime",)),
    Fault("filler-last-row", _trailing_filler, frameworks=("verl", "skyrl")),  # slime has no filler
    Fault("id-past-E", _id_past),
    Fault("id-past-dtype", _id_past_dtype),
    Fault("wrapped-256", _wrapped, experts=WIDE),
    Fault("nan-logprob", _nan_logprob),
    Fault("positive-logprob", _positive_logprob),
    Fault("gap-outlier", _gap_outlier, frameworks=("skyrl", "slime")),  # verl dumps no trainer log-probs
    Fault("prompt-row-differs", _prompt_row),
]
METRICS = {"logprob_gap", "prefix_agreement", "fallback"}
"""Invariants of ``Cell`` that are metrics: named as their worst sample, never a strict violation."""
INPUT = "input error"
"""A ``Cell`` that is no invariant's: the sample cannot be imported, and the error names the cell."""


# --- the dumps ----------------------------------------------------------------------------------------


def _slime(root: Path, steps: dict[int, list[Sample]]) -> None:
    """``--dump-details root``: ``rollout_data/{id}.pt`` of ``Sample.to_dict()`` dicts (routes int32,
    ``[len(tokens) − 1, L, K]``) and the format_version 2 ``train_data/{id}.pt``, with ``torch.save``
    as slime writes them; the trainer's log-probs are ``Sample.trainer``'s."""
    (root / "rollout_data").mkdir(parents=True)
    (root / "train_data").mkdir()
    for step, samples in steps.items():
        dicts = [
            _sample_dict(
                np.concatenate([s.prompt, s.response]).tolist(), len(s.response), [1] * len(s.response),
                s.logprobs.tolist(), s.routes, s.group, 100 + i,
            )
            for i, s in enumerate(samples)
        ]  # fmt: skip
        payload = _train_payload(step, dicts)
        for row, s in zip(payload["samples"], samples, strict=True):
            row["log_probs"] = torch.from_numpy(s.trainer())
        torch.save({"rollout_id": step, "samples": dicts}, root / "rollout_data" / f"{step}.pt")
        torch.save(payload, root / "train_data" / f"{step}.pt")


def _release_skyrl(root: Path, steps: dict[int, list[Sample]]) -> None:
    _skyrl_modules()
    _skyrl_release(root / "export", steps, {})


WRITERS: dict[tuple[str, str], Callable[[Path, dict[int, list[Sample]]], None]] = {
    ("verl", "synthetic"): lambda root, steps: _verl_synthetic(root / "rollout_dump", steps),
    ("verl", "release"): lambda root, steps: _verl_release(root / "rollout_dump", steps),
    ("skyrl", "synthetic"): lambda root, steps: _skyrl_synthetic(root / "export", steps, {}),
    ("skyrl", "release"): _release_skyrl,
    ("slime", "synthetic"): lambda root, steps: _slime(root / "dump", steps),
}
"""How each framework's dump is written under an experiment folder (the importer's own subfolder)."""


def _place(framework: str, root: Path, steps: dict[int, list[Sample]], row: int | None) -> str:
    """Where the planted sample is in the framework's own file, at ``row`` (its token column) when the
    file has a padded token axis."""
    s = steps[STEP][TARGET]
    if framework == "slime":
        return f"{root / 'dump' / 'rollout_data' / f'{STEP}.pt'} samples[{TARGET}]"
    if framework == "verl":
        run = verl_run(steps)
        file, first = (
            root / "rollout_dump" / run.directory / str(STEP) / "gen_batch.dp",
            run.p_max - len(s.prompt),
        )
    else:
        file = root / "export" / "dumped_data" / f"global_step_{STEP}_training_input.pkl"
        first = max(x.length for x in steps[STEP]) - s.length
    where = f"{file} batch row {TARGET}"
    return where if row is None else f"{where}, token column {first + row}"


# --- the audit ----------------------------------------------------------------------------------------


def _audit(
    framework: str, root: Path, run: Path, experts: int, facts: bool, inferred: list[str], errors: list[str]
) -> AuditResult:
    """Import the dump under ``root`` (the facts given, or left to the importer; what could not be
    imported a line in ``errors``) and audit it, serially."""
    dump = {"verl": "rollout_dump", "skyrl": "export", "slime": "dump"}[framework]
    given: dict[str, Any] = {"num_experts": experts if facts or framework != "slime" else None}
    given["moe_layers"] = MOE if facts else None
    import_dump(framework, root / dump, run, errors=errors, inferred=inferred, **given)
    return audit_run(run, executor="serial")


def _check(
    result: AuditResult,
    errors: list[str],
    cells: list[Cell],
    framework: str,
    root: Path,
    steps: dict[int, list[Sample]],
) -> None:
    """The strict violations are exactly the planted cells' invariants, every offender in the planted
    sample, each cell among its invariant's offenders (a metric's: its worst) at the framework's place.
    An ``INPUT`` cell is the one import error, naming the place and cell, and every other sample is
    audited."""
    by_name = {r.name: r for r in result.invariants}
    assert not result.input_errors, result.input_errors
    unreadable = [c for c in cells if c.invariant == INPUT]
    assert len(errors) == len(unreadable), errors
    for cell, line in zip(unreadable, errors, strict=True):
        cell_place = f"{_place(framework, root, steps, cell.row)}: step {STEP} sample {TARGET} row {cell.row}"
        assert line.startswith(f"{cell_place} layer {cell.layer}: expert id "), line
    audited = {(s.step, s.sample_key) for s in result.samples}
    expected = {(step, str(i)) for step in STEPS for i in range(GROUPS * MEMBERS)}
    assert audited == expected - ({(STEP, str(TARGET))} if unreadable else set()), audited
    cells = [c for c in cells if c.invariant != INPUT]
    strict = {c.invariant for c in cells} - METRICS
    named_at_all = {r.name for r in (*result.violated, *result.suspected)}
    assert named_at_all == strict, [r.line() for r in (*result.violated, *result.suspected)]
    assert {r.name for r in result.suspected} == strict & set(DETECTORS)  # a detector only suspects
    for name in strict:
        places = {(o["step"], o["sample_key"]) for o in by_name[name].offenders}
        assert places == {(STEP, str(TARGET))}, (name, places)
        assert by_name[name].violated == 1, by_name[name].line()
    for cell in cells:
        found = by_name[cell.invariant].offenders
        offenders = found[:1] if cell.invariant in METRICS else found[:OFFENDERS_PER_SAMPLE]
        named = {(o["step"], o["sample_key"], o["row"], o["layer"]): o["where"] for o in offenders}
        key = (STEP, str(TARGET), cell.row, cell.layer)
        assert key in named, (cell, list(named))
        assert named[key] == _place(framework, root, steps, cell.row), named[key]
    # The metrics that name samples name only the planted one (its prompt rows differ from the
    # group's when the fault reached them): never a healthy sample.
    for name in ("prefix_agreement", "fallback"):
        places = {(o["step"], o["sample_key"]) for o in by_name[name].offenders}
        assert places <= {(STEP, str(TARGET))}, (name, places)


def _case(framework: str, writer: str, fault: Fault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant ``fault`` in a dump written by ``writer`` and audit it with the facts and without."""
    if framework not in fault.frameworks:
        pytest.skip(f"{fault.name}: a {framework} dump cannot hold it")
    monkeypatch.delenv(NUM_EXPERTS_ENV, raising=False)
    monkeypatch.delenv(MOE_LAYERS_ENV, raising=False)
    steps = {step: rollout(fault.experts, step) for step in STEPS}
    cells = fault.plant(steps[STEP][TARGET], framework)
    root = tmp_path / "experiment"
    WRITERS[framework, writer](root, steps)
    for facts in (True, False):
        inferred: list[str] = []
        errors: list[str] = []
        result = _audit(framework, root, tmp_path / f"run-{facts}", fault.experts, facts, inferred, errors)
        _check(result, errors, cells, framework, root, steps)
        if facts:
            assert inferred == []
            continue
        layers = next(line for line in inferred if line.startswith("moe_layers"))
        assert layers.startswith("moe_layers 1-3: inferred"), inferred
        odd = f"{_place(framework, root, steps, None)} (layers "
        assert (odd in layers) == (framework in fault.odd_layers), (fault.name, layers)
        if framework == "slime":
            experts = next(line for line in inferred if line.startswith("num_experts"))
            assert experts.startswith(f"num_experts {fault.experts}: inferred"), inferred


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
@pytest.mark.parametrize("framework", ["verl", "skyrl", "slime"])
def test_a_planted_fault_is_named_at_its_place_with_and_without_the_facts(
    framework: str, fault: Fault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _case(framework, "synthetic", fault, tmp_path, monkeypatch)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_a_planted_fault_in_the_releases_own_dump_is_named_at_its_place(
    framework: str, fault: Fault, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _case(framework, "release", fault, tmp_path, monkeypatch)


@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_verl_and_skyrl_dumps_need_the_expert_count_given(
    framework: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without it the import is one error naming it: inferred from the ids, an id wrapped into
    ``[E, 256)`` would raise the bound and hide itself."""
    monkeypatch.delenv(NUM_EXPERTS_ENV, raising=False)
    WRITERS[framework, "synthetic"](tmp_path, {step: rollout(NARROW, step) for step in STEPS})
    dump = tmp_path / {"verl": "rollout_dump", "skyrl": "export"}[framework]
    with pytest.raises(
        LayoutError, match=f"^num_experts: a {'SkyRL' if framework == 'skyrl' else 'verl'} dump"
    ):
        import_dump(framework, dump, tmp_path / "run")
