"""``rrh run`` + ``rrh audit`` on real vLLM (CPU build, in-process engine core): the tap's invariants
on a real RL loop — groups per prompt, a partial rollout resumed after a weight push, a multi-turn
episode, bf16 — with the correct subject and with broken ones, each named at step, sample, row and
layer. Runs in ``tox -e vllm-cpu`` (markers ``gpu`` and ``vllm``: skipped, naming why, where vLLM
cannot start; a failure under ``RRH_REQUIRE_ENGINES=vllm``)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from harness.audit import audit_run
from harness.run.loop import RunConfig, run_loop

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SMALL = {"steps": 2, "prompts": 1, "group": 2, "response_len": 10}
LAST_MOE_LAYER = 3
"""The engine checkpoint has four decoder layers, the first dense: MoE layers 1, 2, 3."""


def _audit(tmp_path: Path, name: str, **settings: Any) -> Any:
    run = tmp_path / name
    summary = run_loop(run, RunConfig(**{**SMALL, **settings}), log=lambda line: None)
    result = audit_run(run, executor="serial")
    print(f"rrh run {name}: {summary['seconds']:.1f}s", *result.lines(), sep="\n")
    assert not result.input_errors and not result.notes, (result.input_errors, result.notes)
    return result


def _by_name(result: Any) -> dict[str, Any]:
    return {r.name: r for r in result.invariants}


def test_r3_replays_the_engines_routes_exactly_and_no_strict_invariant_fails(tmp_path: Path) -> None:
    result = _audit(tmp_path, "r3", replay="R3")
    found = _by_name(result)
    assert not result.violated, [r.line() for r in result.violated]
    for name in ("coverage", "ids_valid", "tokens_match", "replay_fidelity", "splice_consistency"):
        assert found[name].status == "checked", found[name].line()
    assert [layer["disagreement"] for layer in result.layers] == [0.0] * 3
    assert all(step["tokens_flipped"] == 0 for step in result.steps), result.steps


def test_without_replay_the_live_routes_differ_and_flipped_tokens_carry_more_gap(tmp_path: Path) -> None:
    result = _audit(tmp_path, "none", replay="none")
    assert not result.violated, [r.line() for r in result.violated]
    assert all(layer["disagreement"] > 0 for layer in result.layers), result.layers
    flipped = [s["mean_abs_diff_flipped"] for s in result.steps if s["tokens_flipped"]]
    agreed = [s["mean_abs_diff_agreed"] for s in result.steps if s["tokens_flipped"]]
    assert flipped and max(flipped) > max(agreed), result.steps


def test_replay_doing_nothing_on_one_layer_is_named_at_that_layer(tmp_path: Path) -> None:
    result = _audit(tmp_path, "skip", replay="R3", subject="harness.mutants.registry:hf-one-layer-unreplayed")
    fidelity = _by_name(result)["replay_fidelity"]
    assert fidelity.status == "violated", fidelity.line()
    assert {o["layer"] for o in fidelity.offenders} == {LAST_MOE_LAYER}
    first = fidelity.offenders[0]
    assert first["row"] is not None and first["sample_key"].startswith(("s0-", "s1-"))


def test_a_splice_keeping_the_latest_payload_is_named_on_the_resumed_sample(tmp_path: Path) -> None:
    result = _audit(tmp_path, "latest", replay="R3", splice="latest")
    splice = _by_name(result)["splice_consistency"]
    assert splice.status == "violated", splice.line()
    assert {o["sample_key"] for o in splice.offenders} & {"s0-partial", "s0-turns", "s1-turns"}
    assert all("attempt 0" in o["expected"] for o in splice.offenders)


def test_r2_update_pass_dispatches_what_the_old_logprob_pass_recorded(tmp_path: Path) -> None:
    result = _audit(tmp_path, "r2", replay="R2")
    fidelity = _by_name(result)["replay_fidelity"]
    assert not result.violated, [r.line() for r in result.violated]
    assert fidelity.status == "checked", fidelity.line()


def test_r2_update_pass_rerouting_one_layer_is_named_at_that_layer(tmp_path: Path) -> None:
    """The second mini-batch's update pass runs after an Adam step: a layer the driver leaves
    routing natively no longer gives the recorded experts there."""
    result = _audit(
        tmp_path, "r2-skip", replay="R2", subject="harness.mutants.registry:hf-one-layer-unreplayed"
    )
    fidelity = _by_name(result)["replay_fidelity"]
    assert fidelity.status == "violated", fidelity.line()
    assert {o["layer"] for o in fidelity.offenders} == {LAST_MOE_LAYER}
    first = fidelity.offenders[0]
    assert first["row"] is not None and "recorded" in first["expected"], first


VERL = "harness.subjects.frameworks.verl:VERL_0_9_1"
"""verl 0.9.1 from PyPI, beside vLLM at the end of ``tox -e vllm-cpu`` (``ci/install_framework.sh``)."""


def _require_verl() -> None:
    """Skip naming why where verl is not installed; a failure under ``RRH_REQUIRE_ENGINES=…,verl``
    (the tox env's run after it installs verl)."""
    if importlib.util.find_spec("verl") is not None:
        return
    why = ("verl is not installed beside vLLM (tox -e vllm-cpu installs verl 0.9.1 at its end: "
           "ci/install_framework.sh verl-0.9.1)")  # fmt: skip
    if "verl" in os.environ.get("RRH_REQUIRE_ENGINES", "").split(","):
        pytest.fail(f"{why} (RRH_REQUIRE_ENGINES={os.environ['RRH_REQUIRE_ENGINES']})")
    pytest.skip(why)


def test_verl_veomni_driver_on_a_dense_first_model_replays_each_layer_a_layer_late(tmp_path: Path) -> None:
    """verl 0.9.1's VeOmni driver numbers MoE layers densely from the first decoder layer: on this
    dense-first checkpoint MoE layer l gets the targets of layer l − 1 (FACTS: verl's VeOmni)."""
    _require_verl()
    result = _audit(tmp_path, "verl", replay="R3", subject=VERL)
    fidelity = _by_name(result)["replay_fidelity"]
    assert fidelity.status == "violated", fidelity.line()
    first = fidelity.offenders[0]
    assert first["row"] is not None and first["layer"] in (1, 2, LAST_MOE_LAYER), first
    shifted = [layer["disagreement"] for layer in result.layers][1:]
    assert min(shifted) > 0.9, result.layers  # layers 2 and 3 take the previous layer's targets


def test_two_ranks_with_context_parallel_shards_reassemble_every_sample(tmp_path: Path) -> None:
    result = _audit(tmp_path, "cp", replay="R3", steps=1, ranks=2, split="cp")
    union = _by_name(result)["shard_union"]
    assert not result.violated, [r.line() for r in result.violated]
    assert union.status == "checked" and "no violation" in union.line(), union.line()


def test_a_sequence_parallel_split_holding_boundary_rows_twice_is_named(tmp_path: Path) -> None:
    result = _audit(tmp_path, "halo", replay="R3", steps=1, ranks=2, split="sp-halo")
    union = _by_name(result)["shard_union"]
    assert union.status == "violated", union.line()
    first = union.offenders[0]
    assert first["step"] == 0 and first["row"] is not None
    assert "claimed 2 times (ranks 0 and 1)" in first["actual"], first


def test_rrh_audit_follows_a_real_rrh_run_as_it_trains_and_ends_as_the_one_shot_audit(tmp_path: Path) -> None:
    """``rrh audit RUN --follow`` started before ``rrh run`` (vLLM rollouts, the transformers trainer,
    the tap): every step is reported once every rank's manifest has moved past it, the follow ends at
    ``--until-step``, and its result equals the one-shot audit of the finished run. The run's step
    lines and the follow's are printed with the second each arrived (``-rP``; measured, not asserted:
    2026-12-03 on 2 cores, vLLM's steps 1.5 s apart, each reported within 0.5 s of the run's own line,
    and 2–6 s after it while another job shared the cores)."""
    import json
    import subprocess
    import threading
    import time

    from tests.test_audit_follow import RRH as rrh
    from tests.test_audit_follow import same_result

    run, steps = tmp_path / "run", 3
    follow = subprocess.Popen(
        [*rrh, "audit", str(run), "--follow", "--until-step", str(steps - 1), "--poll", "0.2",
         "--idle", "600", "--json", str(tmp_path / "follow.json"), "--no-progress"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    start, seen = time.monotonic(), []

    def read(process: subprocess.Popen[str], who: str) -> None:
        assert process.stdout is not None
        seen.extend((time.monotonic() - start, who, line.rstrip("\n")) for line in process.stdout)

    trainer = subprocess.Popen(
        [*rrh, "run", str(run), "--steps", str(steps), "--prompts", "1", "--group", "2",
         "--response-len", "10"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    readers = [threading.Thread(target=read, args=(p, w), daemon=True) for p, w in ((follow, "audit"),
               (trainer, "run"))]  # fmt: skip
    for reader in readers:
        reader.start()
    code = trainer.wait(900)
    if code:
        follow.kill()  # it would wait --idle for a run that stopped
    follow.wait(120)
    for reader in readers:
        reader.join(10)
    print(*(f"{at:6.1f}s  {who:5}  {line}" for at, who, line in sorted(seen)), sep="\n")
    assert code == 0, "rrh run failed (its output is above)"
    assert follow.returncode == 0, seen
    step_lines = [line for _, who, line in seen if who == "audit" and line.startswith("step ")]
    assert [int(line.split()[1].rstrip(":")) for line in step_lines] == list(range(steps)), seen
    assert "0 violating samples" in step_lines[-1], step_lines
    once = subprocess.run(
        [*rrh, "audit", str(run), "--json", str(tmp_path / "once.json"), "--executor", "serial"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert once.returncode == 0, once.stdout + once.stderr
    same_result(*(json.loads((tmp_path / name).read_text()) for name in ("follow.json", "once.json")))
