"""The audit's result does not depend on how a run is split, read or merged (DESIGN §7).

Every figure of ``harness.audit`` is a mergeable accumulator, so the result of an audit is the
same, to the last bit, for any split of the run into files, row groups and units of work, any
order of its rows, any order of merging the units' states and any executor. Here a generated
run (every planted fault in it) is re-sharded at random and audited unit by unit, the states
merged along a random tree; the result must equal the serial audit of the run as written, floats
included, up to what names the physical place of a row (file names, row indices, bytes read).
The executors (serial, a process pool) must give the same result with the places included. And
the audit must find every planted fault at its exact (step, sample, row, layer), and nothing in a
clean run.
"""

from __future__ import annotations

import copy
import itertools
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("pyarrow")
import pyarrow as pa
import pyarrow.parquet as pq

from harness.audit import audit_run
from harness.audit.checks.invariants import STRICT
from harness.audit.checks.state import AuditState
from harness.audit.execution.executors import audit_unit, plan_run
from harness.audit.layout.reader import run_files
from harness.audit.result.audit_result import AuditResult
from harness.audit.synthetic.generate import FAULTS, PlantedFault, RunShape, generate_run

# Three steps of three GRPO groups of three: 27 samples, top-4 of 16 experts (uint8, a route fits
# a 32-bit word), five MoE layers.
SHAPE = RunShape(
    steps=3, prompts=3, group_size=3, prompt_len=7, response_len=9, layers=5, experts=16, top_k=4
)
# Routes that fit no machine word (top-3 of uint16 ids): numpy kernels; uint16 expert counts.
WIDE = RunShape(
    steps=2, prompts=2, group_size=3, prompt_len=5, response_len=6, layers=3, experts=300, top_k=3
)
WIDE_FAULTS = tuple(f for f in FAULTS if f != "wrapped_id")  # no room to wrap an id in uint16
SMALL_FILES = {"file_bytes": 6_000, "row_group_bytes": 2_500}
"""A file per step, a few samples per row group: a small run of many files and row groups."""


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[PlantedFault]]:
    directory = tmp_path_factory.mktemp("faulty")
    planted = generate_run(directory, SHAPE, seed=11, faults=FAULTS, **SMALL_FILES)
    return directory, planted


@pytest.fixture(scope="module")
def reference(faulty: tuple[Path, list[PlantedFault]]) -> dict[str, Any]:
    return audit_run(faulty[0], executor="serial").as_dict()


def logical(result: dict[str, Any]) -> dict[str, Any]:
    """The result less what names a row's physical place: file names and row indices, files, bytes."""
    out = copy.deepcopy(result)
    out.pop("files")
    out.pop("bytes_read")
    for invariant in out["invariants"]:
        for offender in invariant["offenders"]:
            offender.pop("where")
    for ranked in out["worst"].values():
        for sample in ranked:
            sample.pop("where")
    return out


def merge_along_a_tree(states: list[AuditState], rng: random.Random) -> AuditState:
    """Merge ``states`` pairwise in a random order, either way round, until one is left."""
    states = list(states)
    while len(states) > 1:
        i, j = rng.sample(range(len(states)), 2)
        states[i].merge(states[j])
        states.pop(j)
    return states[0] if states else AuditState()


