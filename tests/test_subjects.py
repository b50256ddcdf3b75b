"""Subjects: loading, capabilities, and what a run says about them."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import SubjectError
from harness.subjects import CAPABILITIES, Subject, load_subject
from harness.subjects.reference import REFERENCE
from tests.inprocess import run_pytest


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'package.module:object'"),
        ("harness.nope:X", "cannot import module 'harness.nope'"),
        ("harness.subjects:NOPE", "has no attribute 'NOPE'"),
        ("harness.subjects:CAPABILITIES", "is a tuple, expected a harness.subjects.Subject"),
    ],
)
def test_bad_subject_specs_raise_subject_error(spec: str, message: str) -> None:
    with pytest.raises(SubjectError, match=message):
        load_subject(spec)


@pytest.mark.parametrize(
    ("raised", "named"),
    [
        ("RuntimeError('lazy init failed')", "RuntimeError: lazy init failed"),
        ("ImportError('no module named torch_lazy')", "ImportError: no module named torch_lazy"),
    ],
)
def test_a_failing_module_getattr_is_a_subject_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised: str, named: str
) -> None:
    name = f"lazy_subject_{named[:3].lower()}"
    (tmp_path / f"{name}.py").write_text(f"def __getattr__(attr):\n    raise {raised}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SubjectError) as info:
        load_subject(f"{name}:SUBJECT")
    assert str(info.value) == f"looking up 'SUBJECT' in module {name!r} raised {named}"


def test_reference_provides_every_capability() -> None:
    assert REFERENCE.capabilities() == list(CAPABILITIES)
    assert Subject("empty").capabilities() == []


def test_unknown_subject_is_a_usage_error_not_a_traceback() -> None:
    run = run_pytest("suites/test_training.py", "--rr-subject", "harness.nope:X")
    assert run.returncode == 4, run.stdout + run.stderr
    assert "--rr-subject: cannot import module 'harness.nope'" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_subject_without_capabilities_is_reported_as_untested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty_subject.py").write_text(
        "from harness.subjects import Subject\nEMPTY = Subject(name='empty')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = run_pytest("suites/test_training.py", "--rr-subject", "empty_subject:EMPTY")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "rrh subject: empty" in run.stdout and "capabilities: none" in run.stdout
    assert "not provided by the subject (skipped): training" in run.stdout
    assert "WARNING: no capability of the subject was exercised" in run.stdout
