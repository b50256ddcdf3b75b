"""``rrh audit`` prints only true things: its terminal text, ``--html`` and ``--json`` read as printed.

Each test audits a dump written in a framework's own format (verl's RolloutSkip ``gen_batch.dp``,
SkyRL's training-input pickle, slime's ``rollout_data/{id}.pt``, by the writers of
``tests/test_audit_import_frameworks.py`` and ``tests/test_audit_import_sources.py``: no framework
installed) and reads a line the audit printed, naming what was untrue in it before: a note asking
for a flag that was given, a command that does not exist, a count of temporary files, a dtype that
is not the tensor's, a figure with no tokens behind it, a suspicion dressed as a violation, a label
that is in no file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from harness.cli import main
from tests.test_audit_import_frameworks import (
    _skyrl_dump,
    _skyrl_synthetic,
    _verl_dump,
    _verl_synthetic,
    resumed_twice_skyrl,
)

E = 16
"""The experts of the fixtures' model (``tests/test_audit_import_frameworks.E``)."""


def _dump(name: str, root: Path) -> Path:
    """The faulty two-step dump of ``name`` (``skyrl``, ``verl``) in its framework's format at ``root``."""
    if name == "skyrl":
        _skyrl_dump(root / "export", _skyrl_synthetic, faulty=True)
    else:
        _verl_dump(root / "rollout_dump", _verl_synthetic, faulty=True)
    return root


