"""The tables of an audit's result: a row per step and per MoE layer, the worst samples, the drift.

``AuditResult.of`` (``result.audit_result``) builds its per-step and per-layer metrics, its worst samples
and its drift flags from the merged ``AuditState`` with these; every figure is a plain float or
None (``finite``: JSON has no NaN).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from harness.audit.checks.state import WORST, AuditState, SampleFigure, imbalance


def finite(x: float) -> float | None:
    """``x`` as a float, or None where it is not a finite number (JSON has no NaN)."""
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def prefix_figures(state: AuditState, only: int | None = None) -> dict[int, tuple[int, int, int]]:
    """Per step (``only`` that one): ``(prompt rows, rows where members differ, groups)`` over its groups of
    two or more."""
    out: dict[int, tuple[int, int, int]] = {}
    for (step, _), group in state.groups.items():
        if len(group.members) > 1 and only in (None, step):
            rows, differ = group.figures()
            have = out.get(step, (0, 0, 0))
            out[step] = (have[0] + rows, have[1] + differ, have[2] + 1)
    return out


def step_row(step: int, state: AuditState, prefix: tuple[int, int, int]) -> dict[str, Any]:
    f = state.steps[step]
    gap, agreed, flipped = f.gap.result(), f.gap_agreed.result(), f.gap_flipped.result()
    prefix_rows, prefix_differ, _ = prefix
    agreement = f.agreement
    return {
        "step": step,
        "samples": f.samples,
        "rows": f.rows,
        "fallback_fraction": finite(f.uncaptured_rows / f.rows) if f.rows else None,
        "disagreement": finite(agreement.disagreement) if agreement else None,
        "token_disagreement": finite(agreement.token_disagreement) if agreement else None,
        "tokens": gap.n_tokens,
        "mean_abs_diff": finite(gap.mean_abs_diff),
        "k3": finite(gap.k3),
        "extreme_fraction": finite(gap.extreme_fraction),
        "mean_abs_diff_agreed": finite(agreed.mean_abs_diff),
        "tokens_agreed": agreed.n_tokens,
        "mean_abs_diff_flipped": finite(flipped.mean_abs_diff),
        "tokens_flipped": flipped.n_tokens,
        "prefix_agreement": finite(1 - prefix_differ / prefix_rows) if prefix_rows else None,
    }


def step_layer_rows(state: AuditState, step: int) -> list[dict[str, Any]]:
    """Per MoE layer of one step: disagreement and expert-load imbalance (a key left out: not measured)."""
    layers = list(state.moe_layers)
    f = state.steps[step]
    agreement = f.agreement
    usable = (
        agreement is not None and agreement.positions > 0 and agreement.differs_per_layer.size == len(layers)
    )
    per_layer = agreement.per_layer if usable and agreement is not None else None
    step_load = f.load if f.load is not None and f.load.shape[0] == len(layers) else None
    ratio = imbalance(step_load) if step_load is not None else None
    if f.load_imbalance is not None:  # sealed: its own ratio, unless load reached it afterwards
        ratio = f.load_imbalance if f.load is None else None
    rows = []
    for j, layer in enumerate(layers):
        row: dict[str, Any] = {"step": step, "layer": layer}
        if per_layer is not None:
            row["disagreement"] = float(per_layer[j])
        if ratio is not None:
            row["load_max_over_mean"] = finite(float(ratio[j]))
        rows.append(row)
    return rows


def layer_rows(state: AuditState) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per MoE layer over the whole run, and per (step, MoE layer): disagreement and expert-load imbalance."""
    layers = list(state.moe_layers)
    width = len(layers)
    total_differs = np.zeros(width, np.int64)
    positions = 0
    load = None if state.sealed_load is None else state.sealed_load.copy()
    step_layers = []
    for step in sorted(state.steps):
        step_layers.extend(step_layer_rows(state, step))
        f = state.steps[step]
        agreement = f.agreement
        if agreement is not None and agreement.positions > 0 and agreement.differs_per_layer.size == width:
            total_differs += agreement.differs_per_layer
            positions += agreement.positions
        if f.load is not None and f.load.shape[0] == width:
            load = f.load.copy() if load is None else load + f.load
    ratios = imbalance(load) if load is not None else None
    rows = []
    for j, layer in enumerate(layers):
        row = {"layer": layer, "disagreement": finite(total_differs[j] / positions) if positions else None}
        if ratios is not None and math.isfinite(ratios[j]):
            row["load_max_over_mean"] = float(ratios[j])
        rows.append(row)
    return rows, step_layers


def worst(samples: list[SampleFigure]) -> dict[str, list[dict[str, Any]]]:
    """The ``WORST`` samples by mean |Δ| and by disagreement, above 0 (ties by step and sample key)."""
    out = {}
    for figure in ("mean_abs_diff", "disagreement"):

        def rank(s: SampleFigure, f: str = figure) -> tuple[float, int, str]:
            return (-float(getattr(s, f)), s.step, s.sample_key)

        # A sample at 0 is not among the worst: no table of zeros when nothing differs.
        ranked = sorted((s for s in samples if math.isfinite(getattr(s, figure)) and getattr(s, figure) > 0),
                        key=rank)  # fmt: skip
        out[figure] = [s.as_dict() for s in ranked[:WORST]]
    return out


DRIFT_FACTOR = 2.0
"""A step's figure more than this many times the run's median is flagged as drift."""


def drift(steps: list[dict[str, Any]], step_name: str = "step") -> list[str]:
    flags = []
    for figure in ("mean_abs_diff", "disagreement", "fallback_fraction"):
        values = [(s["step"], s[figure]) for s in steps if s.get(figure) is not None]
        if len(values) < 3:
            continue
        median = statistics.median(v for _, v in values)
        for step, value in values:
            if median > 0 and value > DRIFT_FACTOR * median:
                flags.append(
                    f"{figure} at {step_name} {step} is {value:.3g}, "
                    f"{value / median:.1f}× the run's median {median:.3g}"
                )
    return flags