@st.composite
def shardings(draw: st.DrawFn, rows: int) -> dict[str, Any]:
    """A split of ``rows`` rows into files and row groups, a row order and a unit size."""
    files = draw(st.integers(1, min(4, rows)))
    cuts = sorted(
        draw(st.lists(st.integers(1, rows - 1), min_size=files - 1, max_size=files - 1, unique=True))
    )
    return {
        "order": draw(st.permutations(range(rows))),
        "bounds": [0, *cuts, rows],
        "row_groups": [draw(st.integers(1, rows)) for _ in range(files)],
        "unit_bytes": draw(st.sampled_from([1, 20_000, 200_000, 1 << 30])),
        "merge_seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_split_order_and_merge_tree_gives_the_same_result(
    faulty: tuple[Path, list[PlantedFault]], reference: dict[str, Any], data: st.DataObject
) -> None:
    table = pa.concat_tables(pq.read_table(path) for path in run_files(faulty[0]))
    split = data.draw(shardings(table.num_rows))
    shuffled = table.take(pa.array(split["order"]))
    with tempfile.TemporaryDirectory() as tmp:
        for index, (lo, hi) in enumerate(itertools.pairwise(split["bounds"])):
            # Names sort in another order than the rows: the units' order is not the rows' order.
            path = Path(tmp) / f"part-{(index * 7919) % 10007:05d}.parquet"
            pq.write_table(shuffled.slice(lo, hi - lo), path, row_group_size=split["row_groups"][index])
        plan = plan_run(tmp, split["unit_bytes"])
        assert not plan.errors
        states = [audit_unit(unit) for unit in plan.units]
        merged = merge_along_a_tree(states, random.Random(split["merge_seed"]))
        assert logical(AuditResult.of(merged).as_dict()) == logical(reference)


@pytest.mark.parametrize("unit_bytes", [1, None])
def test_serial_reading_ahead_or_not_and_process_pool_give_the_same_result(
    faulty: tuple[Path, list[PlantedFault]], reference: dict[str, Any], unit_bytes: int | None
) -> None:
    serial = audit_run(faulty[0], executor="serial", unit_bytes=unit_bytes, read_ahead=False).as_dict()
    ahead = audit_run(faulty[0], executor="serial", unit_bytes=unit_bytes, read_ahead=True).as_dict()
    pool = audit_run(faulty[0], executor="processes", workers=2, unit_bytes=unit_bytes).as_dict()
    assert ahead == serial
    assert pool == serial
    assert logical(serial) == logical(reference)


def test_routes_that_fit_no_word_give_the_same_result_however_split(tmp_path: Path) -> None:
    planted = generate_run(tmp_path, WIDE, seed=5, faults=WIDE_FAULTS, **SMALL_FILES)
    whole = audit_run(tmp_path, executor="serial").as_dict()
    per_group = audit_run(tmp_path, executor="serial", unit_bytes=1).as_dict()
    pool = audit_run(tmp_path, executor="processes", workers=2, unit_bytes=1).as_dict()
    assert whole == per_group == pool
    assert_found(whole, planted)


