"""``rrh gate``: baseline documents, the comparison, atomic writes, and the gate on reference and hf."""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness import atomic, cli
from harness.cli import gate as gate_command
from harness.gate import baseline as bl
from harness.gate import run as gate
from harness.gate.adapters import (
    ADAPTERS,
    ENGINES,
    EngineAdapter,
    Observation,
    ObservationError,
    Suites,
    UnknownEngine,
    adapter,
)
from harness.gate.adapters.hf import HFAdapter
from harness.gate.compare import compare as gate_compare

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "fixtures" / "baselines"


def _doc(**changes: Any) -> dict[str, Any]:
    doc = bl.new_baseline(
        "vllm",
        "0.22.0",
        convention={"dtype": "uint8", "row_rule": "prompt + generated − 1", "layer_axis": "decoder"},
        invariants={
            "test_a.py::test_one": "passed",
            "test_a.py::test_two": "failed",
            "test_b.py::test_x": "skipped",
        },
        metrics={
            "trainer.disagreement": bl.metric(0.04, 0.02, "lower"),
            "lab.no_replay.disagreement": bl.metric(0.025, 0.01, "equal"),
            "engine.same_tokens": bl.metric(1.0, 0.0, "higher"),
        },
        observations={"families": {"qwen3_moe": {"returns": "tuple[3]"}}},
    )
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        target = doc
        for key in path:
            target = target[key]
        target[last] = value
    return doc


# --------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------


def test_identical_documents_pass() -> None:
    report = gate_compare(_doc(), _doc())
    assert report.ok and not report.notes, report.format()


def test_a_new_engine_version_alone_is_a_note() -> None:
    report = gate_compare(_doc(), _doc(version="0.23.0"))
    assert report.ok, report.format()
    assert report.notes == ["version: 0.22.0 → 0.23.0"]


def test_a_convention_change_is_a_regression_with_a_readable_diff() -> None:
    observed = _doc(version="0.23.0")
    observed["convention"]["dtype"] = "int32"
    report = gate_compare(_doc(), observed)
    assert not report.ok
    assert report.regressions == [
        'convention: Value of convention[\'dtype\'] changed from "uint8" to "int32".'
    ]


def test_metric_worse_than_its_tolerance_names_value_and_expectation() -> None:
    observed = _doc()
    observed["metrics"]["trainer.disagreement"]["value"] = 0.07
    observed["metrics"]["lab.no_replay.disagreement"]["value"] = 0.01
    observed["metrics"]["engine.same_tokens"]["value"] = 0.0
    report = gate_compare(_doc(), observed)
    assert sorted(report.regressions) == [
        "metrics.engine.same_tokens: value 0, expected at least 1.0 − 0.0",
        "metrics.lab.no_replay.disagreement: value 0.01, expected 0.025 ± 0.01",
        "metrics.trainer.disagreement: value 0.07, expected at most 0.04 + 0.02",
    ], report.format()


def test_metric_within_tolerance_or_better_is_a_note() -> None:
    observed = _doc()
    observed["metrics"]["trainer.disagreement"]["value"] = 0.001  # better
    observed["metrics"]["lab.no_replay.disagreement"]["value"] = 0.03  # within ± 0.01
    report = gate_compare(_doc(), observed)
    assert report.ok, report.format()
    assert len(report.notes) == 2


def test_invariant_outcomes() -> None:
    observed = _doc()
    observed["invariants"] = {
        "test_a.py::test_one": "skipped",  # passed → skipped: coverage lost
        "test_a.py::test_two": "passed",  # failed → passed: a note
        "test_c.py::test_new": "failed",  # new and failing
    }
    report = gate_compare(_doc(), observed)
    assert "invariants[test_a.py::test_one]: skipped, expected passed" in report.regressions
    assert "invariants[test_c.py::test_new]: new test, failed, expected passed" in report.regressions
    assert "invariants[test_a.py::test_two]: failed → passed" in report.notes
    assert "invariants[test_b.py::test_x]: no longer collected (was skipped)" in report.notes
    observed["invariants"] = {}
    assert (
        "invariants[test_a.py::test_one]: not run, expected passed"
        in gate_compare(_doc(), observed).regressions
    )


