"""SVG bar charts drawn as text: the report's charts, inline in its single HTML file.

Written here rather than with a plotting library because the report must stay one self-contained,
script-free HTML file that opens anywhere, and ``harness`` must stay light:

- matplotlib writes SVG without JavaScript, but it and its compiled dependencies (pillow,
  fonttools, kiwisolver, contourpy, …) are a heavy install for two bar charts, and by default its
  SVG draws text as glyph paths (neither searchable nor styled by the page's CSS);
- plotly, bokeh and altair/vega draw in the browser: a self-contained page must inline several MB
  of JavaScript, and the report is checked to contain no script;
- pygal writes SVG but links its tooltip script from an external URL by default.

The one chart the report needs (grouped bars with a labelled zero, so "exactly 0 with R3" is seen)
is about a hundred lines.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence


def svg_grouped_bars(
    title: str,
    categories: Sequence[str],
    series: Sequence[tuple[str, Sequence[float | None], str]],
    *,
    y_label: str,
    percent: bool = False,
    x_label: str = "",
    label_every: int = 1,
    width: int = 560,
    height: int = 300,
) -> str:
    """A grouped bar chart: one group per category, one bar per series (name, values, colour).

    Zero values are drawn as a thin line on the axis with their value, so "exactly 0" is visible.
    """
    e = html.escape
    left, right, top, bottom = 62, 16, 44, 58
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for _, vals, _ in series for v in vals if v is not None]
    vmax = max(values, default=0.0)
    ticks = nice_ticks(vmax)
    top_value = ticks[-1]
    n, m = max(len(categories), 1), max(len(series), 1)
    group_w = plot_w / n
    bar_w = max(1.0, group_w * 0.8 / m)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{e(title)}" class="chart">',
        f"<title>{e(title)}</title>",
        f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" class="ct">{e(title)}</text>',
    ]
    for t in ticks:
        y = top + plot_h - (t / top_value) * plot_h if top_value else top + plot_h
        label = f"{100 * t:.3g}%" if percent else f"{t:.4g}"
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{e(label)}</text>')
    out.append(
        f'<text x="14" y="{top + plot_h / 2:.1f}" transform="rotate(-90 14 {top + plot_h / 2:.1f})" '
        f'text-anchor="middle" class="axis">{e(y_label)}</text>'
    )
    for i, cat in enumerate(categories):
        x0 = left + i * group_w + group_w * 0.1
        for j, (name, vals, color) in enumerate(series):
            v = vals[i] if i < len(vals) else None
            if v is None:
                continue
            h = (v / top_value) * plot_h if top_value else 0.0
            x, y = x0 + j * bar_w, top + plot_h - h
            tip = f"{name}, {cat}: " + (f"{100 * v:.3g}%" if percent else f"{v:g}")
            faint = ' fill-opacity="0.55"' if h == 0 else ""
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w * 0.92:.1f}" height="{max(h, 1.5):.1f}" '
                f'fill="{color}"{faint}><title>{e(tip)}</title></rect>'
            )
            if len(categories) <= 12 and (v == 0 or percent):
                text = "0" if v == 0 else (f"{100 * v:.2g}%" if percent else f"{v:g}")
                out.append(
                    f'<text x="{x + bar_w * 0.46:.1f}" y="{y - 4:.1f}" text-anchor="middle" class="val">'
                    f"{e(text)}</text>"
                )
        if i % label_every == 0:
            cx = left + (i + 0.5) * group_w
            ty = top + plot_h + 16
            out.append(f'<text x="{cx:.1f}" y="{ty}" text-anchor="middle" class="tick">{e(cat)}</text>')
    out.append(
        f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" y2="{top + plot_h}" class="axisline"/>'
    )
    if x_label:
        out.append(
            f'<text x="{left + plot_w / 2:.1f}" y="{top + plot_h + 36}" text-anchor="middle" class="axis">'
            f"{e(x_label)}</text>"
        )
    lx = left
    for name, _, color in series:
        out.append(f'<rect x="{lx}" y="{height - 14}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 16}" y="{height - 4}" class="tick">{e(name)}</text>')
        lx += 24 + 8 * len(name)
    out.append("</svg>")
    return "\n".join(out)


def nice_ticks(vmax: float, n: int = 4) -> list[float]:
    """0 and ``n`` round steps covering ``vmax`` (a non-empty axis even when everything is 0)."""
    if not math.isfinite(vmax) or vmax <= 0:
        return [0.0, 1.0]
    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    count = math.ceil(vmax / step - 1e-9)
    return [round(step * i, 12) for i in range(count + 1)]
