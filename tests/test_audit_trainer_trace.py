"""``rrh audit DUMP --trainer-trace DIR`` on a real verl 0.9.1 R3 forward with megatron-core 0.19.2's
router tracer on (``tests/trainer_trace_run.py``): correct replay raises no violation, each mutant is
named at its step, sample, row and layer, and a trace that cannot be placed is one input error.

Needs verl 0.9.1 on megatron-core 0.19.2: ``tox -e verl-0.9.1-mcore-0.19.2``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.audit import AuditOptions, LayoutError, RunWriter, audit_run
from harness.audit.layout.schema import SampleRecord


def _release(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


pytestmark = pytest.mark.skipif(
    (_release("verl"), _release("megatron-core")) != ("0.9.1", "0.19.2"),
    reason="needs verl 0.9.1 on megatron-core 0.19.2 (tox -e verl-0.9.1-mcore-0.19.2)",
)

LENGTHS = [(3, 4), (6, 5), (2, 1), (5, 3), (4, 5), (1, 2)]
"""(prompt, response) of each sample; verl's dynamic batching packs them into micro-batches of ≤ 24 tokens."""
EVEN = [(3, 5), (6, 4), (2, 2), (5, 3), (4, 4), (1, 3)]
"""Samples of an even token count: under TP2 none is padded (verl's R2 replays zero filler on padded rows,
and megatron-core's tracer drops such a call: ``test_r2_replays_zero_filler_on_tp_padding_...``)."""
EQUAL = [(4, 3)] * 6
"""Equal lengths, so that every micro-batch packs as many tokens (the ``previous`` mutant's stale
targets then fit the next micro-batch)."""
MAX_TOKENS = 24
STEPS = {1: None, 2: "native", 3: "one_layer", 4: "previous", 5: "shift"}


def _run(
    tmp: Path,
    tp: int,
    pp: int,
    steps: dict[int, str | None],
    dp: int = 1,
    reference: bool = False,
    cp: int = 1,
    r2: dict[str, Any] | None = None,
    lengths: list[tuple[int, int]] = LENGTHS,
) -> tuple[Path, Path, list[Any]]:
    """The dump and trace of a traced run on ``tp·cp·pp·dp`` gloo ranks (R3, or R2 with the update's
    settings ``r2``); rank 0's rows of each step: its old-log-prob micro-batches (R3) or its update
    mini-batches (R2)."""
    from harness.testing.megatron_cpu import setup_rank
    from harness.testing.ranks import run_ranks
    from tests import trainer_trace_run as run

    dump = tmp / "rollout_dump" / "exp_proj" / "GBS6_N1_in6_out5"
    plan = []
    for step, mutant in steps.items():
        file = run.write_dump(
            dump, step, EQUAL if mutant == "previous" else lengths, seed=step, routes=r2 is None
        )
        plan.append((step, str(file), mutant))
    cfg = {"tp": tp, "pp": pp, "cp": cp, "trace": str(tmp / "trace"), "steps": plan,
           "max_token_len": MAX_TOKENS, "reference": reference, **(r2 or {})}  # fmt: skip
    target = run.traced_run if r2 is None else run.traced_r2_run
    ranks = run_ranks(target, tp * cp * pp * dp, args=(cfg,), setup=setup_rank, timeout=400)
    return dump, tmp / "trace", ranks.results[0]


def _layout(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, r2: dict[str, Any] | None = None) -> Any:
    from harness.audit.trace.join import TrainerLayout
    from harness.audit.trace.verl_packing import UpdateBatching, VerlBatching

    batching = VerlBatching(dp=dp, tp=tp, cp=cp, max_token_len_per_gpu=MAX_TOKENS)
    if r2 is None:
        return TrainerLayout(batching, pp=pp)
    update = UpdateBatching(
        mini_batch_size=r2["mini_batch"], epochs=r2["epochs"], shuffle=r2["shuffle"],
        max_token_len_per_gpu=r2["update_max_token_len"],
    )  # fmt: skip
    return TrainerLayout(batching, pp=pp, replay="R2", update=update)


def _joined(dump: Path, trace: Path, layout: Any) -> list[SampleRecord]:
    from harness.audit.trace import join as trace_join

    return list(trace_join.records(dump, trace, layout, num_experts=8, moe_layers=(1, 2, 3)))


