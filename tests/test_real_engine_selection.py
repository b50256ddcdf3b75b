"""``pytest suites/ -m gpu`` never collects nothing (issue #27): where no engine can start, it selects the
real-engine suites and skips each naming why (exit 0); ``RRH_REQUIRE_ENGINES=vllm`` makes that skip a
failure. Where vLLM can start, the suites run instead (``tox -e vllm-cpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocker() -> str | None:
    from harness.engines.installed import start_blocker

    return start_blocker("vllm")


pytestmark = pytest.mark.skipif(
    _blocker() is None, reason="vLLM can start here: the real-engine suites run, not skip (tox -e vllm-cpu)"
)


def _run(require: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RRH_REQUIRE_ENGINES"}
    if require:
        env["RRH_REQUIRE_ENGINES"] = require
    command = [sys.executable, "-m", "pytest", "suites/", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    return subprocess.run(
        [*command, "-p", "no:xdist"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )


def test_gpu_selection_collects_the_real_engine_suites_and_skips_naming_why() -> None:
    done = _run(None)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, f"exit {done.returncode}, expected 0 (all skipped):\n{done.stdout[-3000:]}"
    assert "passed" not in summary and "failed" not in summary and " skipped" in summary, summary
    skipped = int(summary.split(" skipped")[0].split()[-1])
    assert skipped >= 11, f"only {skipped} real-engine tests selected: {summary}"
    assert f"vllm: {_blocker()}" in done.stdout, f"skip reason missing:\n{done.stdout[-2000:]}"


def test_required_engine_turns_the_skip_into_a_failure() -> None:
    done = _run("vllm")
    assert done.returncode == 1, f"exit {done.returncode}, expected 1:\n{done.stdout[-3000:]}"
    assert "RRH_REQUIRE_ENGINES=vllm" in done.stdout, done.stdout[-2000:]
