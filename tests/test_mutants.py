"""The bug zoo's self-test: every mutant is killed by the suites, and every benign variant passes them
(the reference passing them is the suites' own default run)."""

from __future__ import annotations

import re

import pytest

from harness.check.mutation import kill_args, run_benign, run_mutant
from harness.mutants import benign
from harness.mutants.registry import MUTANTS, get
from harness.subjects import load_subject

NAMES = [m.name for m in MUTANTS]
SPAWNING = {
    "megatron-replay-drops-scaling-factor",
    "megatron-batch-major",
    "megatron-forward-through-backward",
    "megatron-layer-shift",
    "megatron-pp-other-stage",
    "megatron-unnormalised-gate-weights",
    "megatron-thd-seq-major",
    "megatron-thd-unpadded-boundaries",
    "megatron-vpp-contiguous-chunks",
    "megatron-mtp-router-by-layer-number",
}
"""Megatron mutants whose named kill spawns a Megatron rank (~10 s each): behind ``slow``. The
probe-only one (RouterReplay actions on stale instances, whose own calls all succeed) proves the
Megatron suite's kill in the default run."""

BENIGN_NAMES = [b.name for b in benign.BENIGN]
QUICK_KEYWORD = {
    "errors-in-own-words": "bad_",
    "constructor-patch-driver": (
        "test_replay and reference and not bf16 and (two_controlled or disarmed or part_built or deep_model"
        " or (softmax_topk and not softmax_topk_fp32))"
    ),
    "constructor-patch-driver-by-tag": (
        "test_replay and reference and not bf16 and (two_controlled or disarmed or part_built or deep_model"
        " or (softmax_topk and not softmax_topk_fp32))"
    ),
    "one-forward-in-flight": "test_recompute",
    "un-undoable-driver-beside-a-bare-callable": "test_hf and qwen2_moe or test_r2",
    "un-undoable-driver-beside-megatron": (
        "test_replay and whatever_the_live_logits and (hf-qwen2_moe-fp32 or megatron-softmax)"
    ),
    "splice-into-buffer": "test_splice",
    "megatron-logs-replayed-weights": (
        "test_replay and megatron-softmax and (whatever_the_live_logits or bit_exact)"
    ),
    "splice-payload-tails": "test_splice",
    "megatron-routers-by-own-layer-number": "test_replay and megatron-softmax",
    "routers-by-module-path": "test_replay and reference and not bf16",
    "targets-moved-through-fp32": "test_replay and reference and (wide or whatever_the_live)",
    "replay-at-the-expert-top-k": "test_replay and reference-sigmoid_grouped",
    "record-by-own-group-limited-top-k": "test_replay and reference-sigmoid_grouped",
}
"""Variants that take ~30 s each over every suite of their capabilities run, in the default run, the
part of those suites their choice meets: the bad-input cases, the reference replay cases that a
process-global registry meets (two models, disarm, a part built before the patch, a deep model) with
one router family, the recompute check, a transformers test that patches the un-undoable driver
followed by a reference test that must not be refused, and the simulated-engine splice cases (the
repeated-row seams among them) without the real-engine coverage run. ``-m slow`` and
``rrh mutants`` run them all."""
NOT_DISTRIBUTED = ["-m", "not slow and not gpu and not distributed"]


def _select_named_layout(killed_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Select the Megatron layout a mutant's killer names in brackets: ``slow`` layouts (the only
    ones with TP > 1 on packed input, say) run only when selected by name."""
    layout = re.fullmatch(r"test_megatron\.py::\w+\[(.+)\]", killed_by)
    if layout:
        monkeypatch.setenv("RRH_MEGATRON_LAYOUT", layout.group(1))


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SPAWNING else n for n in NAMES]
)
def test_mutant_is_killed_by_its_named_invariant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The invariant a mutant names (``Mutant.killed_by``) fails on it: a few seconds per mutant. A
    Megatron layout named in brackets is selected by name (``slow`` layouts run only when selected)."""
    mutant = get(name)
    _select_named_layout(mutant.killed_by, monkeypatch)
    outcome = run_mutant(mutant, named_killer_only=True, extra=kill_args(None))
    assert outcome.tests_run > 0, f"{name}: no test matches suites/{mutant.killed_by}"
    assert outcome.killed, f"{name} ({outcome.bug_class}) survived suites/{mutant.killed_by}"


@pytest.mark.parametrize("name", BENIGN_NAMES)
def test_benign_variant_raises_no_false_alarm(name: str) -> None:
    """A correct implementation that chooses differently passes every (single-process) suite of its
    capabilities: a failure here is a false alarm of the suites."""
    outcome = run_benign(
        benign.get(name),
        extra=["--hypothesis-profile", "benign-quick", *NOT_DISTRIBUTED],
        keyword=QUICK_KEYWORD.get(name),
    )
    assert outcome.tests_run > 0, f"{name}: no test exercised {outcome.capabilities}"
    assert outcome.passed, f"{name}: false alarms: {'; '.join(outcome.false_alarms)[:600]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", BENIGN_NAMES)
def test_benign_variant_passes_every_suite_at_the_full_example_budget(name: str) -> None:
    outcome = run_benign(benign.get(name), extra=kill_args(None))
    assert outcome.passed, f"{name}: false alarms: {'; '.join(outcome.false_alarms)[:600]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_mutant_is_killed_under_five_seeds(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kill does not depend on luck: under five different hypothesis seeds, the suites of the
    mutant's capability (all of them, not only its named invariant, on the Megatron layout it names)
    find the bug."""
    _select_named_layout(get(name).killed_by, monkeypatch)
    for seed in range(1, 6):
        outcome = run_mutant(get(name), first_kill_only=True, extra=kill_args(seed))
        assert outcome.killed, f"{name} survived under --hypothesis-seed={seed}"


def test_every_facts_bug_class_has_a_mutant() -> None:
    classes = {m.bug_class for m in MUTANTS}
    expected = {
        "duplication on resume", "policy-version mixing", "[-0:] slice", "lost on cancel", "truncation",
        "multi-turn staleness", "dense-layer shift", "PP/VPP offsets", "silent no-op", "prompt rows native",
        "filler replayed", "dtype wrap", "CP layout", "FP8 padding", "wrong gate rule", "physical ids",
        "all-zero capture", "layer axis convention", "recompute drift", "R2/R3 config",
        "turn-boundary placeholder", "group-limited routing", "FIFO leak across passes",
        "R2 without a fresh recording", "router statistics over wrong rows",
        "engine-omitted cached prefix", "routes detached from their sample",
        "MTP routers", "speculative decoding rows", "chunk offset lost in capture",
        "prefill/decode disaggregation", "stale prefix routes at the engine",
    }  # fmt: skip
    assert expected <= classes, f"bug classes without a mutant: {sorted(expected - classes)}"


def test_each_mutant_replaces_exactly_one_capability_and_loads_by_spec() -> None:
    for mutant in MUTANTS:
        assert mutant.capability
        assert load_subject(mutant.subject_spec) is mutant.subject
    for variant in benign.BENIGN:
        assert variant.capabilities
        assert load_subject(variant.subject_spec) is variant.subject