def test_a_missing_metric_and_another_engine_are_regressions() -> None:
    observed = _doc()
    del observed["metrics"]["trainer.disagreement"]
    assert gate_compare(_doc(), observed).regressions == [
        "metrics.trainer.disagreement: not measured, expected 0.04"
    ]
    assert "wrong baseline file" in gate_compare(_doc(), _doc(engine="sglang")).regressions[0]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "format: expected 'rrh.gate_baseline'"),
        ({"format_version": 2}, "format_version: expected 1, got 2"),
        ({"invariants__t": "crashed"}, r"invariants\['t'\]: expected one of"),
        (
            {"metrics__m": {"value": 1.0, "tolerance": -1, "better": "lower"}},
            r"metrics\['m'\].tolerance: expected a finite non-negative",
        ),
        (
            {"metrics__m": {"value": 1.0, "tolerance": 99999999999999999999, "better": "lower"}},
            r"metrics\['m'\].tolerance: expected at most 100.0 \(MAX_TOLERANCE\), got 99999999999999999999$",
        ),
        (
            {"metrics__lab.r3.disagreement": {"value": 0.0, "tolerance": 1.5, "better": "lower"}},
            r"metrics\['lab.r3.disagreement'\].tolerance: expected at most 1.0 \(a fraction in \[0, 1\]\)",
        ),
        (
            {"metrics__m": {"value": 1.0, "tolerance": 0, "better": "up"}},
            r"metrics\['m'\].better: expected one of",
        ),
        ({"convention": []}, "convention: expected an object"),
    ],
)
def test_malformed_baselines_name_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(bl.BaselineError, match=message):
        bl.validate_baseline(_doc(**change))


def test_a_20_digit_tolerance_is_refused_on_load_and_by_metric(tmp_path: Path) -> None:
    """Finite, but as good as Infinity at switching the gate off: refused in the file and in ``metric``."""
    path = tmp_path / "baseline.json"
    huge = {"value": 0.5, "tolerance": 99999999999999999999, "better": "lower"}
    path.write_text(json.dumps(_doc(metrics__m=huge)))
    assert '"tolerance": 99999999999999999999' in path.read_text()
    with pytest.raises(bl.BaselineError, match=r"tolerance: expected at most 100.0 \(MAX_TOLERANCE\)"):
        bl.load_baseline(path)
    with pytest.raises(bl.BaselineError, match=r"metric.tolerance: expected at most MAX_TOLERANCE=100.0"):
        bl.metric(0.5, 10**20, "lower")
    assert bl.metric(0.5, 100, "lower")["tolerance"] == 100.0


def test_committed_baselines_tolerances_fit_their_metrics() -> None:
    paths = sorted(BASELINES.glob("*.json"))
    assert paths
    for path in paths:
        for name, entry in bl.load_baseline(path)["metrics"].items():
            assert entry["tolerance"] <= bl.max_tolerance(name), (path.name, name)


# --------------------------------------------------------------------------------------------
# files: atomic writes, the command
# --------------------------------------------------------------------------------------------


def test_save_is_atomic_and_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "baselines" / "vllm.json"
    bl.save_baseline(_doc(), path)
    assert bl.load_baseline(path) == _doc()
    before = path.read_bytes()

    def broken_fsync(fd: int) -> None:  # the temporary file is written, then the disk fails
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        bl.save_baseline(_doc(version="9"), path)
    assert path.read_bytes() == before, "a failed write changed the baseline"
    assert os.listdir(path.parent) == ["vllm.json"], f"left behind: {os.listdir(path.parent)}"


def test_an_undefined_metric_is_null_with_its_reason_and_a_bare_nan_is_refused() -> None:
    entry = bl.metric(float("nan"), 0.1, undefined="no route flipped")
    assert entry["value"] is None and entry["undefined"] == "no route flipped"
    json.dumps(entry, allow_nan=False)
    with pytest.raises(bl.BaselineError, match="NaN with no reason"):
        bl.metric(float("nan"), 0.1)
    with pytest.raises(bl.BaselineError, match=r"metrics\['m'\].undefined: expected why the value is null"):
        bl.validate_baseline(_doc(metrics__m={"value": None, "tolerance": 0.1, "better": "lower"}))
    undefined = _doc(metrics__m=entry)
    assert gate_compare(undefined, undefined).ok
    defined = _doc(metrics__m=bl.metric(0.5, 0.1))
    assert gate_compare(defined, undefined).regressions == [
        "metrics.m: value None, expected 0.5 ± 0.1 (undefined: no route flipped)"
    ]


