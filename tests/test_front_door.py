"""The front door tells the truth: usage errors exit 2 in one line, reports put failures first."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.check.suites import CheckOutcome, skip_reason
from harness.report import format_outcomes

MODULES = {
    "exits_zero": "import sys\nsys.exit(0)\n",
    "syntax_error": "def f(:\n",
    "raises": "raise RuntimeError('boom')\n",
}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exits_zero:SUBJECT", "raised SystemExit"),
        ("syntax_error:SUBJECT", "syntax error"),
        ("raises:SUBJECT", "RuntimeError: boom"),
        (".relative:SUBJECT", "absolute module path"),
        ("no_colon", "expected 'package.module:object'"),
    ],
)
def test_a_subject_that_does_not_load_is_one_line_and_exit_2(
    tmp_path: Path,
    spec: str,
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, body in MODULES.items():
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    for name in MODULES:
        sys.modules.pop(name, None)
    assert cli.main(["check", "--subject", spec, "--no-lab"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_rrh_finds_a_subject_in_the_current_directory(tmp_path: Path) -> None:
    """The console script, not ``python -m``: its sys.path lacks the current directory."""
    (tmp_path / "my_subject.py").write_text("SUBJECT = 3\n")
    script = Path(sys.executable).with_name("rrh")
    if not script.exists():
        pytest.skip("no rrh console script next to this interpreter")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    result = subprocess.run(
        [str(script), "check", "--subject", "my_subject:SUBJECT", "--no-lab"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "is a int, expected a harness.subjects.Subject" in result.stderr, (
        result.stderr
    )


def test_usage_errors_of_the_parser_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["gate", "--engine", "tensorrt"])
    assert exit_.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _o(nodeid: str, outcome: str, detail: str = "", caps: tuple[str, ...] = ()) -> CheckOutcome:
    suite = nodeid.split("::")[0].removeprefix("suites/test_").removesuffix(".py")
    return CheckOutcome(nodeid, suite, nodeid.split("::")[1], outcome, detail, 0.0, capabilities=caps)


def test_report_lists_failures_first_groups_skips_and_sets_apart_tests_that_skip_the_subject() -> None:
    missing = "subject 'x' does not provide 'install_replay'"
    outcomes = [
        *(_o(f"suites/test_replay.py::test_{i}", "skipped", missing) for i in range(30)),
        _o("suites/test_mismatch_lab.py::test_lab", "passed"),
        _o("suites/test_splice.py::test_rows", "failed", "spliced trace has 9 rows, expected 6", ("splice",)),
        _o("suites/test_splice.py::test_ok", "passed", "", ("splice",)),
    ]
    text = format_outcomes(outcomes)
    rows = [ln for ln in text.splitlines()[2:] if ln and not ln.startswith(" ")]
    assert rows[0].startswith("FAIL") and "test_rows" in rows[0]
    assert "reference_impl.splice.splice, DESIGN §3.4" in text and "Σa = a_1 + … + a_n" in text
    assert text.count(missing) == 1 and "30 tests (replay)" in text
    assert "did not call the subject" in text
    assert text.endswith("1 passed on the subject, 1 passed without it, 1 failed, 30 skipped")


def test_skip_reasons_drop_hypothesis_example_notes() -> None:
    text = "Skipped: subject 'x' does not provide 'splice'\nFailing explicit example: test_a(n=1)"
    assert skip_reason(text) == "subject 'x' does not provide 'splice'"


def test_conformance_tests_of_the_harness_are_listed_under_their_own_header() -> None:
    """Tests of the harness's own backends (``conformance/``) are not counted as passes on the subject."""
    engine = CheckOutcome("conformance/test_engines.py::test_rows", "engines", "rows", "passed", "", 0.0)
    outcomes = [
        _o("suites/test_splice.py::test_ok", "passed", "", ("splice",)),
        dataclasses.replace(engine, conformance=True),
        dataclasses.replace(engine, nodeid="conformance/test_engines.py::test_ids", outcome="failed",
                            detail="ids out of range", conformance=True),
    ]  # fmt: skip
    suites, own = format_outcomes(outcomes).split("\n\nconformance of the harness's own backends")
    assert suites.endswith("1 passed on the subject, 0 passed without it, 0 failed, 0 skipped")
    assert "engines" not in suites and "did not call the subject" not in own
    assert own.splitlines()[3].startswith("FAIL") and "ids out of range" in own
    assert own.endswith("1 passed, 1 failed, 0 skipped")
