"""Test-support code: what the harness's own suites need to run real backends on a CPU machine, and
the assertions they judge with (``asserts``, ``judge``).

Nothing under ``harness/`` outside this package imports it but the pytest plugin (which drives
``harness.testing.suite``, what suites take from it); library code never depends on a patched
backend. Import a submodule explicitly, e.g. ``harness.testing.ranks`` (the one spawner of
process groups), ``harness.testing.megatron_cpu`` (megatron-core's CPU patches and their per-rank
setup hook).
"""
