"""Importers of slime/miles, NeMo-RL and Megatron-LM dumps, on files built from their source's field names.

Each format is written here as its framework writes it (the source files are cited in each
importer's docstring): slime's ``torch.save`` of ``Sample.to_dict()`` dicts and its format_version 2
train dump, NeMo-RL's batch-of-one JSONL and R3 trace records, Megatron-LM's per-rank
``router_trace_rank{r}.jsonl``. A clean dump audits with no strict violation; each planted fault is
named at its step and sample (row and layer where the format has them); a broken file is one
``LayoutError`` line naming file and field.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.audit import AuditResult, LayoutError, RunWriter, SampleRecord, audit_run
from harness.audit.importers import import_dump, megatron_lm, nemo_rl, slime
from tests.audit_transcript import check, transcript

E, L, K = 8, 4, 2
"""Experts, decoder layers and top-k of the small model every dump here routes."""
MOE = (1, 2, 3)
"""Its MoE layers: layer 0 is dense (0 in decoder-axis payloads)."""
LENGTHS = ((5, 4), (6, 3), (4, 5), (7, 2))
"""(prompt, response) of the four samples of each step."""


def _routes(rng: np.random.Generator, rows: int, layers: Iterable[int], width: int) -> np.ndarray:
    """Routes ``[rows, width, K]`` with K distinct ids in ``[0, E)`` on ``layers``, 0 elsewhere."""
    out = np.zeros((rows, width, K), dtype=np.int32)
    for layer in layers:
        first = rng.integers(0, E, size=rows)
        out[:, layer, 0] = first
        out[:, layer, 1] = (first + rng.integers(1, E, size=rows)) % E
    return out


def _audit(records: Iterable[SampleRecord], directory: Path) -> AuditResult:
    with RunWriter(directory) as writer:
        for record in records:
            writer.write(record)
    return audit_run(directory, executor="serial")


def _by_name(result: AuditResult) -> dict[str, Any]:
    return {r.name: r for r in result.invariants}


def _offender(result: AuditResult, name: str) -> dict[str, Any]:
    found = _by_name(result)[name]
    assert found.status == "violated", (name, found.status)
    assert found.violated == 1, found.offenders
    return found.offenders[0]


def _one_line(err: pytest.ExceptionInfo[LayoutError], *parts: str) -> None:
    text = str(err.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)


# --- slime / miles ------------------------------------------------------------------------------------


def _slime_sample(
    rng: np.random.Generator, position: int, prompt: int, response: int, numpy_routes: bool
) -> dict:
    """A random sample of the small model; a trailing tool token (no loss, log-prob 0.0:
    ``Sample.append_response_tokens``)."""
    tokens = rng.integers(10, 1000, size=prompt + response).tolist()
    mask = [1] * response
    mask[-1] = 0
    logprobs = [float(-rng.uniform(0.01, 2.0)) for _ in range(response)]
    logprobs[-1] = 0.0
    routes = _routes(rng, prompt + response - 1, MOE, L)
    return _sample_dict(tokens, response, mask, logprobs, routes, position // 2, 100 + position, numpy_routes)


def _sample_dict(
    tokens: list[int], response: int, mask: list[int], logprobs: list[float], routes: np.ndarray,
    group: int, index: int, numpy_routes: bool = False,
) -> dict:  # fmt: skip
    """A ``Sample.to_dict()`` as slime/utils/types.py writes it (miles: routes as a numpy array)."""
    return {
        "group_index": group, "index": index, "rollout_id": None, "prompt": "q",
        "tokens": tokens, "multimodal_inputs": None, "multimodal_train_inputs": None,
        "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "response": "a",
        "response_length": response, "label": None, "reward": 1.0, "loss_mask": mask,
        "weight_versions": ["3"], "rollout_log_probs": logprobs, "rollout_top_p_token_ids": None,
        "rollout_top_p_token_offsets": None,
        "rollout_routed_experts": routes if numpy_routes else torch.from_numpy(routes),
        "remove_sample": False, "teacher_log_probs": None, "status": "completed", "metadata": {},
        "generate_function_path": None, "custom_rm_path": None, "train_metadata": None, "session_id": None,
        "non_generation_time": 0.0,
        "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                      "completion_token_num": 0},
        "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(tokens) - response},
    }  # fmt: skip


def _train_payload(rollout_id: int, samples: list[dict]) -> dict:
    """slime/observability/train_data_utils.py ``_build_dump_payload``: format_version 2, rollout order;
    the trainer's log-probs 0.01 below the rollout's."""
    rows = []
    for position, s in enumerate(samples):
        lp = torch.tensor(s["rollout_log_probs"], dtype=torch.float32)
        rows.append(
            {
                "data_parallel_rank": position % 2, "sample_index": s["index"], "rollout_position": position,
                "tokens": torch.tensor(s["tokens"], dtype=torch.long), "total_lengths": len(s["tokens"]),
                "response_lengths": s["response_length"],
                "loss_masks": torch.tensor(s["loss_mask"], dtype=torch.int), "rollout_log_probs": lp,
                "log_probs": lp - 0.01, "rewards": 1.0,
            }
        )  # fmt: skip
    shards = [
        {"rank": r, "data_parallel_rank": r, "sample_indices": [s["index"] for s in samples[r::2]],
         "partition": list(range(r, len(samples), 2)), "micro_batch_indices": [[0, 1]],
         "num_microbatches": [1], "global_batch_sizes": [len(samples)]}
        for r in range(2)
    ]  # fmt: skip
    return {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": rows, "dp_shards": shards}


def _slime_dump(
    root: Path,
    *,
    steps: int = 2,
    train: bool = True,
    numpy_routes: bool = False,
    edit: Callable[[int, list[dict], list[dict] | None], None] | None = None,
) -> Path:
    """``--dump-details root``: ``rollout_data/{id}.pt``, ``train_data/{id}.pt``; ``edit`` plants faults."""
    rng = np.random.default_rng(0)
    (root / "rollout_data").mkdir(parents=True)
    if train:
        (root / "train_data").mkdir()
    for step in range(steps):
        samples = [_slime_sample(rng, i, p, r, numpy_routes) for i, (p, r) in enumerate(LENGTHS)]
        payload = _train_payload(step, samples) if train else None
        if edit is not None:
            edit(step, samples, None if payload is None else payload["samples"])
        torch.save({"rollout_id": step, "samples": samples}, root / "rollout_data" / f"{step}.pt")
        if payload is not None:
            torch.save(payload, root / "train_data" / f"{step}.pt")
    return root


def test_a_clean_slime_dump_has_no_violation_and_says_what_it_cannot_check(tmp_path: Path) -> None:
    dump = _slime_dump(tmp_path / "dump")
    assert slime.detect(dump)
    result = _audit(slime.records(dump, num_experts=E, moe_layers=MOE), tmp_path / "run")
    status = {name: r.status for name, r in _by_name(result).items()}
    assert not result.violated and not result.input_errors, [r.line() for r in result.violated]
    assert result.rows == 8
    for name in (
        "coverage",
        "ids_valid",
        "dense_empty",
        "moe_layer_nonzero",
        "tokens_match",
        "logprobs_valid",
    ):
        assert status[name] == "checked", (name, status[name])
    for name in ("replay_fidelity", "splice_consistency", "shard_union", "agreement"):
        assert status[name] == "not checkable", (name, status[name])
    assert status["logprob_gap"] == "checked"  # rollout_log_probs against the train dump's log_probs


def test_slime_infers_the_model_shape_when_the_caller_does_not_give_it(tmp_path: Path) -> None:
    dump = _slime_dump(tmp_path / "dump", train=False)
    first = next(slime.records(dump))
    assert (first.num_layers, first.top_k, tuple(first.moe_layers)) == (L, K, MOE)
    assert first.num_experts <= E and first.engine_captured is None
    assert first.trainer_tokens is None and first.trainer_logprobs is None
    import_dump("slime", dump, tmp_path / "run")  # the protocol's call: records(path) alone
    result = audit_run(tmp_path / "run", executor="serial")
    assert not result.violated and not result.input_errors
    assert _by_name(result)["tokens_match"].status == "not checkable"


def test_slime_planted_faults_are_named_at_their_step_sample_row_and_layer(tmp_path: Path) -> None:
    def edit(step: int, samples: list[dict], trained: list[dict] | None) -> None:
        assert trained is not None
        if step == 0:
            samples[1]["rollout_routed_experts"] = samples[1]["rollout_routed_experts"][:-1]  # a row short
            trained[3]["tokens"] = trained[3]["tokens"].clone()
            trained[3]["tokens"][6] += 1  # the trainer consumed another token at position 6
        else:
            samples[2]["rollout_routed_experts"][3, 2, 1] = E + 1  # out of range, fits uint8
            samples[0]["rollout_log_probs"][2] = math.nan

    dump = _slime_dump(tmp_path / "dump", edit=edit)
    result = _audit(slime.records(dump, num_experts=E, moe_layers=MOE), tmp_path / "run")
    coverage = _offender(result, "coverage")
    assert (coverage["step"], coverage["sample_key"], coverage["row"]) == (0, "1", 7)
    assert coverage["expected"].startswith("8 rows") and coverage["actual"].startswith("7 rows")
    ids = _offender(result, "ids_valid")
    assert (ids["step"], ids["sample_key"], ids["row"], ids["layer"]) == (1, "2", 3, 2)
    assert str(E + 1) in ids["actual"]
    tokens = _offender(result, "tokens_match")
    assert (tokens["step"], tokens["sample_key"]) == (0, "3") and "position 6" in tokens["actual"]
    nan = _offender(result, "logprobs_valid")
    assert (nan["step"], nan["sample_key"], nan["row"]) == (1, "0", LENGTHS[0][0] + 2)
    assert "nan" in nan["actual"]


def test_miles_numpy_routes_load_with_the_numeric_numpy_globals_only(tmp_path: Path) -> None:
    dump = _slime_dump(tmp_path / "dump", numpy_routes=True, train=False)
    result = _audit(slime.records(dump, num_experts=E, moe_layers=MOE), tmp_path / "run")
    assert not result.violated and result.rows == 8
    evil = tmp_path / "evil"
    (evil / "rollout_data").mkdir(parents=True)
    torch.save(
        {"rollout_id": 0, "samples": [{"tokens": np.array(["x"], dtype=object)}]}, evil / "rollout_data/0.pt"
    )
    with pytest.raises(LayoutError) as err:
        list(slime.records(evil))
    _one_line(err, "rollout_data/0.pt", "'tokens'", "ObjectArray", "expected integers")


def test_slime_bad_input_is_one_line_naming_file_and_field(tmp_path: Path) -> None:
    dump = _slime_dump(tmp_path / "cut", steps=1)
    whole = (dump / "rollout_data/0.pt").read_bytes()
    (dump / "rollout_data/0.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(LayoutError) as err:
        list(slime.records(dump, num_experts=E, moe_layers=MOE))
    _one_line(err, "rollout_data/0.pt", "truncated", "expected a complete torch.save file")

    dump = _slime_dump(tmp_path / "field", steps=1, edit=lambda step, s, t: s[2].pop("response_length"))
    with pytest.raises(LayoutError) as err:
        list(slime.records(dump, num_experts=E, moe_layers=MOE))
    _one_line(err, "rollout_data/0.pt: samples[2]", "'response_length'", "expected a non-negative integer")

    dump = _slime_dump(tmp_path / "old", steps=1)
    torch.save({"rollout_id": 0, "rank": 0, "rollout_data": {}}, dump / "train_data/0.pt")  # before #2266
    with pytest.raises(LayoutError) as err:
        list(slime.records(dump, num_experts=E, moe_layers=MOE))
    _one_line(err, "train_data/0.pt", "'format_version'", "expected 2")


# --- NeMo-RL ------------------------------------------------------------------------------------------


def _nemo_line(rng: np.random.Generator, idx: int, prompt: int, response: int, width: int) -> dict:
    """One line of ``log_batched_dict_as_jsonl``: every column a batch of one, tokens right-padded."""
    length = prompt + response
    tokens = rng.integers(10, 1000, size=length).tolist() + [0] * (width - length)
    mask = [0] * prompt + [1] * (response - 1) + [0] + [0] * (width - length)  # last: a tool token
    gen = (
        [0.0] * prompt + [float(-rng.uniform(0.01, 2.0)) for _ in range(response)] + [0.0] * (width - length)
    )
    prev = [x - 0.02 if x else 0.0 for x in gen]
    return {
        "content": ["q a"], "rewards": [1.0], "input_lengths": [length], "token_ids": [tokens],
        "token_loss_mask": [mask], "sample_loss_mask": [1.0], "advantages": [[0.5] * width],
        "generation_logprobs": [gen], "prev_logprobs": [prev], "idx": idx,
    }  # fmt: skip


def _nemo_dump(root: Path, edit: Callable[[int, list[dict]], None] | None = None) -> Path:
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    width = max(p + r for p, r in LENGTHS)
    for step in (1, 2):
        lines = [_nemo_line(rng, i, p, r, width) for i, (p, r) in enumerate(LENGTHS)]
        if edit is not None:
            edit(step, lines)
        (root / f"train_data_step{step}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_a_clean_nemo_rl_dump_checks_log_probs_and_cannot_check_routes(tmp_path: Path) -> None:
    dump = _nemo_dump(tmp_path / "logs")
    assert nemo_rl.detect(dump) and not slime.detect(dump)
    import_dump("nemo_rl", dump, tmp_path / "run")
    result = audit_run(tmp_path / "run", executor="serial")
    status = {name: r.status for name, r in _by_name(result).items()}
    assert not result.violated and not result.input_errors and result.rows == 8
    assert status["logprobs_valid"] == "checked" and status["logprob_gap"] == "checked"
    for name in (
        "coverage",
        "ids_valid",
        "moe_layer_nonzero",
        "tokens_match",
        "replay_fidelity",
        "agreement",
    ):
        assert status[name] == "not checkable", (name, status[name])
    first = next(nemo_rl.records(dump))
    assert (first.prompt_len, first.response_len) == LENGTHS[0]
    assert list(first.loss_mask) == [True] * (LENGTHS[0][1] - 1) + [False]


def test_a_nan_nemo_rl_log_prob_is_named_at_its_step_sample_and_position(tmp_path: Path) -> None:
    def edit(step: int, lines: list[dict]) -> None:
        if step == 2:
            lines[1]["generation_logprobs"][0][LENGTHS[1][0] + 1] = math.nan

    result = _audit(nemo_rl.records(_nemo_dump(tmp_path / "logs", edit)), tmp_path / "run")
    nan = _offender(result, "logprobs_valid")
    assert (nan["step"], nan["sample_key"], nan["row"]) == (2, "1", LENGTHS[1][0] + 1)


def _sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def _r3_trace(directory: Path, *, corrupt_key: str | None = None, replay_train: bool = True) -> list[str]:
    """Records as nemo_rl/utils/r3_trace.py writes them (sort_keys JSON), one producer, two fetch stages."""
    rng = np.random.default_rng(2)
    directory.mkdir(parents=True)
    keys = [f"uid{p}_g{i}" for p in range(2) for i in range(2)]
    records: list[dict] = []

    def sample(event: str, idx: int, key: str, routes: np.ndarray, ids: np.ndarray, **extra: Any) -> dict:
        def part(t: np.ndarray) -> dict:
            return {"full_shape": list(t.shape), "valid_shape": list(t.shape), "dtype": "torch.int8",
                    "valid_sha256": _sha(t), "valid_preview": []}  # fmt: skip

        return {"event": event, "trace_step": 1, "sample_idx": idx, "key": key, "valid_length": len(ids),
                "routed_experts": part(routes), "input_ids": part(ids), "rank": 0, **extra}  # fmt: skip

    for idx, key in enumerate(keys):
        routes = _routes(rng, 6, range(2), 2).astype(np.int8)
        ids = rng.integers(0, 1000, size=6)
        records.append(sample("rollout_payload_sample", idx, key, routes, ids))
        for stage in nemo_rl.FETCH_STAGES:
            fetched = routes.copy()
            if key == corrupt_key and stage == "train":
                fetched[4, 1, 0] = (fetched[4, 1, 0] + 1) % E  # one id changed on the way to the trainer
            records.append(sample("tq_fetch_sample", idx, key, fetched, ids, stage=stage))
    for stage in nemo_rl.REPLAY_STAGES:
        if stage == "train" and not replay_train:
            continue
        records.append(
            {"event": "router_replay_assignment", "stage": stage, "trace_step": 1, "layer_number": 1}
        )
        records.append(
            {"event": "router_replay_action", "stage": stage, "trace_step": 1, "action": "replay_forward"}
        )
        records.append({"event": "router_replay_forward_verify", "stage": stage, "trace_step": 1,
                        "action": "replay_forward", "layer_number": 1, "matches_expected": True})  # fmt: skip
    if replay_train:
        records.append(
            {"event": "router_replay_action", "stage": "train", "trace_step": 1, "action": "replay_backward"}
        )
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    (directory / "r3_trace_host_pid1.jsonl").write_text(text)
    return keys


def test_the_r3_trace_hash_checks_name_the_stage_and_sample(tmp_path: Path) -> None:
    _r3_trace(tmp_path / "clean")
    assert nemo_rl.trace_violations(tmp_path / "clean") == []

    keys = _r3_trace(tmp_path / "bad", corrupt_key="uid1_g0")
    (found,) = nemo_rl.trace_violations(tmp_path / "bad")
    assert (found.check, found.stage, found.key, found.trace_step, found.sample_idx) == (
        "routed_experts_hash", "train", keys[2], 1, 2
    )  # fmt: skip
    assert found.where.endswith(":9") and "producer's sha256" in found.expected

    _r3_trace(tmp_path / "noop", replay_train=False)
    checks = {(v.check, v.stage) for v in nemo_rl.trace_violations(tmp_path / "noop")}
    assert checks == {("replay_assignment", "train"), ("replay_action", "train")}


def test_nemo_rl_bad_input_is_one_line_naming_file_line_and_field(tmp_path: Path) -> None:
    dump = _nemo_dump(tmp_path / "cut")
    file = dump / "train_data_step2.jsonl"
    text = file.read_text()
    file.write_text(text[: len(text) - 40])  # the last line cut mid-write
    with pytest.raises(LayoutError) as err:
        list(nemo_rl.records(dump))
    _one_line(err, "train_data_step2.jsonl:4", "not JSON")

    def flat(step: int, lines: list[dict]) -> None:
        lines[0]["token_ids"] = lines[0]["token_ids"][0]  # a bare row, not a batch of one

    with pytest.raises(LayoutError) as err:
        list(nemo_rl.records(_nemo_dump(tmp_path / "flat", flat)))
    _one_line(err, "train_data_step1.jsonl:1", "'token_ids'", "expected a list of one row")

    _r3_trace(tmp_path / "trace")
    trace = tmp_path / "trace" / "r3_trace_host_pid1.jsonl"
    lines = trace.read_text().splitlines()
    broken = json.loads(lines[0])
    del broken["routed_experts"]
    trace.write_text("\n".join([json.dumps(broken), *lines[1:]]) + "\n")
    with pytest.raises(LayoutError) as err:
        nemo_rl.trace_violations(tmp_path / "trace")
    _one_line(err, "r3_trace_host_pid1.jsonl:1", "'routed_experts.valid_sha256'")


# --- Megatron-LM --------------------------------------------------------------------------------------


MEGATRON_LAYERS = (1, 2, 3)
"""Decoder layers with a router (the trace has records for MoE layers only)."""
MICRO_ROWS = 20
"""Rows of each micro-batch: two samples of 9 tokens, each padded by one row."""


def _megatron_trace(
    directory: Path, edit: Callable[[dict, int], None] | None = None
) -> tuple[dict[tuple[int, int], megatron_lm.StepPacking], dict[tuple[int, int, str], np.ndarray]]:
    """Two ranks, two steps of two micro-batches of two samples, one padding row per sample, an MTP head.

    ``edit(record, micro_batch)`` plants faults. Returns the packing the trainer used and every
    sample's routes ``[P + R − 1, MoE layers, K]``.
    """
    rng = np.random.default_rng(3)
    directory.mkdir(parents=True)
    width = len(MEGATRON_LAYERS)
    packs, expected = {}, {}
    for rank in range(2):
        lines: list[dict] = []
        for step in (10, 11):
            samples, segments = [], []
            for i, (prompt, response) in enumerate(LENGTHS):
                key = f"r{rank}s{i}"
                tokens = rng.integers(10, 1000, size=prompt + response).tolist()
                rows = _routes(rng, prompt + response + 1, range(width), width)
                samples.append(megatron_lm.PackedSample(key, tokens, prompt, group_key=str(i // 2)))
                segments.append(rows)
                expected[(step, rank, key)] = rows[: prompt + response - 1]
            cu = np.concatenate([[0], np.cumsum([len(s) for s in segments])]).tolist()
            packs[(step, rank)] = megatron_lm.StepPacking(cu, samples)
            for micro, part in enumerate((segments[:2], segments[2:])):  # each layer, then the next batch
                stream = np.concatenate(part)
                assert len(stream) == MICRO_ROWS
                records = [
                    {"step": step, "stage": "pre_dispatch", "block": "decoder", "layer": layer, "rank": rank,
                     "num_tokens": len(stream), "topk": K, "top_indices": stream[:, j].tolist()}
                    for j, layer in enumerate(MEGATRON_LAYERS)
                ]  # fmt: skip
                records.append(
                    {"step": step, "stage": "pre_dispatch", "block": "mtp", "layer": 0, "rank": rank,
                     "num_tokens": len(stream), "topk": K, "top_indices": stream[:, 0].tolist(), "mtp_idx": 0}
                )  # fmt: skip
                for record in records:
                    if edit is not None:
                        edit(record, micro)
                lines.extend(records)
        text = "".join(json.dumps(x) + "\n" for x in lines)
        (directory / f"router_trace_rank{rank}.jsonl").write_text(text)
    return packs, expected


def test_a_clean_megatron_trace_validates_and_maps_rows_only_with_the_packing(tmp_path: Path) -> None:
    packs, expected = _megatron_trace(tmp_path / "trace")
    assert megatron_lm.detect(tmp_path / "trace") and not nemo_rl.detect(tmp_path / "trace")
    assert megatron_lm.check_trace(tmp_path / "trace", num_experts=E) == []
    with pytest.raises(LayoutError) as err:
        list(megatron_lm.records(tmp_path / "trace"))
    _one_line(err, "no sample id and no position", "packing=", "num_experts=", "check_trace")

    records = list(
        megatron_lm.records(tmp_path / "trace", packing=lambda s, r: packs.get((s, r)), num_experts=E)
    )
    assert len(records) == 16
    for record in records:
        rank = int(record.sample_key[1])
        assert np.array_equal(record.trainer_routes, expected[(record.step, rank, record.sample_key)])
        assert tuple(record.moe_layers) == MEGATRON_LAYERS and record.layer_axis == "moe_ordinal"
    result = _audit(records, tmp_path / "run")
    status = {name: r.status for name, r in _by_name(result).items()}
    assert not result.violated and not result.input_errors
    for name in ("coverage", "ids_valid", "tokens_match", "logprobs_valid", "agreement", "replay_fidelity"):
        assert status[name] == "not checkable", (name, status[name])


def test_megatron_planted_faults_are_named_at_their_step_rank_layer_and_row(tmp_path: Path) -> None:
    def edit(record: dict, micro: int) -> None:
        at = (record["step"], record["rank"], record["block"], record["layer"], micro)
        if at == (11, 1, "decoder", 3, 1):
            record["top_indices"][4] = [E + 2, 0]  # out of range, in the second micro-batch
        elif at == (10, 0, "decoder", 1, 0):
            record["top_indices"][2] = [5, 5]  # a repeated id
        elif at == (10, 1, "decoder", 2, 0):
            record["num_tokens"] += 1  # the record disagrees with itself
        elif at == (11, 0, "decoder", 1, 1):
            record["top_indices"].pop()  # a row lost: this layer routed fewer tokens than the others
            record["num_tokens"] -= 1

    _megatron_trace(tmp_path / "trace", edit)
    violations = megatron_lm.check_trace(tmp_path / "trace", num_experts=E)
    assert {(v.check, v.step, v.rank, v.layer, v.row) for v in violations} == {
        ("ids_valid", 11, 1, 3, MICRO_ROWS + 4),
        ("ids_valid", 10, 0, 1, 2),
        ("rows", 10, 1, 2, None),
        ("layer_tokens", 11, 0, 1, None),
    }
    assert all(
        v.line().startswith(f"{v.check}: step {v.step} rank {v.rank} decoder layer {v.layer}")
        for v in violations
    )
    without_e = megatron_lm.check_trace(tmp_path / "trace")  # no expert count: distinctness and sign only
    assert {(v.check, v.step) for v in without_e} == {("ids_valid", 10), ("rows", 10), ("layer_tokens", 11)}


def test_megatron_bad_input_is_one_line_naming_file_line_and_field(tmp_path: Path) -> None:
    _megatron_trace(tmp_path / "cut")
    file = tmp_path / "cut" / "router_trace_rank1.jsonl"
    text = file.read_text()
    file.write_text(text[: len(text) - 30])
    with pytest.raises(LayoutError) as err:
        megatron_lm.check_trace(tmp_path / "cut")
    _one_line(err, "router_trace_rank1.jsonl:16", "not JSON")

    _megatron_trace(
        tmp_path / "field", lambda record, micro: record.pop("top_indices") if record["layer"] == 3 else None
    )
    with pytest.raises(LayoutError) as err:
        megatron_lm.check_trace(tmp_path / "field")
    _one_line(err, "router_trace_rank0.jsonl:3", "'top_indices'", "expected a list")


# --- what the CLI prints: golden transcripts (tests/transcripts/) --------------------------------------


def _slime_faults(step: int, samples: list[dict], trained: list[dict] | None) -> None:
    """A row short (step 0, sample 1), another token consumed (step 0, sample 3), an id past the
    model's 8 experts (step 1, sample 2) and a NaN log-prob (step 1, sample 0)."""
    assert trained is not None
    if step == 0:
        samples[1]["rollout_routed_experts"] = samples[1]["rollout_routed_experts"][:-1]
        trained[3]["tokens"] = trained[3]["tokens"].clone()
        trained[3]["tokens"][6] += 1
    else:
        samples[2]["rollout_routed_experts"][3, 2, 1] = E + 1
        samples[0]["rollout_log_probs"][2] = math.nan