def varied_run(directory: Path, seed: int, axis: str) -> None:
    """A run that exercises what generated runs do not: dense layers (decoder axis) or the
    moe_ordinal axis, uncaptured rows, R2 with recorded routes, null columns, token and log-prob
    faults, top-3 routes (no machine word) or uint16 ids, many small files and row groups."""
    from harness.audit.layout.schema import SampleRecord
    from harness.audit.layout.writer import RunWriter

    rng = np.random.default_rng(seed)
    layers, k, experts = 6, (3, 4)[seed % 2], (20, 300)[seed % 3 == 0]
    dense = (0, 1) if axis == "decoder" else ()
    moe = [layer for layer in range(layers) if layer not in dense]

    def routes(rows: int) -> np.ndarray:
        out = np.zeros((rows, layers, k), np.int64)
        for layer in moe:
            out[:, layer] = np.argsort(rng.random((rows, experts)), axis=1)[:, :k]
        return out

    with RunWriter(directory, file_bytes=3000) as writer:
        for step in range(3):
            for group in range(3):
                prompt = int(rng.integers(2, 6))
                shared, prompt_tokens = routes(prompt), rng.integers(0, 100, prompt)
                for member in range(3):
                    response = int(rng.integers(0, 6))
                    rows = prompt + response - 1
                    engine = np.concatenate([shared, routes(max(rows - prompt, 0))])[: max(rows, 0)]
                    trainer = engine[:, :, ::-1].copy()
                    mode = rng.choice(np.array(["R3", "R2", "none", ""]))
                    recorded = trainer.copy() if mode == "R2" else None
                    if recorded is not None and rows and rng.random() < 0.5:
                        recorded[0, moe[-1]] = (recorded[0, moe[-1]] + 1) % experts
                    if rows and rng.random() < 0.3:
                        trainer[int(rng.integers(0, rows)), moe[int(rng.integers(0, len(moe)))]] = (
                            np.arange(k) + experts - k
                        )
                    tokens = np.concatenate([prompt_tokens, rng.integers(0, 100, response)])
                    trainer_tokens = tokens.copy() if rng.random() < 0.5 else None
                    if trainer_tokens is not None and rng.random() < 0.4:
                        trainer_tokens[int(rng.integers(0, tokens.size))] += 1
                    engine_lp = -rng.exponential(1, response).astype(np.float32)
                    trainer_lp = (engine_lp + rng.normal(0, 0.01, response)).astype(np.float32)
                    if response and rng.random() < 0.2:
                        engine_lp[int(rng.integers(0, response))] = np.nan
                    slots = slice(None) if axis == "decoder" else moe
                    writer.write(SampleRecord(
                        step=step, sample_key=f"s{step}g{group}m{member}",
                        group_key=f"g{group}" if rng.random() < 0.9 else None, prompt_len=prompt,
                        response_len=response, tokens=tokens, num_experts=experts, top_k=k,
                        num_layers=layers if axis == "decoder" else len(moe), moe_layers=moe, source="varied",
                        layer_axis=axis, engine_routes=engine[:, slots],
                        engine_captured=rng.random(rows) < 0.7 if rows and rng.random() < 0.4 else None,
                        trainer_routes=trainer[:, slots] if rng.random() < 0.9 else None,
                        recorded_routes=None if recorded is None else recorded[:, slots], replay=mode or None,
                        trainer_tokens=trainer_tokens,
                        engine_logprobs=engine_lp if rng.random() < 0.9 else None,
                        trainer_logprobs=trainer_lp if rng.random() < 0.8 else None,
                        loss_mask=rng.random(response) < 0.9 if rng.random() < 0.5 else None,
                    ))  # fmt: skip


@pytest.mark.parametrize(
    "seed, axis", [(5, "decoder"), (4, "decoder"), (3, "moe_ordinal"), (2, "moe_ordinal")]
)
def test_a_varied_run_gives_the_same_result_however_split(tmp_path: Path, seed: int, axis: str) -> None:
    varied_run(tmp_path, seed, axis)
    whole = audit_run(tmp_path, executor="serial", unit_bytes=1 << 30).as_dict()
    per_group = audit_run(tmp_path, executor="serial", unit_bytes=1).as_dict()
    assert str(logical(per_group)) == str(logical(whole))  # str: NaN (a sample with no log-prob) equals NaN
    assert {r["status"] for r in whole["invariants"]} >= {"violated", "checked"}


def assert_found(result: dict[str, Any], planted: list[PlantedFault]) -> None:
    """Each planted fault is an offender of its invariant at its exact (step, sample, row, layer)."""
    invariants = {r["name"]: r for r in result["invariants"]}
    for fault in planted:
        where = (
            fault.step,
            fault.sample_key,
            None if fault.row < 0 else fault.row,
            None if fault.layer < 0 else fault.layer,
        )
        found = [
            (o["step"], o["sample_key"], o["row"], o["layer"])
            for o in invariants[fault.invariant]["offenders"]
        ]
        assert invariants[fault.invariant]["status"] == "violated", fault
        assert where in found, (fault, found)


def test_every_planted_fault_is_found_at_its_place(
    faulty: tuple[Path, list[PlantedFault]], reference: dict[str, Any]
) -> None:
    planted = faulty[1]
    assert sorted(f.kind for f in planted) == sorted(FAULTS)
    assert_found(reference, planted)
    # Each fault sits in its own sample: no other sample violates anything.
    victims = {(f.step, f.sample_key) for f in planted}
    for invariant in reference["invariants"]:
        if invariant["kind"] != "strict":
            continue  # a metric names its worst samples, faulty or not
        for offender in invariant["offenders"]:
            assert (offender["step"], offender["sample_key"]) in victims, offender


