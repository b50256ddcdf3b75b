"""The README is the front door: its commands must be the ones CI and tox actually run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_has_two_commands_check_then_tests() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("rrh check")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_script


def _console_commands(section: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```console\n(.+?)\n```", body, flags=re.S)
    return [line[2:] for block in blocks for line in block.splitlines() if line.startswith("$ ")]


def test_the_audit_example_runs_as_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``rrh generate`` + ``rrh audit`` of the README, in a scratch directory; the DuckDB query is run too."""
    import shlex

    from harness.cli import main

    pytest.importorskip("pyarrow")
    commands = _console_commands("Audit a run")
    assert [c.split()[:2] for c in commands] == [["rrh", "generate"], ["rrh", "audit"], ["duckdb", "-c"]]
    monkeypatch.chdir(tmp_path)
    rewritten = [c.replace("/tmp/", f"{tmp_path}/") for c in commands]
    assert main(shlex.split(rewritten[0])[1:]) == 0
    assert main([*shlex.split(rewritten[1])[1:], "--executor", "serial", "--no-progress"]) == 1  # faults planted
    assert (tmp_path / "rrh-audit.html").is_file()
    duckdb = pytest.importorskip("duckdb")
    rows = duckdb.sql(shlex.split(rewritten[2])[2]).fetchall()
    assert [r[0] for r in rows] == [0, 1]