def test_slime_audit_prints_the_committed_transcript(tmp_path: Path, capsys) -> None:
    """Found below the experiment folder; the expert count and MoE layers inferred (not given)."""
    _slime_dump(tmp_path / "experiment" / "dump", edit=_slime_faults)
    (tmp_path / "scratch").mkdir()
    args = [str(tmp_path / "experiment")]
    check("slime", transcript(capsys, args, tmp_path / "experiment", tmp_path / "scratch"))


def test_nemo_rl_audit_prints_the_committed_transcript(tmp_path: Path, capsys) -> None:
    def edit(step: int, lines: list[dict]) -> None:
        if step == 2:
            lines[1]["generation_logprobs"][0][LENGTHS[1][0] + 1] = math.nan

    _nemo_dump(tmp_path / "experiment" / "logs", edit)
    (tmp_path / "scratch").mkdir()
    args = [str(tmp_path / "experiment")]
    check("nemo_rl", transcript(capsys, args, tmp_path / "experiment", tmp_path / "scratch"))


def test_megatron_lm_audit_prints_the_committed_transcript(tmp_path: Path, capsys) -> None:
    """The trace alone cannot be placed (no sample, no position): its own rules are checked, exit 0."""
    _megatron_trace(tmp_path / "experiment" / "trace")
    (tmp_path / "scratch").mkdir()
    args = [str(tmp_path / "experiment")]
    check("megatron_lm", transcript(capsys, args, tmp_path / "experiment", tmp_path / "scratch"))


def test_megatron_lm_trace_alone_names_a_broken_rule_and_exits_1(tmp_path: Path, capsys) -> None:
    from harness.cli import main

    def edit(record: dict, micro: int) -> None:
        if (record["step"], record["rank"], record["layer"], micro) == (11, 1, 3, 1):
            record["top_indices"][4] = [E + 2, 0]

    _megatron_trace(tmp_path / "trace", edit)
    assert main(["audit", str(tmp_path / "trace"), "--num-experts", str(E)]) == 1
    out = capsys.readouterr().out
    assert "check_trace         VIOLATED 1 times" in out, out
    assert "ids_valid: step 11 rank 1 decoder layer 3 row" in out and "router_trace_rank1.jsonl:" in out, out
    assert "--trainer-trace" in out.splitlines()[-1], out