def test_a_clean_run_has_no_strict_violation(tmp_path: Path) -> None:
    generate_run(tmp_path, SHAPE, seed=11, **SMALL_FILES)
    result = audit_run(tmp_path, executor="serial")
    strict = {r.name: r for r in result.invariants if r.kind in ("strict", "suspicion")}
    assert set(strict) == set(STRICT)  # the strict invariants and the detectors
    assert [r.name for r in strict.values() if r.status in ("violated", "suspect")] == []
    assert not result.input_errors
    checked = {name for name, r in strict.items() if r.status == "checked"}
    assert {"unique_sample", "coverage", "ids_valid", "dense_empty", "moe_layer_nonzero", "logprobs_valid",
            "replay_fidelity"} <= checked  # fmt: skip


def assert_same_rows(a: pa.Table, b: pa.Table) -> None:
    """Equal schemas (metadata included) and rows; NaN log-probs (a planted fault) compare equal."""
    assert a.schema.equals(b.schema, check_metadata=True)
    for name in a.schema.names:
        x, y = a.column(name).combine_chunks(), b.column(name).combine_chunks()
        if pa.types.is_list(x.type) and pa.types.is_floating(x.type.value_type):
            assert x.is_null().equals(y.is_null()) and x.offsets.equals(y.offsets), name
            assert np.array_equal(x.values.to_numpy(), y.values.to_numpy(), equal_nan=True), name
        else:
            assert x.equals(y), name


def test_the_columnar_generator_writes_the_rows_record_by_record_writing_does(tmp_path: Path) -> None:
    fast = generate_run(tmp_path / "columnar", SHAPE, seed=11, faults=FAULTS, **SMALL_FILES)
    slow = generate_run(tmp_path / "records", SHAPE, seed=11, faults=FAULTS, columnar=False, **SMALL_FILES)
    assert fast == slow
    a = pa.concat_tables(pq.read_table(p) for p in run_files(tmp_path / "columnar"))
    b = pa.concat_tables(pq.read_table(p) for p in run_files(tmp_path / "records"))
    assert_same_rows(a, b)
    assert logical(audit_run(tmp_path / "columnar", executor="serial").as_dict()) == logical(
        audit_run(tmp_path / "records", executor="serial").as_dict()
    )


def test_generating_in_parallel_processes_writes_the_same_files(tmp_path: Path) -> None:
    one = generate_run(tmp_path / "one", SHAPE, seed=2, faults=FAULTS, **SMALL_FILES)
    two = generate_run(tmp_path / "two", SHAPE, seed=2, faults=FAULTS, **SMALL_FILES, workers=2)
    assert one == two
    names = [p.name for p in run_files(tmp_path / "one")]
    assert len(names) > 1 and names == [p.name for p in run_files(tmp_path / "two")]
    for name in names:
        assert_same_rows(pq.read_table(tmp_path / "one" / name), pq.read_table(tmp_path / "two" / name))


def test_steps_filter_names_the_files_own_rows(faulty: tuple[Path, list[PlantedFault]]) -> None:
    """With rows filtered out, an offender still names its row's index in the file."""
    from harness.audit import AuditOptions

    directory, planted = faulty
    last = max(f.step for f in planted)
    everything = audit_run(directory, executor="serial").as_dict()
    filtered = audit_run(
        directory, executor="serial", options=AuditOptions(steps=frozenset({last}))
    ).as_dict()
    where = {(r["name"], o["sample_key"], o["row"], o["layer"]): o["where"] for r in everything["invariants"]
             for o in r["offenders"]}  # fmt: skip
    named = 0
    for invariant in filtered["invariants"]:
        for o in invariant["offenders"]:
            key = (invariant["name"], o["sample_key"], o["row"], o["layer"])
            if invariant["kind"] == "strict" or key in where:  # a metric's worst may rank others first
                assert where[key] == o["where"]
                named += 1
    assert named


# --- the audit's kernels against the obvious computations -----------------------------------------


