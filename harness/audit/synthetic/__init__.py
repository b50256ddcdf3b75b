"""Seeded runs of realistic shape: the generator of ``rrh generate`` and the benchmarks, with faults
planted at known places (``generate``), and the tiny generated batch the audit pool's fork server
audits once so that every worker forked from it starts with its kernels loaded (``warm``, imported
by name by ``harness.audit.execution.pool``, never by the audit itself)."""
