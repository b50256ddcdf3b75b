"""What an audit names beyond its strict invariants (issue 32): the samples that move a metric, the
two detectors a dump alone allows (``wrapped_ids``, ``repeated_rows``), the model facts it infers
from what most samples agree on, and where it finds a dump.

Each planted fault is named at its (step, sample, row, layer); each clean counterpart — including
low-entropy routing, where rows legitimately repeat — names nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from harness.audit import AuditResult, LayoutError, RunWriter, SampleRecord, audit_run, importers
from harness.audit.importers.model_shape import ExpertVote, LayerVote
from harness.cli import main


def _routes(rng: np.random.Generator, rows: int, layers: int, experts: int, k: int) -> np.ndarray:
    """``[rows, layers, k]`` routes of k distinct ids in ``[0, experts)`` on every layer."""
    out = np.empty((rows, layers, k), dtype=np.int64)
    for r in range(rows):
        for j in range(layers):
            out[r, j] = rng.choice(experts, size=k, replace=False)
    return out


def _group_records(
    rng: np.random.Generator, *, step: int = 0, group: str = "g0", members: int = 3, prompt: int = 12,
    response: int = 8, layers: int = 3, experts: int = 16, k: int = 2,
) -> list[SampleRecord]:  # fmt: skip
    """A GRPO group: its members share the prompt's tokens and routes, responses of their own."""
    tokens = rng.integers(10, 1000, size=prompt)
    shared = _routes(rng, prompt, layers, experts, k)
    out = []
    for m in range(members):
        routes = np.concatenate([shared, _routes(rng, response - 1, layers, experts, k)])
        out.append(
            SampleRecord(
                step=step, sample_key=f"{group}-m{m}", group_key=group, prompt_len=prompt,
                response_len=response, tokens=np.concatenate([tokens, rng.integers(10, 1000, size=response)]),
                num_experts=experts, top_k=k, num_layers=layers, moe_layers=list(range(layers)),
                source="test", engine_routes=routes, engine_logprobs=-rng.uniform(0.1, 1.0, size=response),
            )
        )  # fmt: skip
    return out


def _write(directory: Path, records: list[SampleRecord], rank: int = 0) -> None:
    with RunWriter(directory, rank=rank) as writer:
        for record in records:
            writer.write(record)


def _by_name(result: AuditResult) -> dict[str, Any]:
    return {r.name: r for r in result.invariants}


def _cells(result: AuditResult, name: str) -> list[tuple[Any, ...]]:
    return [(o["step"], o["sample_key"], o["row"], o["layer"]) for o in _by_name(result)[name].offenders]


# --- prefix_agreement names the rows that differ within a group -------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["one-file", "member-per-rank-file"])
def test_a_prompt_row_that_differs_in_its_group_is_named_with_both_values(
    tmp_path: Path, split: bool
) -> None:
    rng = np.random.default_rng(0)
    records = _group_records(rng)
    odd = records[2]
    before = odd.engine_routes[4, 1].copy()
    odd.engine_routes[4, 1] = (before + 1) % 16  # a prefix row of one member, one layer
    if split:  # each member written by another rank: the group is only whole after merging
        for rank, record in enumerate(records):
            _write(tmp_path, [record], rank=rank)
    else:
        _write(tmp_path, records)
    result = audit_run(tmp_path, executor="serial")
    prefix = _by_name(result)["prefix_agreement"]
    assert prefix.summary.startswith(f"{1 - 1 / 12:.4f} of prompt rows agree"), prefix.summary
    first = prefix.offenders[0]
    assert (first["step"], first["sample_key"], first["row"], first["layer"]) == (0, "g0-m2", 4, 1)
    assert first["expected"].startswith(f"ids {sorted(before.tolist())}, as sample g0-m0 of group g0")
    assert first["actual"].startswith(f"ids {sorted(((before + 1) % 16).tolist())}")
    assert "part-r0000" in first["where"] and " row " in first["where"]
    assert not result.violated  # a metric: named, never a strict violation