def test_run_gate_update_then_compare_then_regress(tmp_path: Path) -> None:
    path = tmp_path / "vllm.json"
    out = io.StringIO()
    passing = _doc()
    passing["invariants"] = {k: "passed" for k in passing["invariants"]}
    assert gate.run_gate("vllm", baseline=path, observed=passing, stream=out) == 2  # no baseline yet
    assert gate.run_gate("vllm", baseline=path, update=True, observed=passing, stream=out) == 0
    assert gate.run_gate("vllm", baseline=path, observed={**passing, "version": "0.23.0"}, stream=out) == 0
    changed = copy.deepcopy(passing)
    changed["convention"]["layer_axis"] = "moe_ordinal"
    out = io.StringIO()
    assert gate.run_gate("vllm", baseline=path, observed=changed, stream=out) == 1
    text = out.getvalue()
    assert 'Value of convention[\'layer_axis\'] changed from "decoder" to "moe_ordinal"' in text, text
    assert "rrh gate: FAILED — 1 regression(s)" in text


def test_update_refuses_failing_invariants(tmp_path: Path) -> None:
    doc = _doc()  # test_two failed
    assert (
        gate.run_gate("vllm", baseline=tmp_path / "b.json", update=True, observed=doc, stream=io.StringIO())
        == 1
    )
    assert not (tmp_path / "b.json").exists()


def test_add_parser_registers_rrh_gate() -> None:
    parser = argparse.ArgumentParser(prog="rrh")
    gate_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["gate", "--engine", "hf", "--baseline", "x.json", "--update", "--no-suites"])
    assert (args.engine, args.baseline, args.update, args.no_suites, args.func) == (
        "hf",
        "x.json",
        True,
        True,
        gate_command._cmd_gate,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["gate", "--engine", "tensorrt"])


def test_gate_on_an_engine_that_is_not_here_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.engines import vllm

    if vllm.installed_version() is not None:
        pytest.skip("vLLM is installed here")
    assert cli.main(["gate", "--engine", "vllm", "--baseline", str(BASELINES / "reference.json")]) == 2
    assert "cannot observe vllm" in capsys.readouterr().err


def test_engine_baselines_are_per_release_and_the_newest_at_or_before_is_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm-<version>.json: --update writes the installed version's; a check compares with the newest
    recorded release at or before the installed one (a version sorts as a version, not as text)."""
    for version in ("0.27.1", "0.30.0", "0.9.0"):
        (tmp_path / f"vllm-{version}.json").write_text("{}")
    (tmp_path / "vllm-notaversion.json").write_text("{}")
    monkeypatch.setattr(gate, "baselines_dir", lambda: tmp_path)
    assert gate.default_baseline("vllm", "0.30.0", update=True) == tmp_path / "vllm-0.30.0.json"
    assert gate.default_baseline("vllm", "0.31.0", update=True) == tmp_path / "vllm-0.31.0.json"
    assert gate.default_baseline("vllm", "0.30.0") == tmp_path / "vllm-0.30.0.json"
    assert gate.default_baseline("vllm", "0.29.0") == tmp_path / "vllm-0.27.1.json"
    assert gate.default_baseline("vllm", "0.33.0") == tmp_path / "vllm-0.30.0.json"
    assert gate.default_baseline("vllm", "0.27.1rc1") == tmp_path / "vllm-0.9.0.json"
    assert gate.default_baseline("vllm", "0.8.0") == tmp_path / "vllm-0.8.0.json"  # none: names its own
    assert gate.default_baseline("hf", "5.2.0") == tmp_path / "hf.json"


def test_committed_vllm_baselines_are_real_cpu_observations() -> None:
    paths = sorted(BASELINES.glob("vllm-*.json"))
    assert paths, "no vllm-<version>.json baseline recorded"
    for path in paths:
        doc = bl.load_baseline(path)
        assert path.name == f"vllm-{doc['version']}.json", f"{path.name}: records version {doc['version']}"
        assert doc["convention"]["convention"] == "vllm-0.27" and doc["convention"]["row_rule"] == (
            "prompt + generated − 1"
        )
        assert doc["invariants"] and all(o == "passed" for o in doc["invariants"].values()), path.name


def test_default_baselines_are_versioned_fixtures() -> None:
    assert gate.default_baseline("hf") == BASELINES / "hf.json"
    for engine in ("reference", "hf"):
        doc = bl.load_baseline(BASELINES / f"{engine}.json")
        assert doc["engine"] == engine and doc["invariants"], f"{engine}.json: no invariants recorded"
        assert all(o != "failed" for o in doc["invariants"].values())


# --------------------------------------------------------------------------------------------
# the gate on this machine: reference and hf
# --------------------------------------------------------------------------------------------


def test_reference_gate_passes_against_its_committed_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    """Convention and mismatch-lab metrics of the reference engine match fixtures/baselines/reference.json."""
    status = cli.main(["gate", "--engine", "reference", "--no-suites"])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["reference", "hf"])
def test_full_gate_passes_against_its_committed_baseline(
    engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole gate (suites, metrics, observations) against the committed baseline."""
    status = cli.main(["gate", "--engine", engine])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err