@settings(max_examples=30)
@given(
    rows=st.integers(0, 40),
    layers=st.integers(1, 5),
    k=st.sampled_from([1, 2, 3, 8]),
    experts=st.sampled_from([5, 128, 256, 300]),
    groups=st.integers(1, 3),
    dense=st.booleans(),
    uncaptured=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_expert_counts_and_row_digests_match_the_obvious_loops(
    rows: int, layers: int, k: int, experts: int, groups: int, dense: bool, uncaptured: bool, seed: int
) -> None:
    from harness.audit.checks import kernels

    rng = np.random.default_rng(seed)
    dtype = np.uint8 if experts <= 256 else np.uint16
    routes = rng.integers(0, min(experts + 3, np.iinfo(dtype).max + 1), size=(rows, layers, k)).astype(dtype)
    row_group = np.sort(rng.integers(0, groups, size=rows))
    captured = rng.random(rows) < (0.8 if uncaptured else 1.0)
    slots = (
        np.sort(rng.choice(layers, size=max(1, layers - 1), replace=False)) if dense else np.arange(layers)
    )
    prompt = rng.random(rows) < 0.5
    load, digests = kernels.load_and_digests(routes, slots, captured, row_group, groups, experts, prompt)
    want = np.zeros((groups, slots.size, experts), np.int64)
    for r in np.flatnonzero(captured):
        for j, s in enumerate(slots):
            for e in routes[r, s]:
                if e < experts:
                    want[row_group[r], j, e] += 1
    assert (load == want).all()
    for r in range(rows):
        digest = 0
        for s in slots:  # the digest of a row: per layer the sum of the ids' table entries, FNV-folded
            digest = (digest * 0x100000001B3 + sum(int(kernels._TABLE[e]) for e in routes[r, s])) % 2**64
        assert int(digests[r]) == (digest if prompt[r] else 0)
    # Any order of a route's ids gives the same digest.
    shuffled = rng.permuted(routes, axis=2)
    assert (
        kernels.load_and_digests(shuffled, slots, captured, row_group, groups, experts, prompt)[1] == digests
    ).all()


@settings(max_examples=30)
@given(n=st.integers(0, 200), segments=st.integers(1, 12), scale=st.floats(-6, 1), seed=st.integers(0, 2**16))
def test_the_gap_of_segments_does_not_depend_on_how_they_are_split_into_calls(
    n: int, segments: int, scale: float, seed: int
) -> None:
    """One ``add_segments`` call, or one call per segment merged in reverse order: identical figures."""
    import math

    from harness.metrics.accumulator import GapAccumulator

    rng = np.random.default_rng(seed)
    train = -rng.exponential(1.0, n)
    infer = np.minimum(train + rng.normal(0.0, 10**scale, n), 0.0)
    starts = np.unique(np.concatenate([[0], rng.integers(0, max(n, 1), size=segments - 1)])).astype(np.int64)
    whole, parts = GapAccumulator(), GapAccumulator()
    whole.add_segments(train, infer, starts)
    bounds = [*starts.tolist(), n]
    for lo, hi in reversed(list(itertools.pairwise(bounds))):
        part = GapAccumulator()
        part.add_segments(train[lo:hi], infer[lo:hi], np.zeros(1, dtype=np.int64))
        parts.merge(part)
    a, b = whole.result(), parts.result()
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert x == y or (math.isnan(x) and math.isnan(y)), name


@pytest.mark.parametrize("span", [1, 7, 64])
def test_offenders_are_located_the_same_in_spans_of_any_size(
    faulty: tuple[Path, list[PlantedFault]], reference: dict[str, Any], tmp_path: Path, span: int
) -> None:
    """A batch that fails the fast id checks is searched in spans of whole samples of about
    ``LOCATE_ROWS`` rows (bounded memory): any span size finds the same offenders."""
    from unittest import mock

    from harness.audit.checks import ids

    varied_run(tmp_path, 5, "decoder")
    whole = audit_run(tmp_path, executor="serial").as_dict()
    with mock.patch.object(ids, "LOCATE_ROWS", span):
        assert audit_run(faulty[0], executor="serial").as_dict() == reference
        assert str(audit_run(tmp_path, executor="serial").as_dict()) == str(whole)
