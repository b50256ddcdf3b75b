"""``rrh audit --summary DIR``: the audit's figures as Parquet tables that DuckDB or Polars query directly.

- ``steps.parquet``: one row per step (samples, rows, fallback, agreement, the gap split by
  whether the token's routes agreed, prefix agreement);
- ``step_layers.parquet``: one row per (step, MoE layer) (disagreement, expert-load imbalance);
- ``samples.parquet``: one row per (step, sample) (rows, tokens, mean |Δ|, disagreement,
  uncaptured rows, strict invariants violated: a detector's suspicion is not one);
- ``offenders.parquet``: every offender kept, with its invariant and its kind (``strict``, ``suspicion``:
  a detector's, or ``metric``: a worst sample).

Example: ``duckdb -c "select step, mean_abs_diff, disagreement from 'DIR/steps.parquet'"``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.atomic import atomic_write
from harness.audit.result.audit_result import AuditResult

TABLES = ("steps", "step_layers", "samples", "offenders")


def write_rows(path: Path, rows: list[dict[str, Any]], columns: dict[str, Any]) -> None:
    """``rows`` as one Parquet file of ``columns`` (name → Arrow type), written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(list(columns.items()))
    table = pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows], schema=schema)
    atomic_write(path, lambda handle: pq.write_table(table, handle, compression="zstd"))


def columns() -> dict[str, dict[str, Any]]:
    """Each table's columns (name → Arrow type)."""
    import pyarrow as pa

    f64, i64, s = pa.float64(), pa.int64(), pa.string()
    return {
        "steps": {
            "step": i64, "samples": i64, "rows": i64, "fallback_fraction": f64, "disagreement": f64,
            "token_disagreement": f64, "tokens": i64, "mean_abs_diff": f64, "k3": f64,
            "extreme_fraction": f64, "mean_abs_diff_agreed": f64, "tokens_agreed": i64,
            "mean_abs_diff_flipped": f64, "tokens_flipped": i64, "prefix_agreement": f64,
        },
        "step_layers": {"step": i64, "layer": i64, "disagreement": f64, "load_max_over_mean": f64},
        "samples": {
            "step": i64, "sample_key": s, "group_key": s, "rows": i64, "response_tokens": i64,
            "mean_abs_diff": f64, "disagreement": f64, "uncaptured_rows": i64, "violations": i64, "where": s,
        },
        "offenders": {
            "invariant": s, "kind": s, "step": i64, "sample_key": s, "row": i64, "layer": i64,
            "expected": s, "actual": s, "where": s,
        },
    }  # fmt: skip


def write_summary(result: AuditResult, directory: str | os.PathLike[str]) -> list[Path]:
    """Write the four summary tables into ``directory`` (made if missing); return their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tables = columns()
    offenders = [{"invariant": r.name, "kind": r.kind, **o} for r in result.invariants for o in r.offenders]
    samples = [f.as_dict() for f in result.samples]
    paths = []
    for name, rows in (
        ("steps", result.steps),
        ("step_layers", result.step_layers),
        ("samples", samples),
        ("offenders", offenders),
    ):
        path = out / f"{name}.parquet"
        write_rows(path, rows, tables[name])
        paths.append(path)
    return paths