FAMILIES = ("qwen3_moe", "deepseek_v3", "llama4_text")


@pytest.fixture(scope="module")
def hf_pair() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the committed hf baseline restricted to FAMILIES, a fresh observation of them here)."""
    pytest.importorskip("transformers")
    committed = bl.load_baseline(BASELINES / "hf.json")
    observed = gate.observe(HFAdapter(lab=False, model_types=FAMILIES), suites=False)
    base = copy.deepcopy(committed)
    base["observations"]["families"] = {m: committed["observations"]["families"][m] for m in FAMILIES}
    base["metrics"] = {k: v for k, v in committed["metrics"].items() if k in observed["metrics"]}
    base["invariants"] = {}
    return base, observed


@pytest.mark.hf
def test_hf_families_match_the_committed_baseline(hf_pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    base, observed = hf_pair
    report = gate_compare(base, observed)
    assert report.ok, report.format()
    assert observed["observations"]["families"]["deepseek_v3"]["returns"] == "tuple[3]"


@pytest.mark.hf
def test_hf_router_returning_logits_only_fails_the_gate(
    hf_pair: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """A baseline recorded where DeepSeek-V3's router returned logits only (transformers ≤ 5.12) fails."""
    base, observed = hf_pair
    edited = copy.deepcopy(base)
    edited["observations"]["families"]["deepseek_v3"]["returns"] = "tensor"
    path = tmp_path / "hf.json"
    bl.save_baseline(edited, path)
    out = io.StringIO()
    assert gate.run_gate("hf", baseline=path, observed=observed, suites=False, stream=out) == 1
    assert (
        "observations: Value of observations['families']['deepseek_v3']['returns'] changed from "
        '"tensor" to "tuple[3]".' in out.getvalue()
    ), out.getvalue()