def test_a_clean_group_names_nothing(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    _write(tmp_path, _group_records(rng) + _group_records(rng, group="g1"))
    result = audit_run(tmp_path, executor="serial")
    assert _by_name(result)["prefix_agreement"].offenders == []
    assert "1.0000 of prompt rows agree" in _by_name(result)["prefix_agreement"].summary


# --- wrapped_ids: ids stored modulo 256 in one sample --------------------------------------------------


def _wide(rng: np.random.Generator, **kw: Any) -> list[SampleRecord]:
    return _group_records(rng, experts=384, k=4, layers=3, **kw)


def test_ids_stored_modulo_256_in_one_sample_are_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    records = _wide(rng) + _wide(rng, group="g1")
    wrapped = records[1]
    wrapped.engine_routes[:, 2] %= 256  # layer 2 of this sample cast through a byte
    _write(tmp_path, records)
    result = audit_run(tmp_path, executor="serial")
    found = _by_name(result)["wrapped_ids"]
    assert (found.kind, found.status, found.violated) == ("suspicion", "suspect", 1), found.line()
    first = found.offenders[0]
    assert (first["sample_key"], first["layer"]) == ("g0-m1", 2)
    row = first["row"]
    assert first["actual"].startswith(
        f"ids {sorted(wrapped.engine_routes[row, 2].tolist())}: the same modulo 256"
    )
    assert {v.name for v in result.suspected} == {"wrapped_ids"}  # ids_valid cannot see it: all < 384
    assert not result.violated  # a suspicion, not a broken invariant


def test_no_wrap_is_named_on_a_clean_wide_run_nor_where_no_id_can_wrap(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    _write(tmp_path / "wide", _wide(rng) + _wide(rng, group="g1"))
    result = audit_run(tmp_path / "wide", executor="serial")
    assert _by_name(result)["wrapped_ids"].line() == "wrapped_ids         checked: 6 samples, nothing suspect"
    # A differing prefix row that is not a wrap (noise) is no wrap either.
    records = _wide(rng)
    records[0].engine_routes[3, 1] = (records[0].engine_routes[3, 1] + 1) % 384
    _write(tmp_path / "noise", records)
    result = audit_run(tmp_path / "noise", executor="serial")
    assert _by_name(result)["wrapped_ids"].status == "checked"
    _write(tmp_path / "narrow", _group_records(rng))
    narrow = _by_name(audit_run(tmp_path / "narrow", executor="serial"))["wrapped_ids"]
    assert narrow.status == "not checkable" and narrow.missing == ["more than 256 experts"]


# --- repeated_rows: a segment equal to the one before it --------------------------------------------------


def _long(rng: np.random.Generator, key: str, rows: int, layers: int, experts: int, k: int) -> SampleRecord:
    prompt = 8
    return SampleRecord(
        step=0, sample_key=key, prompt_len=prompt, response_len=rows + 1 - prompt,
        tokens=rng.integers(10, 1000, size=rows + 1), num_experts=experts, top_k=k, num_layers=layers,
        moe_layers=list(range(layers)), source="test", engine_routes=_routes(rng, rows, layers, experts, k),
    )  # fmt: skip


def test_a_duplicated_resume_cut_back_to_length_is_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    bad = _long(rng, "dup", 60, 3, 16, 2)
    bad.engine_routes[30:36] = bad.engine_routes[24:30]  # the resumed rows again; the row count unchanged
    _write(tmp_path, [bad, _long(rng, "ok", 60, 3, 16, 2)])
    result = audit_run(tmp_path, executor="serial")
    found = _by_name(result)["repeated_rows"]
    assert found.violated == 1 and _cells(result, "repeated_rows") == [(0, "dup", 30, None)], found.line()
    assert found.offenders[0]["actual"].startswith("rows [30, 36) repeat rows [24, 30) in every layer")
    assert _by_name(result)["coverage"].status == "checked"  # coverage cannot see it


def test_repeated_rows_raise_no_false_alarm_on_low_entropy_routing_or_repeated_text(tmp_path: Path) -> None:
    """Four experts, top-2, one layer: six possible routes, so rows repeat all the time; 200 samples
    of 100 rows name nothing. A sample whose text repeats may route the same: not named either."""
    rng = np.random.default_rng(5)
    _write(tmp_path / "clean", [_long(rng, f"s{i}", 100, 1, 4, 2) for i in range(200)])
    result = audit_run(tmp_path / "clean", executor="serial")
    assert not result.input_errors
    line = _by_name(result)["repeated_rows"].line()
    assert line == "repeated_rows       checked: 200 samples, nothing suspect"
    # Sticky routing: each row repeats the one before it seven times in ten.
    sticky = [_long(rng, f"t{i}", 100, 1, 4, 2) for i in range(200)]
    for record in sticky:
        for r in range(1, 100):
            if rng.random() < 0.7:
                record.engine_routes[r] = record.engine_routes[r - 1]
    _write(tmp_path / "sticky", sticky)
    line = _by_name(audit_run(tmp_path / "sticky", executor="serial"))["repeated_rows"].line()
    assert line == "repeated_rows       checked: 200 samples, nothing suspect"
    echo = _long(rng, "echo", 60, 3, 16, 2)
    echo.engine_routes[30:36] = echo.engine_routes[24:30]
    echo.tokens[30:36] = echo.tokens[24:30]  # the text itself repeats there
    _write(tmp_path / "echo", [echo])
    assert _by_name(audit_run(tmp_path / "echo", executor="serial"))["repeated_rows"].status == "checked"
    # In the same low-entropy routing a long enough duplicate is still implausible, and named.
    bad = _long(rng, "dup", 100, 1, 4, 2)
    bad.engine_routes[40:70] = bad.engine_routes[10:40]
    _write(tmp_path / "bad", [bad])
    assert _cells(audit_run(tmp_path / "bad", executor="serial"), "repeated_rows") == [(0, "dup", 40, None)]


def test_a_duplicated_resume_in_a_skyrl_dump_is_named_at_its_batch_row_and_token_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SkyRL's preprocess cuts a sample's rows back to ``P + R``: rows a resume appended twice leave
    no trace in the row count, only the repeat."""
    from harness.audit.importers import import_dump
    from tests.test_audit_import_frameworks import E, resumed_twice_skyrl

    resumed_twice_skyrl(tmp_path / "export")
    import_dump("skyrl", tmp_path / "export", tmp_path / "run", num_experts=E)
    result = audit_run(tmp_path / "run", executor="serial")
    assert {r.name for r in result.suspected} == {"repeated_rows"} and not result.violated
    found = _by_name(result)["repeated_rows"].offenders
    assert [(o["step"], o["sample_key"], o["row"]) for o in found] == [(1, "3", 20)]
    file = tmp_path / "export" / "dumped_data" / "global_step_1_training_input.pkl"
    assert found[0]["where"] == f"{file} batch row 3, token column 20"  # every sample 47 tokens: no pad


# --- the other metrics name their worst samples -------------------------------------------------------


def test_the_gap_and_the_fallback_name_their_worst_samples_at_their_worst_token(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    records = _group_records(rng)
    for r in records:
        r.trainer_logprobs = r.engine_logprobs - 0.01
    records[1].trainer_logprobs[5] = records[1].engine_logprobs[5] - 2.0  # one token far off
    records[2].engine_captured = [True] * 15 + [False] * 4  # its last four rows were never captured
    _write(tmp_path, records)
    result = audit_run(tmp_path, executor="serial")
    gap = _by_name(result)["logprob_gap"].offenders[0]
    assert (gap["sample_key"], gap["row"]) == ("g0-m1", 12 + 5) and "|Δ| 2" in gap["actual"]
    fallback = _by_name(result)["fallback"].offenders
    assert [(o["sample_key"], o["row"]) for o in fallback] == [("g0-m2", 15)]
    assert "no route captured at 4 of 19 rows" in fallback[0]["actual"]


# --- model facts a dump does not record: what most samples agree on -------------------------------------


def test_the_inferred_layers_are_those_most_samples_route_on_and_a_tie_is_refused() -> None:
    vote = LayerVote()
    for i in range(7):
        vote.add(1, (1, 2, 3), f"f batch row {i}")
    vote.add(1, (0, 1, 2), "f batch row 7")
    assert vote.decide([1]) == (1, 2, 3)
    assert vote.notes() == [
        "moe_layers 1-3: inferred (--moe-layers not given) as the layers most samples route on (step 1); "
        "7 of 8 samples agree; the others are judged against it: f batch row 7 (layers 0-2)"
    ]
    tie = LayerVote()
    tie.add(0, (1, 2), "a")
    tie.add(0, (0, 1), "b")
    with pytest.raises(
        LayoutError, match=r"as many samples route on layers 0-1 as on 1-2 \(1 each\); expected"
    ):
        tie.decide([0])


@pytest.mark.parametrize("name", ["skyrl", "verl"])
def test_one_sample_shifted_onto_a_dense_layer_is_named_and_leaves_the_others_alone(
    name: str, tmp_path: Path
) -> None:
    """In the first step (the one that decides the layout), sample 2's routes sit one layer early: on
    the dense layer 0, with its last MoE layer empty. Without --moe-layers only that sample is named."""
    from harness.audit.importers import import_dump
    from tests.test_audit_import_frameworks import E, _skyrl_synthetic, _verl_synthetic, rollout

    steps = {1: rollout(1), 2: rollout(2)}
    shifted = steps[1][2].routes
    shifted[:, :-1] = shifted[:, 1:].copy()
    shifted[:, -1] = 0
    if name == "skyrl":
        _skyrl_synthetic(tmp_path / "dump", steps, {})
    else:
        _verl_synthetic(tmp_path / "dump", steps)
    inferred: list[str] = []
    import_dump(name, tmp_path / "dump", tmp_path / "run", num_experts=E, inferred=inferred)
    assert inferred[0].startswith("moe_layers 1-3: inferred (--moe-layers not given)"), inferred
    assert "7 of 8 samples agree" in inferred[0] and "batch row 2 (layers 0-2)" in inferred[0], inferred
    result = audit_run(tmp_path / "run", executor="serial")
    by_name = _by_name(result)
    # The empty layer's zero routes repeat an id: ids_valid names them too, in that sample only.
    assert {r.name for r in result.violated} == {"dense_empty", "moe_layer_nonzero", "ids_valid"}
    for violated in result.violated:
        assert violated.violated == 1 and {(o["step"], o["sample_key"]) for o in violated.offenders} == {
            (1, "2")
        }
    assert _cells(result, "dense_empty")[0] == (1, "2", 0, 0)
    assert _cells(result, "moe_layer_nonzero") == [(1, "2", 0, 3)]
    assert by_name["ids_valid"].offenders[0]["layer"] == 3


def test_one_sample_cannot_raise_the_inferred_expert_count() -> None:
    vote = ExpertVote()
    rng = np.random.default_rng(7)
    for i in range(6):
        vote.add(rng.integers(0, 8, size=(20, 2, 2)), f"s{i}")
    vote.add(np.array([[[3, 120]]]), "odd")  # an id past the model's experts, in one sample
    assert vote.decide(top_k=2) == 8
    assert vote.notes(8)[0].endswith(
        "ids past it, each in one sample, are judged out of range: id 120 in odd"
    )


def test_importers_say_their_notes_a_sentence_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in importers.IMPORTERS:
        notes = importers.notes(name)
        assert notes and all(len(n) > 20 for n in notes), (name, notes)
    monkeypatch.setattr(importers.importer("verl"), "NOTES", "one sentence, never its letters")
    assert importers.notes("verl", num_experts=8, moe_layers=[1]) == ("one sentence, never its letters",)


def test_each_importers_hints_name_its_own_framework_only() -> None:
    names = {
        "skyrl": "SkyRL",
        "verl": "verl",
        "slime": "slime",
        "nemo_rl": "NeMo-RL",
        "megatron_lm": "Megatron-LM",
    }
    for name in names:
        module = importers.importer(name)
        assert importers.hints_for([module.SOURCE]) == module.HINTS
        for column, hint in module.HINTS.items():
            others = [other for key, other in names.items() if key != name and other in hint]
            # Megatron-LM's hint may point at the engine-side dumps that hold what it lacks.
            assert not others or name == "megatron_lm", (name, column, hint)
    assert importers.hints_for([importers.importer("verl").SOURCE, "test"]) == {}


# --- where a dump is found ----------------------------------------------------------------------------


def _run_layout(directory: Path) -> None:
    _write(directory, _group_records(np.random.default_rng(8)))


def test_a_dump_is_found_below_the_given_folder_and_two_are_an_error(tmp_path: Path) -> None:
    from tests.test_audit_import_frameworks import _skyrl_synthetic, _verl_synthetic, rollout

    experiment = tmp_path / "experiment"
    _skyrl_synthetic(experiment / "export", {1: rollout(1)}, {})
    (experiment / "checkpoints" / "global_step_1").mkdir(parents=True)
    assert importers.locate(experiment) == ("skyrl", experiment / "export")
    assert importers.locate(experiment / "export" / "dumped_data") == (
        "skyrl",
        experiment / "export" / "dumped_data",
    )
    # The tables of an earlier `rrh audit --summary` beside it are no run: the dump is still found.
    (experiment / "summary").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"step": [1]}), experiment / "summary" / "steps.parquet")
    assert importers.locate(experiment) == ("skyrl", experiment / "export")
    with pytest.raises(LayoutError, match=r"not a verl dump|no run here: .* for \{step\}/gen_batch.dp"):
        importers.locate(experiment, "verl")
    _verl_synthetic(experiment / "rollout_dump", {1: rollout(1)})
    with pytest.raises(LayoutError) as err:
        importers.locate(experiment)
    text = str(err.value)
    assert (
        "2 dumps found" in text
        and str(experiment / "export") in text
        and str(experiment / "rollout_dump") in text
    )
    assert importers.locate(experiment, "verl") == ("verl", experiment / "rollout_dump")
    # One verl dump root with two runs: their steps would collide.
    _verl_synthetic(tmp_path / "two", {1: rollout(1)})
    (tmp_path / "two" / "exp_proj" / "GBS2_N2_in8_out9").rename(
        tmp_path / "two" / "exp_proj" / "GBS2_N2_in8_out7"
    )
    _verl_synthetic(tmp_path / "two", {1: rollout(1)})
    with pytest.raises(
        LayoutError, match=r"2 verl runs found: .*GBS2_N2_in8_out7; .*GBS2_N2_in8_out9; expected one"
    ):
        importers.locate(tmp_path / "two")


def test_the_run_layout_is_still_the_run_and_nothing_says_where_it_looked(tmp_path: Path) -> None:
    _run_layout(tmp_path / "run")
    assert importers.locate(tmp_path / "run") == (None, tmp_path / "run")
    (tmp_path / "nothing" / "a" / "b").mkdir(parents=True)
    with pytest.raises(LayoutError) as err:
        importers.locate(tmp_path / "nothing")
    text = str(err.value)
    assert text.startswith(
        f"{tmp_path / 'nothing'}: no run here: looked in it and up to 3 folder levels below"
    )
    for expected in (
        "global_step_{N}_training_input.pkl",
        "gen_batch.dp",
        "rollout_data/{rollout_id}.pt",
        "train_data_step{N}.jsonl",
        "router_trace_rank{r}.jsonl",
        "*.parquet files of the run layout",
    ):
        assert expected in text, expected  # fmt: skip


# --- places and the page, end to end: the framework's own file, in every output ---------------------------


@pytest.mark.parametrize("name", ["skyrl", "verl"])
def test_offenders_name_the_frameworks_file_batch_row_and_token_column_in_every_output(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.audit.importers import skyrl, verl
    from tests.test_audit_import_frameworks import (
        FAULT_STEP,
        E,
        _skyrl_dump,
        _skyrl_synthetic,
        _verl_dump,
        _verl_synthetic,
    )

    monkeypatch.delenv("RRH_MOE_LAYERS", raising=False)
    if name == "skyrl":
        _skyrl_dump(tmp_path / "dump", _skyrl_synthetic, faulty=True)
        file = tmp_path / "dump" / "dumped_data" / f"global_step_{FAULT_STEP}_training_input.pkl"
        tensors, _ = skyrl.read_batch(file)
        routes = tensors["rollout_expert_indices"]
    else:
        _verl_dump(tmp_path / "dump", _verl_synthetic, faulty=True)
        file = next((tmp_path / "dump").rglob(f"{FAULT_STEP}/gen_batch.dp"))
        routes = verl.read_batch(file)[0]["routed_experts"]
    report, page, tables = tmp_path / "a.json", tmp_path / "a.html", tmp_path / "summary"
    outputs = ["--json", str(report), "--html", str(page), "--summary", str(tables)]
    args = [str(tmp_path / "dump"), "--num-experts", str(E), "--executor", "serial", "--no-progress"]
    code = main(["audit", *args, *outputs])
    out, _ = capsys.readouterr()
    assert code == 1
    doc = json.loads(report.read_text())
    ids = next(r for r in doc["invariants"] if r["name"] == "ids_valid")
    wrapped = next(o for o in ids["offenders"] if o["sample_key"] == "3")  # the id E + 100, planted at row 1
    assert (wrapped["step"], wrapped["row"], wrapped["layer"]) == (FAULT_STEP, 1, 3)
    prefix = f"{file} batch row 3, token column "
    assert wrapped["where"].startswith(prefix), wrapped["where"]
    column = int(wrapped["where"][len(prefix) :])
    assert E + 100 in routes[3, column, 3].tolist()  # the place points at the offending cell of the file
    assert "part-r00000" not in out + report.read_text()  # never the deleted temporary layout
    assert f"({ids['offenders'][0]['where']})" in out  # the terminal names the first offender's place
    import html

    text = page.read_text()
    assert html.escape(wrapped["where"]) in text and "0.0 MiB" not in text and " KiB" in text
    import pyarrow.parquet as pq

    places = {o["where"] for o in pq.read_table(tables / "offenders.parquet").to_pylist()}
    assert wrapped["where"] in places
    samples = {
        (s["step"], s["sample_key"]): s["where"]
        for s in pq.read_table(tables / "samples.parquet").to_pylist()
    }
    assert samples[(FAULT_STEP, "3")] == f"{file} batch row 3"


def test_the_page_says_not_measured_instead_of_empty_charts_and_tables_of_zeros(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_layout(tmp_path / "run")  # engine routes and log-probs only: no trainer side
    page = tmp_path / "a.html"
    assert (
        main(["audit", str(tmp_path / "run"), "--executor", "serial", "--no-progress", "--html", str(page)])
        == 0
    )
    text = page.read_text()
    assert "Routes that differ (trainer vs engine): not measured — missing trainer_routes" in text
    assert "Train–inference gap: not measured — missing trainer_logprobs" in text
    assert "Worst samples by disagreement: not measured" in text
    assert "<h3>Worst samples by disagreement</h3>" not in text
    assert "Rows without a captured route per step: 0 in every step." in text
    assert "<svg" not in text  # nothing measured that a chart would show
    assert " KiB" in text and "0.0 MiB" not in text
