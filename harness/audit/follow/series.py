"""The per-step time series of a followed run: a row per step, its layers, and where they go.

A step's row is the one-shot ``steps.parquet`` row (``result.tables.step_row``: route agreement,
the share of flipped tokens, mean |Δ| and k3 split by agreed and flipped tokens) with the samples
that broke a strict invariant; its layers are the ``step_layers.parquet`` rows. As each step lands:

- ``--summary DIR``: ``DIR/series/steps-<step>.parquet`` and ``layers-<step>.parquet``, one file per
  step written atomically, so a query engine reads the series while it grows
  (``duckdb -c "select * from 'DIR/series/steps-*.parquet' order by step"``);
- ``--tensorboard DIR``: scalars in TensorBoard event files (tensorboardX), at global step = the step.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.audit.checks.state import AuditState
from harness.audit.layout.schema import LayoutError
from harness.audit.result.summary import columns, write_rows
from harness.audit.result.tables import prefix_figures, step_layer_rows, step_row

SCALARS = {
    "route_agreement": "1 - disagreement",
    "flipped_tokens": "token_disagreement",
    "mean_abs_diff": "mean_abs_diff",
    "k3": "k3",
    "mean_abs_diff_agreed": "mean_abs_diff_agreed",
    "mean_abs_diff_flipped": "mean_abs_diff_flipped",
    "fallback_fraction": "fallback_fraction",
    "violations": "violations",
}
"""TensorBoard tag (under ``rrh/``) → the step row's figure it plots."""


def step_series(state: AuditState, step: int, violations: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Step ``step``'s row (with ``violations``: its samples that broke a strict invariant) and its layers."""
    row = step_row(step, state, prefix_figures(state, only=step).get(step, (0, 0, 0)))
    row["violations"] = violations
    return row, step_layer_rows(state, step)


def scalar(row: dict[str, Any], figure: str) -> float | None:
    """The value a ``SCALARS`` entry plots (``None``: not measured at this step)."""
    if figure == "1 - disagreement":
        value = row.get("disagreement")
        return None if value is None else 1.0 - value
    value = row.get(figure)
    return None if value is None else float(value)


class SeriesWriter:
    """Writes each step's row and layers to ``summary/series`` and to TensorBoard, where asked."""

    def __init__(
        self, summary: str | os.PathLike[str] | None, tensorboard: str | os.PathLike[str] | None
    ) -> None:
        self.folder = Path(summary) / "series" if summary else None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.board: Any = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise LayoutError(
                    "--tensorboard: tensorboardX is not installed; expected the 'tensorboard' extra "
                    "(pip install 'routing-replay-harness[tensorboard]')"
                ) from None
            self.board = SummaryWriter(logdir=str(tensorboard), flush_secs=1)

    def add(self, row: dict[str, Any], layers: list[dict[str, Any]]) -> None:
        step = int(row["step"])
        if self.folder is not None:
            tables = columns()
            step_columns = {**tables["steps"], "violations": _int64()}
            write_rows(self.folder / f"steps-{step:08d}.parquet", [row], step_columns)
            if layers:
                write_rows(self.folder / f"layers-{step:08d}.parquet", layers, tables["step_layers"])
        if self.board is not None:
            for tag, figure in SCALARS.items():
                value = scalar(row, figure)
                if value is not None:
                    self.board.add_scalar(f"rrh/{tag}", value, step)
            for layer in layers:
                if layer.get("disagreement") is not None:
                    self.board.add_scalar(f"rrh_layers/disagreement_layer_{layer['layer']}",
                                          layer["disagreement"], step)  # fmt: skip
            self.board.flush()

    def close(self) -> None:
        if self.board is not None:
            self.board.close()


def _int64() -> Any:
    import pyarrow as pa

    return pa.int64()