@pytest.mark.hf
def test_hf_weight_rule_change_fails_the_gate(hf_pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """A baseline where Qwen3-MoE matched other rules, or the softmax rule moved other logits, fails."""
    base, observed = hf_pair
    edited = copy.deepcopy(base)
    edited["observations"]["families"]["qwen3_moe"]["bit_exact_rules"] = ["sigmoid_grouped"]
    edited["metrics"]["hf.deepseek_v3.softmax_rule_logit_move"]["value"] = 0.0
    edited["metrics"]["hf.deepseek_v3.softmax_rule_logit_move"]["tolerance"] = 1e-6
    report = gate_compare(edited, observed)
    text = report.format()
    assert "observations['families']['qwen3_moe']['bit_exact_rules']" in text, text
    assert any(
        r.startswith("metrics.hf.deepseek_v3.softmax_rule_logit_move: value") for r in report.regressions
    ), text


# --------------------------------------------------------------------------------------------
# adapters: the protocol, and no failed probe swallowed
# --------------------------------------------------------------------------------------------


def test_every_engine_has_an_adapter_implementing_the_protocol() -> None:
    assert tuple(ADAPTERS) == ENGINES == ("reference", "hf", "vllm", "sglang")
    for name, engine in ADAPTERS.items():
        assert isinstance(engine, EngineAdapter) and engine.name == name
    assert ADAPTERS["vllm"].convention("0.30.0").name == "vllm-0.27"  # type: ignore[union-attr]
    assert ADAPTERS["reference"].convention("0.1.0") is None
    with pytest.raises(UnknownEngine, match="'tensorrt'; expected one of reference, hf, vllm, sglang"):
        adapter("tensorrt")


class _FailingAdapter:
    """An adapter whose probe raises, as a broken engine or a harness bug would."""

    name = "reference"
    suites = Suites("not slow")

    def installed_version(self) -> str:
        return "0.1.0"

    def convention(self, version: str) -> None:
        return None

    def start(self, model: Any) -> Any:
        return model

    def observe(self) -> Observation:
        from harness.gate.adapters.base import observing

        with observing(self.name, "metric lab.r3.disagreement"):
            raise RuntimeError("the lab's model would not build")
        raise AssertionError("unreachable")


def test_a_failing_probe_fails_the_gate_naming_engine_metric_and_cause(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(ADAPTERS, "reference", _FailingAdapter())
    status = cli.main(["gate", "--engine", "reference", "--no-suites"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert (
        "rrh gate: a probe failed: reference: metric lab.r3.disagreement: "
        "RuntimeError: the lab's model would not build" in err
    ), err
    assert "Traceback" not in err


@pytest.mark.hf
def test_a_failing_hf_probe_is_an_error_not_a_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate rule raising a real error (not ``RuleNotApplicable``) used to be skipped silently,
    and the SkyRL rule's logit move left NaN (stored as null): now the first failing probe is named."""
    pytest.importorskip("transformers")
    from harness.conventions import hf_families as families

    def broken_rule(router: Any, logits: Any, ids: Any) -> Any:
        raise RuntimeError("rule broke")

    monkeypatch.setattr(families, "softmax_rule", broken_rule)
    with pytest.raises(ObservationError) as caught:
        HFAdapter(lab=False, model_types=("qwen3_moe",)).observe()
    assert str(caught.value) == "hf: observations.families.qwen3_moe: RuntimeError: rule broke"


def test_a_lab_without_flipped_routes_reports_its_flipped_metrics_undefined() -> None:
    from harness.gate.adapters.base import NO_FLIP, lab_metrics
    from tests.test_report_doc import fake_lab

    defined = lab_metrics("lab", fake_lab()[0])
    assert all(entry["value"] is not None for entry in defined.values()), defined
    unflipped = fake_lab(flips=False)[0]
    assert unflipped.flipped_tokens == 0
    metrics = lab_metrics("lab", unflipped)
    for name in ("lab.r3.mean_abs_gap_flipped", "lab.r3_over_no_replay.mean_abs_gap_flipped"):
        assert metrics[name]["value"] is None and metrics[name]["undefined"] == NO_FLIP
    doc = bl.new_baseline("reference", "0.1.0", convention={}, invariants={}, metrics=metrics)
    out = io.StringIO()
    assert gate.run_gate("reference", baseline=BASELINES / "reference.json", observed=doc, stream=out) == 1
    assert f"metric lab.r3.mean_abs_gap_flipped: undefined: {NO_FLIP}" in out.getvalue()


# --------------------------------------------------------------------------------------------
# figures: what an engine does without promising it
# --------------------------------------------------------------------------------------------

_UNPROMISED = "vllm promises no run-to-run determinism on CPU (FACTS §6)"


def _with_figures(value: float) -> dict[str, Any]:
    doc = _doc()
    doc["figures"] = {"engine.same_tokens_across_runs": bl.figure(value, _UNPROMISED)}
    return bl.validate_baseline(doc)


def test_a_changed_figure_is_a_note_never_a_regression() -> None:
    report = gate_compare(_with_figures(1.0), _with_figures(0.0))
    assert report.ok, report.format()
    assert report.notes == [f"figures.engine.same_tokens_across_runs: 1.0 → 0.0 (not gated: {_UNPROMISED})"]


def test_a_figure_only_one_side_has_is_a_note() -> None:
    report = gate_compare(_doc(), _with_figures(1.0))
    assert report.ok and report.notes == [
        f"figures.engine.same_tokens_across_runs: None → 1.0 (not gated: {_UNPROMISED})"
    ], report.format()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"value": 1.0}, r"figures\['f'\]: expected an object with exactly \['value', 'why'\]"),
        ({"value": None, "why": "x"}, r"figures\['f'\]\.value: expected a finite number"),
        ({"value": 1.0, "why": ""}, r"figures\['f'\]\.why: expected a reason"),
    ],
)
def test_a_malformed_figure_is_refused_naming_the_field(entry: dict[str, Any], message: str) -> None:
    doc = _doc()
    doc["figures"] = {"f": entry}
    with pytest.raises(bl.BaselineError, match=message):
        bl.validate_baseline(doc)
