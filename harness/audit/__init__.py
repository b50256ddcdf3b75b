"""Audit of a real run (DESIGN §7): what a run wrote to disk, checked sample by sample.

One package per concern, in the order data flows:

- ``layout``: the run layout (versioned Parquet schema, ``SampleRecord``), its writer and reader,
  the row groups decoded into batches, and the generator of seeded runs;
- ``tap``: what a run's engine returned and its trainer dispatched, written as the run layout;
- ``importers``: what frameworks already dump, converted into the run layout;
- ``trace``: megatron-core's router trace, joined with a framework's dump;
- ``checks``: the strict invariants, detectors and metrics, a module per family, folded batch by
  batch into the mergeable accumulators (``state``), with their compiled kernels;
- ``result``: the figures of a finished audit and their tables;
- ``execution``: serial, process pool and Ray over a run's units of work;
- ``follow``: a run audited while it is written (``rrh audit --follow``): what the writer has
  finished, the loop that folds each step in, the per-step time series;
- ``synthetic``: seeded runs of realistic shape with planted faults (``rrh generate``), and the
  pool's warm-up batch.

The package sits beside the subjects (DESIGN §4): it imports the core (``harness.trace``,
``harness.metrics``, …), the engines and probes, never the suites, the CLI or the reports.

``from harness.audit import RunWriter, SampleRecord, audit_run``.
"""

from harness.audit.checks.fold import AuditOptions
from harness.audit.execution.executors import audit_run
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.audit.layout.writer import RunWriter
from harness.audit.result.audit_result import AuditResult

__all__ = ["AuditOptions", "AuditResult", "LayoutError", "RunWriter", "SampleRecord", "audit_run"]
