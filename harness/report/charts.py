"""The mismatch lab's charts: routing disagreement per MoE layer, and |Δ log-prob| histograms."""

from __future__ import annotations

import math

from harness.report.model import LabSummary
from harness.report.svg import svg_grouped_bars

ARM_COLORS = {"no replay": "#d9822b", "R3": "#2b6cb0"}
CHART_WIDTH = 520
"""Every chart's width in pixels: the page's charts line up, two to a row of its 1064-pixel column."""


def _color(arm_name: str) -> str:
    return ARM_COLORS.get(arm_name, "#777")


def layer_chart(lab: LabSummary) -> str:
    """Both arms' routing disagreement, one group of bars per MoE layer."""
    return svg_grouped_bars(
        "Routing disagreement per MoE layer: rollout vs trainer",
        [f"L{layer}" for layer in lab.moe_layers],
        [(a.name, a.per_layer_disagreement, _color(a.name)) for a in lab.arms],
        y_label="routes that differ",
        x_label="decoder layer",
        percent=True,
        width=CHART_WIDTH,
    )


def histogram_chart(lab: LabSummary, *, flipped: bool) -> str | None:
    """Both arms' |Δ log-prob| histogram over all response tokens, or over the flipped ones.

    ``None`` when an arm has no such histogram or every bin is empty; the chart shows only the
    bins from the first to the last non-empty one.
    """
    counts: list[tuple[int, ...]] = []
    for arm in lab.arms:
        hist = arm.abs_delta_histogram
        arm_counts = None if hist is None else hist.flipped_counts if flipped else hist.counts
        if arm_counts is None:
            return None
        counts.append(arm_counts)
    used = [i for i in range(len(counts[0])) if any(c[i] for c in counts)]
    if not used:
        return None
    lo, hi = used[0], used[-1] + 1
    cats = []
    for i in range(lo, hi):
        decade = math.log10(lab.histogram_edges[i + 1])
        cats.append(f"1e{round(decade)}" if abs(decade - round(decade)) < 1e-9 else "")
    if lo == 0:
        cats[0] = f"<{cats[0] or '1e-7'}"  # the first bin also holds exact zeros
    tokens = "flipped tokens" if flipped else "response tokens"
    return svg_grouped_bars(
        f"|Δ log-prob| per token, {sum(counts[0])} {tokens} (bins: 4 per decade)",
        cats,
        [
            (a.name, [float(c) for c in cs[lo:hi]], _color(a.name))
            for a, cs in zip(lab.arms, counts, strict=True)
        ],
        y_label="tokens",
        x_label="|Δ log-prob| (upper bin edge; log scale)",
        width=CHART_WIDTH,
    )
