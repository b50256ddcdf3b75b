"""Audit of a real run (DESIGN §7): what a run wrote to disk, checked sample by sample.

- ``layout``: the run layout (versioned Parquet schema) and ``SampleRecord``;
- ``writer``: ``RunWriter``, buffered and atomic per file;
- ``reader``: a run's files, units of work and their row groups; ``decode``: a row group decoded
  zero-copy into a ``Batch`` (``batch``);
- ``checks``: the strict invariants and metrics, a module per family, folded batch by batch
  (``kernels``, ``repeat_kernels``: their compiled kernels);
- ``footer``: a Parquet footer checked before pyarrow reads it (what pyarrow would abort on);
- ``state``: the mergeable accumulators; ``result``: the figures of a finished audit, its per-step
  and per-layer tables, worst samples and drift from ``result_tables``;
- ``findings``: the prompt rows that differ within a group, named at the end (and ``wrapped_ids``);
- ``executors``: serial, process pool and Ray;
- ``generate``: seeded runs of realistic shape with planted faults;
- ``tap``, ``tap_engine``: what a run's trainer dispatched and its engine returned, written as the
  run layout;
- ``importers``: what frameworks already dump, converted into the run layout (``quiet``: a
  framework imported without its import-time noise).

The package sits beside the subjects (DESIGN §4): it imports the core (``harness.trace``,
``harness.metrics``, …), the engines and probes, never the suites, the CLI or the reports.

``from harness.audit import RunWriter, SampleRecord, audit_run``.
"""

from harness.audit.checks.fold import AuditOptions
from harness.audit.executors import audit_run
from harness.audit.layout import LayoutError, SampleRecord
from harness.audit.result import AuditResult
from harness.audit.writer import RunWriter

__all__ = ["AuditOptions", "AuditResult", "LayoutError", "RunWriter", "SampleRecord", "audit_run"]