def _offenders(records: list[SampleRecord], tmp: Path) -> dict[int, list[dict[str, Any]]]:
    """``replay_fidelity``'s offenders of each step (each audited on its own: offender lists are bounded)."""
    run = tmp / "run"
    with RunWriter(run) as writer:
        for record in records:
            writer.write(record)
    found = {}
    for step in sorted({r.step for r in records}):
        result = audit_run(run, options=AuditOptions(steps=frozenset({step})), executor="serial")
        (fidelity,) = [i for i in result.invariants if i.name == "replay_fidelity"]
        assert fidelity.status in ("checked", "violated"), fidelity.line()
        assert fidelity.checked == len(LENGTHS), fidelity.line()
        found[step] = fidelity.offenders
    return found


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Any]]:
    """Each step's old-log-prob forward, then a reference pass (native routing, its own micro-batches)."""
    return _run(tmp_path_factory.mktemp("tp1"), 1, 1, STEPS, reference=True)


def test_each_mutant_is_named_at_its_step_sample_row_and_layer_and_correct_replay_passes(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    dump, trace, micro_rows = tp1
    offenders = _offenders(_joined(dump, trace, _layout()), tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    for step in (2, 3, 4, 5):
        assert offenders[step], f"step {step} ({STEPS[step]}): no violation named"
        for o in offenders[step]:
            assert o["step"] == step and o["row"] is not None and o["layer"] in (1, 2, 3), o
            assert "gen_batch.dp batch row" in o["where"], o
    assert {o["layer"] for o in offenders[2]} == {1, 2, 3}, "native routing: every MoE layer"
    assert {o["layer"] for o in offenders[3]} == {3}, "one layer unreplayed: that layer only"
    assert {o["layer"] for o in offenders[5]} == {1, 2, 3}, "a layer shift: every MoE layer"
    first, later = micro_rows[3][0], [r for mb in micro_rows[3][1:] for r in mb]
    assert later, "the previous-micro-batch step needs two micro-batches"
    stale = {int(o["sample_key"]) for o in offenders[4]}
    assert stale and stale <= set(later) and not stale & set(first), (stale, micro_rows[3])


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["tp2-sp", "pp2", "dp2"])
def test_tp2_with_sequence_parallel_pp2_and_dp2_place_every_row(
    tp: int, pp: int, dp: int, tmp_path: Path
) -> None:
    dump, trace, _ = _run(tmp_path, tp, pp, {1: None, 2: "one_layer"}, dp)
    offenders = _offenders(_joined(dump, trace, _layout(tp, pp, dp)), tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    assert offenders[2] and {o["layer"] for o in offenders[2]} == {3}, offenders[2][:3]


def _moved_by_contiguous_cp(micro_rows: list[list[int]], tp: int, cp: int) -> set[tuple[int, int]]:
    """``(dump row, position)`` of each token whose replay target a contiguous CP shard of the targets
    takes from another row than a zig-zag shard (the token's own): every sample padded to ``tp·cp·2``,
    CP rank ``c`` holding its chunks ``c`` and ``2cp−1−c`` (tokens) or the rows ``[c·T/cp, (c+1)·T/cp)``
    of the packed buffer (targets). Worked out here from the micro-batches the run observed."""
    moved = set()
    align = 2 * tp * cp
    for rows in micro_rows:
        lengths = [sum(LENGTHS[r]) for r in rows]
        padded = [-(-n // align) * align for n in lengths]
        starts = [sum(padded[:i]) for i in range(len(rows))]
        local = sum(padded) // cp
        for c in range(cp):
            zigzag = []
            for start, size in zip(starts, padded, strict=True):
                half = size // (2 * cp)
                for chunk in (c, 2 * cp - 1 - c):
                    zigzag.extend(range(start + chunk * half, start + (chunk + 1) * half))
            for j, global_row in enumerate(zigzag):
                if global_row != c * local + j:
                    i = max(k for k, start in enumerate(starts) if start <= global_row)
                    if global_row - starts[i] < lengths[i]:
                        moved.add((rows[i], global_row - starts[i]))
    return moved


@pytest.mark.parametrize("tp", [1, 2], ids=["cp2", "cp2-tp2-sp"])
def test_cp2_places_each_ranks_zigzag_chunks_and_names_routes_sharded_contiguously(
    tp: int, tmp_path: Path
) -> None:
    """Context parallel 2 (alone, and with TP2 + SP): correct replay passes, an unreplayed layer is
    named at that layer, and replay targets sharded contiguously while the tokens are zig-zagged
    (verl #7297's class) are named only at tokens whose target came from another row."""
    steps = {1: None, 2: "one_layer", 3: "cp_contiguous"}
    dump, trace, micro_rows = _run(tmp_path, tp, 1, steps, cp=2)
    offenders = _offenders(_joined(dump, trace, _layout(tp, cp=2)), tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    assert offenders[2] and {o["layer"] for o in offenders[2]} == {3}, offenders[2][:3]
    moved = _moved_by_contiguous_cp(micro_rows[2], tp, cp=2)
    named = {(int(o["sample_key"]), int(o["row"])) for o in offenders[3]}
    assert named and named <= moved, (sorted(named - moved)[:5], len(moved))


def test_the_joined_run_audits_the_same_with_serial_processes_and_ray(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    """The joined run (every step, mutants included), written in small files and audited one unit per
    row group by the serial executor, a process pool and, where Ray imports, a local Ray cluster: the
    same result, floats and offenders' places included."""
    from harness.audit.execution.executors import plan_run

    dump, trace, _ = tp1
    run = tmp_path / "run"
    with RunWriter(run, file_bytes=4_000) as writer:
        for record in _joined(dump, trace, _layout()):
            writer.write(record)
    assert len(plan_run(run, unit_bytes=1).units) > 2, "several units, for the executors to merge"
    serial = audit_run(run, executor="serial", unit_bytes=1).as_dict()
    (fidelity,) = [r for r in serial["invariants"] if r["name"] == "replay_fidelity"]
    assert fidelity["status"] == "violated" and fidelity["offenders"], fidelity
    assert audit_run(run, executor="processes", workers=2, unit_bytes=1).as_dict() == serial
    if importlib.util.find_spec("ray") is not None:
        assert audit_run(run, executor="ray", unit_bytes=1).as_dict() == serial


def _copy(tp1: tuple[Path, Path, list[Any]], tmp: Path) -> tuple[Path, Path]:
    dump, trace, _ = tp1
    shutil.copytree(trace, tmp / "trace")
    return dump, tmp / "trace"


def _edit(file: Path, line: int, change: Any) -> None:
    lines = file.read_text().splitlines()
    record = json.loads(lines[line - 1])
    change(record)
    lines[line - 1] = json.dumps(record)
    file.write_text("\n".join(lines) + "\n")


def test_a_trace_that_cannot_be_placed_is_one_input_error_naming_rank_record_and_what_disagreed(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    dump, trace = _copy(tp1, tmp_path)
    rank0 = trace / "router_trace_rank0.jsonl"

    def fewer(record: dict[str, Any]) -> None:
        record["top_indices"].pop()
        record["num_tokens"] -= 1

    for line in (1, 2, 3):  # micro-batch 0 on every MoE layer: the trace agrees with itself, not with verl
        _edit(rank0, line, fewer)
    layer = json.loads(rank0.read_text().splitlines()[0])["layer"]
    with pytest.raises(LayoutError) as err:
        _joined(dump, trace, _layout())
    text = str(err.value)
    assert f"{rank0}:1" in text and "rank 0" in text and f"local layer {layer}" in text, text
    assert "tokens; expected" in text and "micro-batch 0" in text and "\n" not in text, text

    with pytest.raises(LayoutError, match=r"ranks \[0\]; expected .* 0\.\.1"):
        _joined(dump, trace, _layout(tp=2))  # a layout the trace was not taken with
    with pytest.raises(LayoutError, match=r"ranks \[0\]; expected .* 0\.\.1 \(tp·cp·dp·pp = 1·2·1·1\)"):
        _joined(dump, trace, _layout(cp=2))


def test_a_step_the_dump_does_not_hold_and_a_layer_out_of_stage_are_input_errors(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    dump, trace = _copy(tp1, tmp_path)
    rank0 = trace / "router_trace_rank0.jsonl"
    for line, text in enumerate(rank0.read_text().splitlines(), start=1):
        if json.loads(text)["layer"] == 1:  # every call of layer 1 relabelled 0, dense in the dump
            _edit(rank0, line, lambda r: r.update(layer=0))
    with pytest.raises(
        LayoutError, match=r"router_trace_rank0\.jsonl:1: rank 0 .* decoder layer 0; expected one of"
    ):
        _joined(dump, trace, _layout())
    shutil.copy(tp1[1] / "router_trace_rank0.jsonl", rank0)
    last = rank0.read_text().splitlines()[-1]
    rank0.write_text(rank0.read_text() + json.dumps({**json.loads(last), "step": 9}) + "\n")
    with pytest.raises(LayoutError, match=r"rank 0 traces step 9, which the dump .* does not hold"):
        _joined(dump, trace, _layout())


def test_rrh_audit_trainer_trace_prints_the_committed_transcript(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 1 correct, step 3 with decoder layer 3 unreplayed: exit 1, replay_fidelity names step 3's
    samples at layer 3 (docs/audit.md quotes it)."""
    from harness.cli import main
    from tests.audit_transcript import check, transcript

    trace = tp1[1]
    root = trace.parent
    args = [
        str(root / "rollout_dump"),
        "--trainer-trace",
        str(trace),
        "--trainer-layout",
        f"max_token_len={MAX_TOKENS}",
        "--num-experts",
        "8",
        "--moe-layers",
        "1-3",
        "--steps",
        "1,3",
    ]
    (tmp_path / "scratch").mkdir()
    text = transcript(capsys, args, root, tmp_path / "scratch")
    assert "exit 1" in text.splitlines()[1], text[:400]
    assert "replay_fidelity     VIOLATED in 6 of 12 samples; first at step 3 sample" in text, text
    assert "router calls after each step's old-log-prob forward (reference log-probs" in text, text
    check("verl_trainer_trace", text)
    wrong = ["audit", *args[:4], "tp=2,max_token_len=24", *args[5:], "--executor", "serial", "--no-progress"]
    assert main(wrong) == 2
    err = capsys.readouterr().err
    assert err.count("rrh audit: ") == 1 and "ranks [0]; expected" in err, err


R2_STEPS = {1: None, 2: "update_recording"}
R2 = {"mini_batch": 2, "epochs": 1, "shuffle": False, "update_max_token_len": 16}
"""verl's update: mini-batches of 2 samples (3 per step), micro-batched to ≤ 16 tokens (the old-log-prob
forward: ≤ 24), one epoch."""


@pytest.fixture(scope="module")
def r2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Any]]:
    """verl's R2 on one rank: step 1 correct, step 2 with the recording taken from the update pass."""
    return _run(tmp_path_factory.mktemp("r2"), 1, 1, R2_STEPS, r2=R2)


def test_r2_recording_taken_from_the_update_pass_is_named_at_the_update_forwards_after_a_weight_change(
    r2_run: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    """Correct R2 (the old-log-prob forward records, every update forward replays it) raises no
    violation; the recording taken from the update pass is named at every sample of the mini-batches
    after the first (forwarded after the weights changed) on every MoE layer, and at no sample of the
    first (same weights: its native routing is the old-log-prob forward's)."""
    dump, trace, minis = r2_run
    records = _joined(dump, trace, _layout(r2=R2))
    assert {r.replay for r in records} == {"R2"} and all(r.recorded_routes is not None for r in records)
    offenders = _offenders(records, tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    assert len(minis[1]) == 3, minis[1]
    named = {int(o["sample_key"]) for o in offenders[2]}
    assert named == {r for mini in minis[1][1:] for r in mini}, (named, minis[1])
    for o in offenders[2]:
        assert o["step"] == 2 and o["row"] is not None and o["layer"] in (1, 2, 3), o
        assert o["expected"].startswith("recorded experts") and "gen_batch.dp batch row" in o["where"], o
    assert {o["layer"] for o in offenders[2]} == {1, 2, 3}


def test_r2_on_pp2_places_each_stages_update_forwards(tmp_path: Path) -> None:
    """PP2 (each stage records its own layers, ``pp_gather`` joins them, each stage traces its own):
    correct R2 passes; the update-recording mutant is named exactly at the later mini-batches' samples."""
    dump, trace, minis = _run(tmp_path, 1, 2, R2_STEPS, r2=R2)
    offenders = _offenders(_joined(dump, trace, _layout(pp=2, r2=R2)), tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    named = {int(o["sample_key"]) for o in offenders[2]}
    assert named == {r for mini in minis[1][1:] for r in mini}, (named, minis[1])
    assert {o["layer"] for o in offenders[2]} == {1, 2, 3}


def test_r2_compares_every_update_forward_over_two_shuffled_epochs_on_tp2_sp_and_dp2(tmp_path: Path) -> None:
    """TP2 with SP and DP2, two epochs of mini-batches of one sample per DP rank, shuffled with
    ``data_loader_seed + dp_rank``: correct R2 passes, and under the update-recording mutant every
    sample is named (its second epoch's forward comes after a weight change, even where its first
    did not)."""
    r2 = {**R2, "epochs": 2, "shuffle": True}
    dump, trace, minis = _run(tmp_path, 2, 1, R2_STEPS, dp=2, r2=r2, lengths=EVEN)
    assert len(minis[1]) == 6, minis[1]
    offenders = _offenders(_joined(dump, trace, _layout(tp=2, dp=2, r2=r2)), tmp_path)
    assert offenders[1] == [], offenders[1][:3]
    assert {int(o["sample_key"]) for o in offenders[2]} == set(range(len(EVEN))), offenders[2][:3]


def test_an_r2_trace_that_disagrees_with_verls_update_packing_is_one_input_error(
    r2_run: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    """An update call with a token too few, and a call after the update's last forward (a reference pass
    on the actor's model, or activation recompute), are each one input error naming the record; so is
    an R2 dump (no routed_experts) without --moe-layers."""
    dump, trace = _copy(r2_run, tmp_path)
    rank0 = trace / "router_trace_rank0.jsonl"
    lines = rank0.read_text().splitlines()
    first = [i for i, text in enumerate(lines, start=1) if json.loads(text)["step"] == 1]
    update = first[-3:]  # the update's last forward, on MoE layers 1, 2 and 3

    def fewer(record: dict[str, Any]) -> None:
        record["top_indices"].pop()
        record["num_tokens"] -= 1

    for line in update:  # the trace agrees with itself, not with verl's update packing
        _edit(rank0, line, fewer)
    with pytest.raises(LayoutError) as err:
        _joined(dump, trace, _layout(r2=R2))
    text = str(err.value)
    assert f"{rank0}:{update[0]}" in text and "update mini-batch 2" in text and "tokens; expected" in text, (
        text
    )
    shutil.copy(r2_run[1] / "router_trace_rank0.jsonl", rank0)
    lines[first[-1] : first[-1]] = [lines[i - 1] for i in update]  # the step's last forward, once more
    rank0.write_text("\n".join(lines) + "\n")
    with pytest.raises(LayoutError, match=r"after the update's last forward.* activation recompute"):
        _joined(dump, trace, _layout(r2=R2))
    from harness.audit.trace import join as trace_join

    shutil.copy(r2_run[1] / "router_trace_rank0.jsonl", rank0)
    with pytest.raises(LayoutError, match=r"gen_batch\.dp: no routed_experts .*; expected --moe-layers"):
        list(
            trace_join.records(dump, trace, _layout(r2=R2), num_experts=8)
        )  # an R2 dump: nothing to infer from


def test_rrh_audit_trainer_trace_r2_prints_the_committed_transcript(
    r2_run: tuple[Path, Path, list[Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``replay=R2`` in ``--trainer-layout``: step 2's update forwards named against the recording (exit
    1; docs/audit.md quotes it)."""
    from tests.audit_transcript import check, transcript

    trace = r2_run[1]
    root = trace.parent
    spec = f"max_token_len={MAX_TOKENS},replay=R2,ppo_mini_batch=2,ppo_max_token_len=16"
    args = [str(root / "rollout_dump"), "--trainer-trace", str(trace), "--trainer-layout", spec,
            "--num-experts", "8", "--moe-layers", "1-3"]  # fmt: skip
    (tmp_path / "scratch").mkdir()
    text = transcript(capsys, args, root, tmp_path / "scratch")
    assert "exit 1" in text.splitlines()[1], text[:400]
    assert "replay_fidelity     VIOLATED in 4 of 12 samples; first at step 2 sample" in text, text
    assert "expected recorded experts" in text, text
    check("verl_trainer_trace_r2", text)


def test_r2_replays_zero_filler_on_tp_padding_and_the_tracer_drops_those_calls_one_input_error(
    tmp_path: Path,
) -> None:
    """verl 0.9.1's R2 under TP2 on samples of odd length: ``set_router_replay_data`` packs the recording
    with ``preprocess_thd_engine``, which pads each sample to a multiple of tp with zero rows, and
    replays them with no mask (R3 masks them: ``build_r3_replay_mask``), so a padded row's target is
    ``[0, 0]``; its routing map then holds one expert, and megatron-core's tracer skips the whole call
    (``expert_idx.numel() != num_tokens * topk``). The join names the first record that disagrees with
    verl's update packing and says why a call may be missing, once."""
    dump, trace, _ = _run(tmp_path, 2, 1, {1: None}, r2=R2)
    with pytest.raises(LayoutError) as err:
        _joined(dump, trace, _layout(tp=2, r2=R2))
    text = str(err.value)
    assert "a call may be missing or extra: megatron-core's tracer skips a call" in text, text
    assert "update mini-batch" in text and "\n" not in text, text


def test_following_the_dump_and_its_trace_as_they_are_written_equals_the_one_shot_join(
    tp1: tuple[Path, Path, list[Any]], tmp_path: Path
) -> None:
    """``rrh audit DUMP --follow --trainer-trace DIR`` while a script hands over the run as verl
    writes it (step k's dump, then step k's trace records on every rank): step k is reported once
    step k + 1 is written, and the result equals the one-shot join of the finished run."""
    import os
    import subprocess

    from tests.test_audit_follow import RRH, _lines, same_result

    dump, trace, _ = tp1
    steps = sorted(int(p.name) for p in dump.iterdir() if p.name.isdigit())
    by_step: dict[int, dict[str, str]] = {s: {} for s in steps}
    for file in sorted(trace.glob("router_trace_rank*.jsonl")):
        for line in file.read_text().splitlines(keepends=True):
            step = json.loads(line)["step"]
            by_step[step][file.name] = by_step[step].get(file.name, "") + line
    export, traced, staging = tmp_path / "export", tmp_path / "trace", tmp_path / "staging"
    for folder in (export, traced, staging):
        folder.mkdir()
    options = ["--trainer-trace", str(traced), "--trainer-layout", f"max_token_len={MAX_TOKENS}",
               "--num-experts", "8", "--moe-layers", "1-3"]  # fmt: skip
    command = [*RRH, "audit", str(export), "--follow", "--from", "verl", *options,
               "--until-step", str(steps[-1]), "--settle", "1", "--poll", "0.05", "--idle", "120",
               "--json", str(tmp_path / "follow.json"), "--no-progress"]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    lines, printed = _lines(process), []
    try:
        for k, step in enumerate(steps):
            shutil.copytree(dump / str(step), staging / str(step))
            os.replace(staging / str(step), export / str(step))  # the step's folder appears whole
            for name, text in by_step[step].items():
                with open(traced / name, "a") as handle:  # the tracer's flush at advance_step
                    handle.write(text)
            if k == 0:
                continue
            for line in lines:  # step k - 1 is complete now that every rank traced step k
                printed.append(line)
                if line.startswith(f"step {steps[k - 1]}:"):
                    break
            assert printed[-1].startswith(f"step {steps[k - 1]}:"), printed
        printed += list(lines)
    finally:
        process.wait(120)
    step_lines = [line for line in printed if line.startswith("step ")]
    assert [int(line.split()[1].rstrip(":")) for line in step_lines] == steps, printed
    assert process.returncode == 1, printed  # the mutants' steps
    assert any(line.startswith("VIOLATED replay_fidelity at step 2 ") for line in printed), printed
    once = subprocess.run(
        [*RRH, "audit", str(export), "--from", "verl", *options, "--json", str(tmp_path / "once.json"),
         "--executor", "serial"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert once.returncode == 1, once.stderr
    followed, whole = (json.loads((tmp_path / f).read_text()) for f in ("follow.json", "once.json"))
    same_result(followed, whole)
    assert followed["notes"] == whole["notes"] and followed["input_errors"] == whole["input_errors"] == []
