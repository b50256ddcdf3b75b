"""The tap (``harness.audit.tap.trainer``) and layout v2: a tapped run audits clean, each tap-only invariant
catches its bug (splice keeping the latest payload, replay doing nothing on one layer, CP/SP shards
overlapping or leaving a gap), and bad input is a clear error or a named violation. Fast, CPU, no
engine: the engine side is fed ``EngineRollout``s of the reference model's own routing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from harness.audit import audit_run
from harness.audit.layout.schema import LayoutError, SampleRecord, arrow_schema
from harness.audit.tap.engine import EngineTap, TapError
from harness.audit.tap.trainer import BackgroundWriter, PackedRows, TrainerTap, attach_probe
from harness.engines.checkpoint import EngineRollout
from harness.lab.measure import LabConfig, build_model
from harness.trace import LayerAxis, RoutingTrace
from reference_impl import RoutingMode
from reference_impl.splice import Attempt, splice, splice_replace

CFG = LabConfig(num_experts=8, top_k=2, num_layers=2, hidden_size=32, dtype="float32")
PROMPT = 5


def _model(seed: int = 0) -> Any:
    return build_model(LabConfig(**{**CFG.__dict__, "seed": seed}))


@torch.no_grad()
def _rollout(model: Any, context: list[int], new: list[int]) -> EngineRollout:
    """The engine call that read ``context`` and generated ``new``: its payload is the model's own routing."""
    probe = attach_probe(model)
    model(torch.tensor([context + new]))
    ids = probe.last().ids[: len(context) + len(new) - 1].numpy()
    probe.remove()
    trace = RoutingTrace(
        ids, num_experts=CFG.num_experts, num_layers=CFG.num_layers, layer_axis=LayerAxis.MOE_ORDINAL
    )
    return EngineRollout(tuple(context), tuple(new), tuple([-0.5] * len(new)), trace)


def _engine_samples(engine_models: tuple[Any, Any], keys: list[str], splicer: Any = splice) -> list[Any]:
    """Each sample: a start under weights v0 (``engine_models[0]``) and a resume under v1."""
    tap = EngineTap()
    gen = torch.Generator().manual_seed(1)
    for key in keys:
        prompt = torch.randint(8, 200, (PROMPT,), generator=gen).tolist()
        first = torch.randint(8, 200, (3,), generator=gen).tolist()
        rest = torch.randint(8, 200, (4,), generator=gen).tolist()
        tap.attempt(
            key, _rollout(engine_models[0], prompt, first), kind="start", weight_version=0, group_key="g"
        )
        tap.attempt(key, _rollout(engine_models[1], prompt + first, rest), kind="resume", weight_version=1)
    samples = [tap.pop(k) for k in keys]
    for s in samples:
        first, rest = (torch.from_numpy(a.routes.astype(np.int64)) for a in s.attempts)
        attempts = [Attempt(3, first, "abort", "start"), Attempt(4, rest, "stop", "resume", 0, 1)]
        s.spliced = splicer(s.prompt_len, attempts).numpy()
    return samples


def _train(
    run: Path, samples: list[Any], replay: str, trainer_model: Any, *, skip_layer: int | None = None
) -> None:
    """One step of a trainer on ``trainer_model``: R3 replays the spliced routes (except ``skip_layer``)."""
    from harness.subjects.reference import install_replay

    with BackgroundWriter(run) as writer:
        tap = TrainerTap(trainer_model, writer, num_layers=CFG.num_layers, moe_layers=range(CFG.num_layers),
                         num_experts=CFG.num_experts, top_k=CFG.top_k, source="test")  # fmt: skip
        handle = install_replay(trainer_model)
        ids = torch.tensor([list(s.tokens) for s in samples])
        mask = torch.ones_like(ids, dtype=torch.bool)
        targets = torch.stack(
            [torch.from_numpy(np.concatenate([s.spliced, s.spliced[-1:]]).astype(np.int64)) for s in samples]
        )
        replayed = torch.ones(ids.shape, dtype=torch.bool)
        replayed[:, -1] = False
        rows = PackedRows.padded([s.key for s in samples], mask.numpy())
        with torch.no_grad():
            if replay == "R3":
                handle.replay(targets.reshape(-1, CFG.num_layers, CFG.top_k), replayed.reshape(-1))
                if skip_layer is not None:  # the bug: one router never receives its targets
                    trainer_model.routers()[skip_layer].replay.mode = RoutingMode.NATIVE
            with tap.forward("old_logprob", rows, ids):
                logits = trainer_model(ids)
        handle.disarm()
        lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        for i, s in enumerate(samples):
            tap.logprobs(s.key, lp[i, s.prompt_len - 1 :].numpy())
        tap.write(0, samples, replay=replay)