def _audit(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``rrh audit ARGS`` (serial, no progress bar): exit status, stdout, stderr."""
    capsys.readouterr()
    code = main(["audit", *map(str, args), "--executor", "serial", "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_facts_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RRH_NUM_EXPERTS", raising=False)
    monkeypatch.delenv("RRH_MOE_LAYERS", raising=False)


# --- 1. notes asking for flags that were given -----------------------------------------------------


@pytest.mark.parametrize("framework", ["skyrl", "verl"])
def test_no_note_asks_for_a_model_fact_that_was_given(
    framework: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump(framework, tmp_path / "dump")
    html = tmp_path / "audit.html"
    _, out, _ = _audit(capsys, dump, "--num-experts", E, "--moe-layers", "1-3", "--html", html)
    page = html.read_text()
    for said in ("num_experts is not in the dump", "moe_layers is not in the dump", "give it (--num-experts"):
        assert said not in out, out
        assert said not in page
    # Given only the expert count, the note on the MoE layers (inferred) stays, and only it.
    _, out, _ = _audit(capsys, dump, "--num-experts", E)
    assert "num_experts is not in the dump" not in out, out
    assert f"note: {framework}: moe_layers is not in the dump: without --moe-layers" in out, out


# --- 2. the sources name what really read the dump ---------------------------------------------------


@pytest.mark.parametrize("framework", ["skyrl", "verl"])
def test_the_sources_name_the_importer_that_read_the_dump_and_a_real_command(
    framework: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump(framework, tmp_path / "dump")
    html, report = tmp_path / "audit.html", tmp_path / "audit.json"
    _audit(capsys, dump, "--num-experts", E, "--html", html, "--json", report)
    page, doc = html.read_text(), json.loads(report.read_text())
    for text in (page, json.dumps(doc)):
        assert "rrh import" not in text  # no such command
    [source] = doc["sources"]
    assert f"read by rrh audit's {'SkyRL' if framework == 'skyrl' else 'verl'} importer" in source, source
    assert f"(rrh audit DUMP --from {framework})" in source, source
    assert source.replace("'", "&#x27;") in page


# --- 3. the files counted are the dump's, singular or plural -----------------------------------------


def test_the_files_counted_are_the_dump_files_read_with_the_right_plural(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump("skyrl", tmp_path / "dump")  # two steps: two global_step_{N}_training_input.pkl
    html, report = tmp_path / "audit.html", tmp_path / "audit.json"
    _, out, _ = _audit(capsys, dump, "--num-experts", E, "--html", html, "--json", report)
    head = out.splitlines()[0]
    assert "8 samples of a skyrl dump (2 files of the dump read; imported: " in head, head
    assert "1 files" not in out and "imported: 1 file" not in out, head
    assert "2 files of the dump read · 8 samples · " in html.read_text()
    doc = json.loads(report.read_text())
    assert (doc["dump_files"], doc["files"]) == (2, 1)  # the temporary layout's one file is told apart
    one = dump / "export" / "dumped_data" / "global_step_1_training_input.pkl"
    _, out, _ = _audit(capsys, one, "--num-experts", E)
    assert "skyrl dump (1 file of the dump read; " in out.splitlines()[0], out


# --- 4. a refused dtype is the tensor's own ----------------------------------------------------------


class _BFloat16:
    """A bfloat16 tensor as the dump writers take it (numpy has no bfloat16): its bits, its name."""

    dtype = "bfloat16"

    def __init__(self, values: Any) -> None:
        self.bits = (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        self.shape = self.bits.shape

    def tobytes(self) -> bytes:
        return self.bits.tobytes()

    def __len__(self) -> int:
        return len(self.bits)


def test_a_bfloat16_routes_tensor_is_refused_naming_bfloat16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tests.test_audit_import_frameworks as frameworks

    fields = frameworks._verl_fields

    def bfloat16_routes(*args: Any, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = fields(*args, **kwargs)
        out["routed_experts"] = _BFloat16(out["routed_experts"])
        return out

    monkeypatch.setattr(frameworks, "_verl_fields", bfloat16_routes)
    dump = _dump("verl", tmp_path / "dump")
    code, _, err = _audit(capsys, dump, "--num-experts", E)
    assert code == 2, err
    assert "field 'routed_experts' is bfloat16; expected integer ids" in err, err
    assert "float32" not in err, err


# --- 5. a split that cannot be made, a label said twice ----------------------------------------------


def test_the_gap_split_by_routing_says_it_needs_trainer_routes_when_the_dump_has_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump("skyrl", tmp_path / "dump")  # engine and trainer log-probs, engine routes only
    report = tmp_path / "audit.json"
    _, out, _ = _audit(capsys, dump, "--num-experts", E, "--json", report)
    [line] = [x for x in out.splitlines() if x.startswith("logprob_gap ")]
    assert "no token" not in line, line
    assert "split by whether the routes agreed: not available, the dump has no trainer routes" in line, line
    [gap] = [r for r in json.loads(report.read_text())["invariants"] if r["name"] == "logprob_gap"]
    assert "the dump has no trainer routes" in gap["summary"]


def test_an_all_zero_chart_is_one_sentence_that_names_its_figure_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.audit.synthetic.generate import RunShape, generate_run

    shape = RunShape(steps=2, prompts=2, group_size=3, prompt_len=12, response_len=10, layers=6, experts=32,
                     top_k=4)  # fmt: skip
    generate_run(tmp_path / "run", shape, seed=3)  # clean: every row captured, every route agrees
    html = tmp_path / "audit.html"
    _audit(capsys, tmp_path / "run", "--html", html)
    page = html.read_text()
    assert "<p class=sub>Rows without a captured route per step: 0 in every step.</p>" in page
    assert "rows without a captured route 0" not in page
    assert "<p class=sub>Routing disagreement per MoE layer, whole run: 0 in every MoE layer.</p>" in page


# --- 6. a detector's suspicion is not a broken invariant ---------------------------------------------


def test_a_detector_suspects_in_the_terminal_the_html_and_the_json_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    resumed_twice_skyrl(tmp_path / "dump" / "export")
    html, report = tmp_path / "audit.html", tmp_path / "audit.json"
    code, out, _ = _audit(capsys, tmp_path / "dump", "--num-experts", E, "--html", html, "--json", report)
    [line] = [x for x in out.splitlines() if x.startswith("repeated_rows ")]
    assert line.startswith("repeated_rows       SUSPECT in 1 of 4 samples (a detector's suspicion, not a "
                           "broken invariant); first at step 1 sample 3 row 20"), line  # fmt: skip
    assert "VIOLATED" not in out, out
    assert code == 0, out  # exit 1 is a broken strict invariant (docs/audit.md), never a suspicion
    [found] = [r for r in json.loads(report.read_text())["invariants"] if r["name"] == "repeated_rows"]
    assert (found["kind"], found["status"], found["violated"]) == ("suspicion", "suspect", 1), found
    page = html.read_text()
    assert '<tr class="SUSPECT"><td><span class="badge SUSPECT">suspect</span></td><td>suspicion</td>' in page
    assert '<div class="verdict suspect"><div class="status">SUSPECT</div>' in page
    assert "1 detector(s) suspect a fault (repeated_rows): a suspicion, not a broken invariant" in page
    assert "FAIL" not in page.split("<h2>Invariants</h2>")[1].split("</table>")[0]


def test_a_clean_detector_says_nothing_suspect_and_a_strict_invariant_no_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump("skyrl", tmp_path / "dump")
    _, out, _ = _audit(capsys, dump, "--num-experts", E)
    assert "repeated_rows       checked: 8 samples, nothing suspect" in out, out
    assert "dense_empty         checked: 8 samples, no violation" in out, out


# --- 7. labels that are in the dump: rollout ids, groups by their samples, the worst layer -----------


def test_a_slime_dumps_steps_are_printed_as_rollout_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_audit_import_sources import _slime_dump, _slime_faults

    _slime_dump(tmp_path / "dump", edit=_slime_faults)
    html = tmp_path / "audit.html"
    _, out, _ = _audit(capsys, tmp_path / "dump", "--html", html)
    violated = [x for x in out.splitlines() if " VIOLATED in " in x]
    assert violated and all(" first at rollout id " in x for x in violated), violated
    assert not any(" first at step " in x for x in violated), violated
    page = html.read_text()
    assert "<th>rollout id</th><th>sample</th><th>row</th>" in page
    assert "Rows without a captured route per rollout id" in page


def test_skyrl_groups_are_named_by_their_samples_and_expert_load_names_its_layer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = _dump("skyrl", tmp_path / "dump")
    report = tmp_path / "audit.json"
    _, out, _ = _audit(capsys, dump, "--num-experts", E, "--json", report)
    [prefix] = [x for x in out.splitlines() if x.startswith("prefix_agreement ")]
    assert "as sample 1 of group samples 0-1 holds at this prompt row" in prefix, prefix
    assert "group p0" not in out, out
    [load] = [x for x in out.splitlines() if x.startswith("expert_load ")]
    layers = json.loads(report.read_text())["layers"]
    worst = max(layers, key=lambda r: r["load_max_over_mean"])
    want = f"busiest expert / mean, worst layer {worst['layer']}: {worst['load_max_over_mean']:.2f}"
    assert load == f"expert_load         measured: {want}", load


# --- 8. the --trainer-trace path: no library noise, the real reason a check does not apply -----------


NOISY = """import logging, os, sys, warnings
warnings.warn("torchtitan is not installed", UserWarning)
logging.getLogger("veomni").warning("veomni: flash attention not found")
print("Apex not found: fused kernels off", file=sys.stderr)
print("TE: falling back", flush=True)
os.write(2, b"WARNING: All log messages before absl::InitializeLog() are written to STDERR\\n")
"""
"""What a library's import prints: a warning, a logging record, stderr and stdout, and from C (fd 2)."""


def test_verls_import_noise_is_not_printed_by_the_trace_join(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata
    import sys

    from harness.audit.trace import verl_packing

    if any(name == "verl" or name.startswith("verl.") for name in sys.modules):
        pytest.skip("verl is imported already: its import cannot be watched")
    for name in verl_packing.VERL_MODULES:  # a noisy stand-in of each module the packing imports
        path = tmp_path.joinpath(*name.split("."))
        path.mkdir(parents=True, exist_ok=True)
        (path / "__init__.py").write_text(NOISY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "version", lambda _name: verl_packing.RELEASE)
    try:
        capfd.readouterr()
        verl_packing._require_verl()
        out, err = capfd.readouterr()
        assert (out, err) == ("", ""), (out, err)
        assert all(name in sys.modules for name in verl_packing.VERL_MODULES)
    finally:
        for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
            del sys.modules[name]
    # The noise is swallowed, an error is not: it propagates to be said in one line.
    (tmp_path / "broken.py").write_text(NOISY + "raise ImportError('verl: cannot import name X')\n")
    with pytest.raises(ImportError, match="cannot import name X"):
        from harness.audit.importers.quiet import quiet_imports

        quiet_imports(["broken"])
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)


def test_a_check_that_does_not_apply_names_what_is_really_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Eight experts, engine routes, every GRPO group of one sample (verl's rollout.n = 1, as in the
    trainer-trace runs): ``prefix_agreement`` lacks groups of two, not the routes; ``wrapped_ids``
    cannot apply because no id of an 8-expert model can wrap at 256."""
    from tests.test_audit_findings import _group_records, _write

    rng = np.random.default_rng(8)
    records = [r for g in range(4) for r in _group_records(rng, group=f"g{g}", members=1, experts=8)]
    _write(tmp_path / "run", records)
    _, out, _ = _audit(capsys, tmp_path / "run")
    lines = {x.split()[0]: x for x in out.splitlines() if x and not x.startswith("rrh audit")}
    prefix, wrapped = lines["prefix_agreement"], lines["wrapped_ids"]
    assert "missing groups of two or more samples: GRPO groups of two or more samples" in prefix, prefix
    assert "engine_routes" not in prefix, prefix
    assert "missing more than 256 experts: a model with more than 256 experts" in wrapped, wrapped
    assert "group_key" not in wrapped, wrapped
