"""``pytest suites/ -m gpu`` never collects nothing (issue #27): where no engine can start, it selects the
real-engine suites and skips each naming why (exit 0); ``RRH_REQUIRE_ENGINES=vllm`` makes that skip a
failure. Where vLLM can start, the suites run instead (``tox -e vllm-cpu``)."""

from __future__ import annotations

import pytest

from harness.check.suites import CheckOutcome, run_suites, suites_dir
from harness.subjects import DEFAULT_SUBJECT


def _blocker() -> str | None:
    from harness.engines.installed import start_blocker

    return start_blocker("vllm")


pytestmark = pytest.mark.skipif(
    _blocker() is None, reason="vLLM can start here: the real-engine suites run, not skip (tox -e vllm-cpu)"
)


def _run(monkeypatch: pytest.MonkeyPatch, require: str | None) -> list[CheckOutcome]:
    """``pytest suites/ -m gpu``, run in this process (``run_suites``: the suite modules imported
    anew, the harness plugin loaded as in a fresh run); what is checked is the selection and the
    plugin's skip or failure, not process isolation."""
    monkeypatch.delenv("RRH_REQUIRE_ENGINES", raising=False)
    if require:
        monkeypatch.setenv("RRH_REQUIRE_ENGINES", require)
    return run_suites(DEFAULT_SUBJECT, select="gpu", paths=[str(suites_dir())])[0]


def test_gpu_selection_collects_the_real_engine_suites_and_skips_naming_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outcomes = _run(monkeypatch, None)
    not_skipped = [f"{o.nodeid}: {o.outcome} {o.detail}" for o in outcomes if o.outcome != "skipped"]
    assert not not_skipped, f"expected every selected test skipped: {not_skipped[:3]}"
    assert len(outcomes) >= 11, f"only {len(outcomes)} real-engine tests selected"
    reasons = {o.detail for o in outcomes}
    assert f"vllm: {_blocker()}" in reasons, f"skip reason missing: {sorted(reasons)[:5]}"


def test_required_engine_turns_the_skip_into_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = _run(monkeypatch, "vllm")
    failed = [o for o in outcomes if o.outcome == "failed"]
    assert failed, f"expected failures, got {sorted({o.outcome for o in outcomes})}"
    assert any("RRH_REQUIRE_ENGINES=vllm" in o.detail for o in failed), [o.detail for o in failed[:3]]