def _statuses(run: Path) -> dict[str, Any]:
    result = audit_run(run, executor="serial")
    assert not result.input_errors, result.input_errors
    return {r.name: r for r in result.invariants}


def test_a_tapped_r3_run_is_clean_and_every_tap_invariant_is_checked(tmp_path: Path) -> None:
    model = _model()
    samples = _engine_samples((model, model), ["a", "b"])
    _train(tmp_path, samples, "R3", _model(seed=3))  # other weights: the routes agree through replay only
    found = _statuses(tmp_path)
    for name in (
        "coverage",
        "ids_valid",
        "replay_fidelity",
        "splice_consistency",
        "logprobs_valid",
        "tokens_match",
    ):
        assert found[name].status == "checked" and found[name].checked == 2, (name, found[name])
    assert found["agreement"].status == "checked"
    assert found["shard_union"].status == "not checkable"
    result = audit_run(tmp_path, executor="serial")
    assert all(layer["disagreement"] == 0 for layer in result.layers), result.layers
    # The same trainer without replay: its live routes differ from the engine's.
    _train(tmp_path / "none", _engine_samples((model, model), ["a", "b"]), "none", _model(seed=3))
    result = audit_run(tmp_path / "none", executor="serial")
    assert all(layer["disagreement"] > 0 for layer in result.layers), result.layers


def test_replay_doing_nothing_on_one_layer_is_named_at_its_layer(tmp_path: Path) -> None:
    samples = _engine_samples((_model(), _model()), ["a"])
    _train(tmp_path, samples, "R3", _model(seed=3), skip_layer=1)
    fidelity = _statuses(tmp_path)["replay_fidelity"]
    assert fidelity.status == "violated"
    assert {o["layer"] for o in fidelity.offenders} == {1}
    assert fidelity.offenders[0]["step"] == 0 and fidelity.offenders[0]["sample_key"] == "a"


def test_a_splice_keeping_the_latest_payload_is_caught_and_the_correct_one_passes(tmp_path: Path) -> None:
    engines = (_model(seed=0), _model(seed=1))  # a weight push between the attempts
    for name, splicer, status in (("correct", splice, "checked"), ("latest", splice_replace, "violated")):
        run = tmp_path / name
        _train(run, _engine_samples(engines, ["a"], splicer), "none", _model())
        result = _statuses(run)["splice_consistency"]
        assert result.status == status, (name, result)
        if status == "violated":
            o = result.offenders[0]
            assert o["row"] < PROMPT + 3 - 1 and "attempt 0" in o["expected"]


def _shard_run(run: Path, parts: list[list[int]], ranks: list[int] | None = None) -> None:
    """CP ranks: shard r holds the positions ``parts[r]`` of sample ``a`` (12 tokens, 11 route rows)."""
    model = _model()
    ranks = ranks or list(range(len(parts)))
    samples = _engine_samples((model, model), ["a"])
    tokens = torch.tensor([list(samples[0].tokens)])
    for shard, (positions, rank) in enumerate(zip(parts, ranks, strict=True)):
        with BackgroundWriter(run, rank=rank, world_size=max(ranks) + 1) as writer:
            tap = TrainerTap(model, writer, num_layers=CFG.num_layers, moe_layers=range(CFG.num_layers),
                             num_experts=CFG.num_experts, top_k=CFG.top_k, source="test", shard=shard,
                             shards=len(parts))  # fmt: skip
            rows = PackedRows.packed(["a"], [0, len(positions)], positions)
            with torch.no_grad(), tap.forward("old_logprob", rows):
                model(tokens[:, positions])
            tap.write(0, samples, replay="R3")


