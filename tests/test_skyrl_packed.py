"""SkyRL 0.4.0's packed (THD) Megatron path judged on the packed layouts, and the mutant that proves the
layout would catch routes packed in the wrong order (``harness.mutants.skyrl``).

Both drive SkyRL's own ``setup_per_microbatch_replay_forward(…, remove_microbatch_padding=True)``, so
they need SkyRL 0.4.0: they run in ``tox -e skyrl-0.4.0`` and skip, naming the env, elsewhere.
SkyRL records nothing (R3 only), so a layout whose R3 checks pass ends in the skip that says so.
"""

from __future__ import annotations

import pytest

from harness.check.suites import CheckOutcome, run_suites, suites_dir
from harness.subjects.frameworks import installed_version

CASE = "test_megatron.py::test_router_replay_follows_canonical_targets[{}]"
R3_PASSED = "R3 checks passed"
needs_skyrl = pytest.mark.skipif(
    installed_version("skyrl") != "0.4.0", reason="needs SkyRL 0.4.0 (run it in its env: tox -e skyrl-0.4.0)"
)


def _outcome(spec: str, layout: str) -> CheckOutcome:
    outcomes, log = run_suites(
        spec, paths=[str(suites_dir() / CASE.format(layout))], extra=["--hypothesis-profile", "ci"]
    )
    assert len(outcomes) == 1, f"expected one outcome for {spec} on {layout}:\n{log[-2000:]}"
    return outcomes[0]


@needs_skyrl
def test_skyrl_packed_path_replays_every_real_token() -> None:
    outcome = _outcome("harness.subjects.frameworks.skyrl:SKYRL_0_4_0", "pp2thd")
    assert outcome.outcome == "skipped" and R3_PASSED in outcome.detail, outcome


@needs_skyrl
def test_skyrl_refuses_vpp_and_is_not_run_on_it() -> None:
    outcome = _outcome("harness.subjects.frameworks.skyrl:SKYRL_0_4_0", "pp2vpp2thd")
    assert outcome.outcome == "skipped" and "virtual_pipeline_model_parallel_size" in outcome.detail, outcome


@needs_skyrl
def test_packed_routes_in_seq_major_order_are_killed() -> None:
    outcome = _outcome("harness.mutants.skyrl:PACKED_SEQ_MAJOR", "pp2thd")
    assert outcome.outcome == "failed" and "other experts than their targets" in outcome.detail, outcome
