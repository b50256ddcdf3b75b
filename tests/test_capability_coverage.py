"""Capability coverage: the suites call every public function of every capability through the subject.

A capability function that no suite calls is a blind spot: a subject could get it wrong and every
suite would stay green. The suites run here (single-process ones, one generated example per property
plus the explicit ``@example`` pins) against the reference subject with every call recorded, until
every function has been called.
"""

from __future__ import annotations

from hypothesis import settings

from harness.check.suites import run_suites, suites_dir
from harness.testing import coverage

settings.register_profile("coverage", max_examples=1, derandomize=True, deadline=None, database=None)

REPLAY_TESTS = (
    "test_replay.py::test_recompute_replays_each_forwards_targets",
    "test_replay.py::test_replaying_own_recording_is_bit_exact",
)
"""The tests of ``test_replay.py`` (143 model cases) that call every replay handle method for each
kind; its other tests call nothing more, so the run takes only these."""

HEAVY = ("test_rollout_coverage.py", "test_mismatch_lab.py", "test_hf.py")
"""Suites that build real models or run episodes, run last: the run stops as soon as every function
has been called, usually before them."""


def _suites_cheapest_first() -> list[str]:
    light = [
        str(p) for p in sorted(suites_dir().glob("test_*.py")) if p.name not in (*HEAVY, "test_replay.py")
    ]
    return [*light, *(str(suites_dir() / name) for name in (*REPLAY_TESTS, *HEAVY))]


def test_the_suites_call_every_public_function_of_every_capability() -> None:
    coverage.CALLS.clear()
    outcomes, _ = run_suites(
        "harness.testing.coverage:RECORDING",
        paths=_suites_cheapest_first(),
        select="not slow and not gpu and not distributed",
        extra=["--hypothesis-profile", "coverage", "-p", "harness.testing.coverage"],
    )
    failed = [o.nodeid for o in outcomes if o.outcome == "failed"]
    assert not failed, f"suites failed on the recording reference: {failed[:5]}"
    missing = coverage.never_called()
    assert not missing, f"capability functions no suite calls through the subject: {missing}"


def test_an_uncalled_function_is_named() -> None:
    """The check can fail: with no calls recorded, every public function is reported, the passes included."""
    coverage.CALLS.clear()
    missing = coverage.never_called()
    assert {"training.backward", "training.policy_logprobs", "layouts.unplace", "splice"} <= set(missing)
    assert {"install_replay.prepare_backward", "install_hf_replay.replay"} <= set(missing)
    assert len(missing) > 40