def test_shard_union_is_checked_on_real_per_rank_files(tmp_path: Path) -> None:
    zigzag = [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]  # CP zig-zag (2 ranks, 4 chunks) of 12 tokens
    _shard_run(tmp_path / "ok", zigzag)
    assert _statuses(tmp_path / "ok")["shard_union"].status == "checked"
    _shard_run(tmp_path / "overlap", [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8, 9, 10, 11]])
    union = _statuses(tmp_path / "overlap")["shard_union"]
    assert (
        union.status == "violated" and "row 4 claimed 2 times (ranks 0 and 1)" in union.offenders[0]["actual"]
    )
    _shard_run(tmp_path / "gap", [[0, 1, 2], [5, 6, 7, 8, 9, 10, 11]])
    union = _statuses(tmp_path / "gap")["shard_union"]
    assert union.status == "violated" and "first row 3" in union.offenders[0]["actual"]


def test_a_run_with_shard_rows_counts_its_samples_not_its_records(tmp_path: Path) -> None:
    """The summary line and the HTML header count samples; shard rows are records of the same
    samples (docs/tap-and-run.md's picture once said 57 samples for 19 samples' 57 records)."""
    from harness.report.audit_page import audit_html

    _shard_run(tmp_path, [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]])
    result = audit_run(tmp_path, executor="serial")
    samples = len({(s.step, s.sample_key) for s in result.samples})
    assert result.rows > samples
    assert result.counted() == f"{samples} samples ({result.rows} records)"
    assert f" · {samples} samples ({result.rows} records) · " in audit_html(
        result, title="run", command="rrh audit run", seconds=0.0
    )


# --- bad input -----------------------------------------------------------------------------------


def test_a_row_without_sample_key_or_position_is_refused() -> None:
    with pytest.raises(TapError, match=r"sample_key: row 1 \(position 4\) has no sample key"):
        PackedRows.rows(["a", None], [3, 4])
    with pytest.raises(TapError, match=r"position: row 0 of sample 'a' has no position"):
        PackedRows.rows(["a", None], [None, None])
    with pytest.raises(TapError, match="position_ids: 3 entries; expected cu_seqlens"):
        PackedRows.packed(["a"], [0, 4], [0, 1, 2])


def test_a_forward_whose_rows_do_not_match_the_packing_is_refused(tmp_path: Path) -> None:
    model = _model()
    with BackgroundWriter(tmp_path) as writer:
        tap = TrainerTap(model, writer, num_layers=2, moe_layers=range(2), num_experts=8, top_k=2, source="t")
        with pytest.raises(TapError, match="rows: 3 packed rows given; the forward dispatched 4 tokens"):
            with torch.no_grad(), tap.forward("old_logprob", PackedRows.rows(["a"] * 3, [0, 1, 2])):
                model(torch.arange(4)[None])
        with pytest.raises(TapError, match="forward: expected one of"):
            with tap.forward("rollout", PackedRows.rows(["a"], [0])):
                pass


def test_a_sample_with_a_missing_position_is_refused_when_written(tmp_path: Path) -> None:
    model = _model()
    samples = _engine_samples((model, model), ["a"])
    with BackgroundWriter(tmp_path) as writer:
        tap = TrainerTap(model, writer, num_layers=2, moe_layers=range(2), num_experts=8, top_k=2, source="t")
        n = len(samples[0].tokens)
        with (
            torch.no_grad(),
            tap.forward("old_logprob", PackedRows.rows(["a"] * (n - 1), [*range(4), *range(5, n)])),
        ):
            model(torch.tensor([list(samples[0].tokens[:4] + samples[0].tokens[5:])]))
        with pytest.raises(TapError, match="sample 'a' in forward 'old_logprob': position 4 has no row"):
            tap.write(0, samples, replay="R3")


