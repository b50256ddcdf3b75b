"""Test support: run pytest on the suites in this process, as a fresh ``pytest`` command would.

A pytest subprocess costs seconds of CPU to import torch, transformers and the harness again; where
what a test checks is what the run prints and its exit code (the plugin's header, skips, usage
errors), not process isolation, it runs here instead: the suite modules are imported anew
(``harness.check.fresh_suite_modules``), the working directory is the repository root as for the
command, and the hypothesis profile active before is restored after.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import settings

from harness.check.suites import fresh_suite_modules

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class PytestRun:
    """What ``pytest ARGS`` returned and printed."""

    returncode: int
    stdout: str
    stderr: str


def run_pytest(*args: str) -> PytestRun:
    """``python -m pytest -p no:cacheprovider ARGS`` from the repository root, in this process."""
    out, err = io.StringIO(), io.StringIO()
    profile = settings.get_current_profile_name()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), fresh_suite_modules():
            code = pytest.main(["-p", "no:cacheprovider", *args])
    finally:
        os.chdir(cwd)
        settings.load_profile(profile)
    return PytestRun(int(code), out.getvalue(), err.getvalue())
