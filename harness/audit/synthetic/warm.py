"""The warm-up of the audit pool's fork server (``harness.audit.execution.pool``), run when it imports this.

Only the fork server imports this module: it loads the compiled kernels (numba's disk cache) and
pyarrow's readers once, by auditing a tiny generated batch of the default routing shape (top-8 of
128 experts, uint8) read back from Parquet, so every worker forked from it starts warm.
"""

from __future__ import annotations

import io

from harness.audit.checks.fold import fold_batch
from harness.audit.checks.state import AuditState
from harness.audit.layout.decode import decode
from harness.audit.synthetic.generate import RunShape, _step_samples, _table


def warm_kernels() -> None:
    """Audit a tiny generated batch read back from Parquet (what a worker's first unit would load)."""
    import pyarrow.parquet as pq

    shape = RunShape(steps=1, prompts=1, group_size=2, prompt_len=3, response_len=4)
    buffer = io.BytesIO()
    pq.write_table(_table([s for s, _ in _step_samples(shape, 0, 0, {})], shape), buffer)
    table = pq.ParquetFile(io.BytesIO(buffer.getvalue())).read_row_group(0, use_threads=False)
    fold_batch(decode(table, "warm-up", 0), AuditState())


try:
    warm_kernels()
except Exception:  # a warm-up is an optimisation: workers load what they need themselves
    pass