def test_two_ranks_claiming_one_whole_sample_are_named(tmp_path: Path) -> None:
    model = _model()
    samples = _engine_samples((model, model), ["a"])
    for rank in (0, 1):
        run_rank = _train_rank(tmp_path, samples, model, rank)
        assert run_rank
    unique = _statuses(tmp_path)["unique_sample"]
    assert unique.status == "violated" and "2 rows" in unique.offenders[0]["actual"]


def _train_rank(run: Path, samples: list[Any], model: Any, rank: int) -> bool:
    with BackgroundWriter(run, rank=rank, world_size=2) as writer:
        tap = TrainerTap(model, writer, num_layers=2, moe_layers=range(2), num_experts=8, top_k=2, source="t")
        ids = torch.tensor([list(samples[0].tokens)])
        with torch.no_grad(), tap.forward("old_logprob", PackedRows.padded(["a"], np.ones(ids.shape, bool))):
            model(ids)
        tap.write(0, samples, replay="none")
    return True


def test_a_missing_rank_file_and_a_run_cut_short_are_reported(tmp_path: Path) -> None:
    model = _model()
    samples = _engine_samples((model, model), ["a"])
    _train_rank(tmp_path, samples, model, 0)
    _train_rank(tmp_path, _engine_samples((model, model), ["b"]), model, 1)
    next(tmp_path.glob("part-r00001-*.parquet")).unlink()
    result = audit_run(tmp_path, executor="serial")
    assert any("missing; rank 1's manifest lists it" in e for e in result.input_errors), result.input_errors
    # A writer left on an exception never closes its manifest: the audit says the run was cut short.
    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError), BackgroundWriter(cut) as writer:
        writer.put(SampleRecord(0, "a", 2, 1, [1, 2, 3], 8, 2, 2, [0, 1], "t"))
        writer.end_step(0)
        writer.put(SampleRecord(1, "a", 2, 1, [1, 2, 3], 8, 2, 2, [0, 1], "t"))
        raise RuntimeError("the trainer died")
    result = audit_run(cut, executor="serial")
    assert not result.input_errors
    assert result.rows == 1 and any("run cut short: rank 0 never closed its tap (last step written: 0)" in n
                                    for n in result.notes), result.notes  # fmt: skip


def test_layout_v1_files_are_still_read_and_unknown_versions_refused(tmp_path: Path) -> None:
    row = SampleRecord(
        0, "a", 2, 1, [1, 2, 3], 8, 2, 2, [0, 1], "t", engine_routes=np.array([[[0, 1], [2, 3]]] * 2)
    ).as_row()
    v1 = arrow_schema(1)
    table = pa.Table.from_pylist([{k: row[k] for k in v1.names}], schema=v1)
    pq.write_table(table, tmp_path / "part.parquet")
    found = _statuses(tmp_path)
    assert found["coverage"].status == "checked" and found["splice_consistency"].status == "not checkable"
    with pytest.raises(LayoutError, match=r"version 4; expected one of \[1, 2, 3\]"):
        arrow_schema(4)


def test_a_shard_row_needs_its_positions() -> None:
    with pytest.raises(LayoutError, match="shard, shards, positions: a shard row needs all three"):
        SampleRecord(0, "a", 2, 1, [1, 2, 3], 8, 2, 2, [0, 1], "t", shard=0, shards=2).as_row()


def test_a_tapped_runs_engine_side_reads_back_as_recorded(tmp_path: Path) -> None:
    """``rrh run --engine-from``: the attempts a tapped run recorded are what the engine tap saw."""
    from harness.run.loop import recorded_samples

    model = _model()
    samples = _engine_samples((model, _model(seed=1)), ["a", "b"])
    _train(tmp_path, samples, "R3", model)
    back = {s.key: s for s in recorded_samples(tmp_path)[0]}
    for s in samples:
        got = back[s.key]
        assert (got.prompt_len, got.tokens, got.group_key) == (s.prompt_len, s.tokens, s.group_key)
        for mine, theirs in zip(s.attempts, got.attempts, strict=True):
            assert (mine.kind, mine.weight_version, mine.context, mine.generated) == (
                theirs.kind, theirs.weight_version, theirs.context, theirs.generated)  # fmt: skip
            assert np.array_equal(mine.routes, theirs.routes) and mine.logprobs == theirs.logprobs
