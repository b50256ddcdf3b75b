"""The zoo mutants killed on real vLLM by the real-engine suites, the correct twins passing
(``tests/real_engine_mutants.py``, on the engine of ``suites/test_vllm.py``)."""

# ruff: noqa: F401  (the suite's fixtures and the shared tests, collected here by name)
from __future__ import annotations

import pytest

from suites.test_vllm import checkpoint, engine, lab_rollouts
from tests.real_engine_mutants import (
    test_a_driver_that_replays_nothing_on_one_layer_is_killed_on_the_real_engine,
    test_a_splice_concatenating_every_payload_is_killed_on_the_real_engine,
    test_a_splice_keeping_the_latest_payload_is_killed_on_the_real_engine,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
