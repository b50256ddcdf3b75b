"""Test-support code: what the harness's own suites need to run real backends on a CPU machine.

Nothing under ``harness/`` outside this package imports it; library code never depends on a
patched backend. Import a submodule explicitly, e.g. ``harness.testing.ranks`` (the one spawner of
process groups), ``harness.testing.megatron_cpu`` (megatron-core's CPU patches and their per-rank
setup hook).
"""
