"""Faults every sample shares (``harness.audit.checks.shared``): a one-row shift of capture and a MoE
layer copied from the previous one, planted in every sample of a step, named from the run with a
chance model; the same run clean, and a run whose routing repeats often by nature, name nothing.

Also the per-sample evidence each needs, shown to be required: a shift in one opening only, and a
layer copied in one sample only, stay unnamed (one piece of evidence is what chance gives). Last,
the importers' row rule that hid a swap of two group members one token apart: a real row for the
last token is kept (and named by coverage) unless the response fills its budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harness.audit.checks.shared import tail_bound
from harness.audit.execution.executors import audit_run
from harness.audit.layout.schema import SampleRecord
from harness.audit.layout.writer import RunWriter
from harness.audit.result.audit_result import AuditResult
from harness.audit.synthetic.generate import RunShape, generate_run
from tests.test_audit_import_frameworks import Sample
from tests.test_audit_planted_faults import WRITERS
from tests.test_audit_planted_faults import _audit as planted_audit

SHAPE = RunShape(
    steps=2, prompts=4, group_size=4, prompt_len=12, response_len=16, layers=6, experts=32, top_k=4
)


def _by_name(result: AuditResult) -> dict[str, object]:
    return {r.name: r for r in result.invariants}


def _audit(tmp_path: Path, faults: tuple[str, ...]) -> AuditResult:
    planted = generate_run(tmp_path / "run", SHAPE, seed=3, faults=faults)
    assert {f.kind for f in planted} == set(faults)
    return audit_run(tmp_path / "run", executor="serial")


def test_a_clean_run_has_nothing_suspect(tmp_path: Path) -> None:
    by_name = _by_name(_audit(tmp_path, ()))
    for name in ("repeated_rows", "copied_layers"):
        assert by_name[name].status == "checked" and by_name[name].violated == 0, by_name[name].line()


def test_the_one_row_shift_of_every_sample_is_named(tmp_path: Path) -> None:
    result = _audit(tmp_path, ("shared_row_shift",))
    repeated = _by_name(result)["repeated_rows"]
    assert repeated.status == "suspect", repeated.line()
    assert repeated.violated == SHAPE.prompts * SHAPE.group_size  # every sample of the last step
    first = repeated.offenders[0]
    assert first["step"] == SHAPE.steps - 1 and first["row"] == 1
    assert "one-row shift" in first["actual"] and "4 of 8 prompt openings" in first["actual"]
    assert not result.violated  # a suspicion: no strict invariant broken, exit 0
    assert _by_name(result)["copied_layers"].violated == 0


def test_a_layer_copied_in_every_sample_is_named(tmp_path: Path) -> None:
    result = _audit(tmp_path, ("shared_layer_copy",))
    copied = _by_name(result)["copied_layers"]
    assert copied.status == "suspect", copied.line()
    assert copied.violated == SHAPE.prompts * SHAPE.group_size
    assert {o["layer"] for o in copied.offenders} == {2}
    assert "equals layer 1's" in copied.offenders[0]["actual"]
    assert _by_name(result)["repeated_rows"].violated == 0


def _write(directory: Path, samples: list[tuple[str, np.ndarray, np.ndarray, int]]) -> None:
    """Samples ``(key, tokens, engine routes [P+R−1, L, K], prompt length)`` of one step, all MoE."""
    with RunWriter(directory) as writer:
        for key, tokens, routes, p in samples:
            writer.write(
                SampleRecord(
                    step=0, sample_key=key, group_key=None, prompt_len=p, response_len=len(tokens) - p,
                    tokens=tokens, num_experts=8, top_k=2, num_layers=routes.shape[1],
                    moe_layers=range(routes.shape[1]), source="test", engine_routes=routes,
                )
            )  # fmt: skip


def _routes(rng: np.random.Generator, rows: int, layers: int, experts: int = 8) -> np.ndarray:
    first = rng.integers(0, experts, size=(rows, layers))
    second = (first + rng.integers(1, experts, size=first.shape)) % experts
    return np.stack([first, second], axis=-1).astype(np.uint8)


def test_one_piece_of_evidence_is_not_enough(tmp_path: Path) -> None:
    """One sample with its layer 1 copied and one opening repeated: what chance gives a run now and
    then, so neither is named; the same copy in eight samples is."""
    rng = np.random.default_rng(5)
    samples = []
    for i in range(8):
        tokens = rng.integers(100, 30000, size=20)
        routes = _routes(rng, 19, 3)
        if i == 0:
            routes[:, 1] = routes[:, 0]
            routes[1] = routes[0]
        samples.append((f"s{i}", tokens, routes, 6))
    _write(tmp_path / "one", samples)
    by_name = _by_name(audit_run(tmp_path / "one", executor="serial"))
    assert by_name["copied_layers"].violated == 0 and by_name["repeated_rows"].violated == 0
    for _, _, routes, _ in samples:
        routes[:, 1] = routes[:, 0]
    _write(tmp_path / "all", samples)
    assert _by_name(audit_run(tmp_path / "all", executor="serial"))["copied_layers"].violated == 8


def test_routing_that_repeats_by_nature_names_nothing(tmp_path: Path) -> None:
    """Two experts of four, top-2 over two layers: every row is one of six sets per layer, so
    adjacent rows and the two layers coincide often. The chance model sees that rate in the run's
    own rows and names neither the many repeated openings nor the many samples with equal layers."""
    rng = np.random.default_rng(11)
    samples = []
    for i in range(64):
        tokens = rng.integers(100, 30000, size=5)
        samples.append((f"s{i}", tokens, _routes(rng, 4, 2, experts=4), 2))
    _write(tmp_path / "low", samples)
    by_name = _by_name(audit_run(tmp_path / "low", executor="serial"))
    assert by_name["repeated_rows"].violated == 0 and by_name["copied_layers"].violated == 0


@pytest.mark.parametrize("probabilities", [[0.01] * 8, [0.2, 0.05, 0.5, 0.01, 0.3], [1e-4] * 40])
def test_the_chernoff_bound_is_never_below_the_exact_tail(probabilities: list[float]) -> None:
    """The bound the detectors use holds: at least the exact P(X ≥ x) of a sum of independent
    indicators with these probabilities (computed by convolution), for every x."""
    exact = np.array([1.0])
    for q in probabilities:
        exact = np.convolve(exact, [1 - q, q])
    tails = exact[::-1].cumsum()[::-1]
    mean = sum(probabilities)
    for found in range(len(tails)):
        assert tail_bound(mean, found) >= tails[found] * (1 - 1e-9), (found, tails[found])
    assert tail_bound(0.0, 2) == 0.0 and tail_bound(1.0, 1) == 1.0


def _framework_rollout(step: int) -> list[Sample]:
    """Eight GRPO groups of two samples (members share their prompt's tokens and rows), 16 experts
    top-2 on MoE layers 1-3 (layer 0 dense), each payload the ``P + R − 1`` rows of its positions."""
    rng = np.random.default_rng([7, step])

    def routes(rows: int) -> np.ndarray:
        out = np.zeros((rows, 4, 2), np.int32)
        first = rng.integers(0, 16, size=(rows, 3))
        out[:, 1:, 0], out[:, 1:, 1] = first, (first + rng.integers(1, 16, size=first.shape)) % 16
        return out

    samples = []
    for group in range(8):
        p = int(rng.integers(8, 13))
        prompt, shared = rng.integers(2, 1000, size=p), routes(p)
        for _ in range(2):
            r = int(rng.integers(24, 33))
            logprobs = -rng.uniform(0.05, 2.0, size=r).astype(np.float32)
            own = np.concatenate([shared, routes(r - 1)])
            samples.append(Sample(group, prompt, rng.integers(2, 1000, size=r), own, logprobs))
    return samples


def _shift(s: Sample) -> None:
    s.routes = np.concatenate([s.routes[:1], s.routes[:-1]])


def _copy(s: Sample) -> None:
    s.routes[:, 2] = s.routes[:, 1]


@pytest.mark.parametrize("how", sorted(WRITERS), ids=["-".join(k) for k in sorted(WRITERS)])
@pytest.mark.parametrize(
    ("plant", "named"),
    [(None, None), (_shift, "repeated_rows"), (_copy, "copied_layers")],
    ids=["clean", "shift", "copy"],
)
def test_a_fault_every_sample_shares_in_a_frameworks_dump(
    how: tuple[str, str], plant: object, named: str | None, tmp_path: Path
) -> None:
    """Planted in every sample of step 1 of a verl, SkyRL or slime dump (written by the release's
    own code where it is installed): named by its detector, in every sample of that step and no
    other, and nothing strict; the clean dump names nothing."""
    framework, _ = how
    steps = {step: _framework_rollout(step) for step in (1, 2)}
    if plant is not None:
        for s in steps[1]:
            plant(s)  # type: ignore[operator]
    WRITERS[how](tmp_path / "dump", steps)
    result = planted_audit(framework, tmp_path / "dump", tmp_path / "run", 16, True, [], [])
    by_name = _by_name(result)
    assert not result.violated, [r.line() for r in result.violated]
    for name in ("repeated_rows", "copied_layers"):
        found = by_name[name]
        if name != named:
            assert found.violated == 0, found.line()
            continue
        assert found.status == "suspect" and found.violated == len(steps[1]), found.line()
        assert {o["step"] for o in found.offenders} == {1}, found.offenders


@pytest.mark.parametrize("how", [("verl", "synthetic"), ("skyrl", "synthetic")], ids=["verl", "skyrl"])
def test_a_swap_of_two_members_one_token_apart_is_named(how: tuple[str, str], tmp_path: Path) -> None:
    """Two members of a group whose responses differ by one token, their payloads swapped: in a
    zero-filled padded dump the longer one's missing last row reads as not captured, but the shorter
    one now holds a real row for its last token while its response ended before the budget, which
    §3.1 does not allow: coverage names it (it used to be dropped on import)."""
    steps = {step: _framework_rollout(step) for step in (1, 2)}
    a, b = steps[1][2], steps[1][3]  # the two members of group 1
    b.response = np.concatenate([a.response, b.response[:1]])  # b: a's response and one token more
    b.logprobs = np.concatenate([a.logprobs, b.logprobs[:1]])
    b.routes = np.concatenate([a.routes, b.routes[-1:]])  # its P + R_b − 1 rows
    a.routes, b.routes = b.routes, a.routes  # the swap: a gets P + R_a rows, b gets P + R_b − 2
    WRITERS[how](tmp_path / "dump", steps)
    result = planted_audit(how[0], tmp_path / "dump", tmp_path / "run", 16, True, [], [])
    coverage = _by_name(result)["coverage"]
    assert coverage.status == "violated" and coverage.violated == 1, coverage.line()
    first = coverage.offenders[0]
    assert (first["step"], first["sample_key"], first["row"]) == (1, "2", a.length - 1), first
