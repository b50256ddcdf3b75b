"""``rrh audit --html``: an audit as one self-contained page (inline CSS and SVG, no script).

In the style of the ``rrh check`` page: a verdict, one row per invariant (checked, violated with
its first offenders, or not checkable and why), then the plots people would rather look at than
read — the per-step trend of the gap (split by whether the token's routes agreed) and of
agreement and fallback, per-layer agreement, and the worst samples. A figure the dump does not
allow is said to be "not measured" (and why), never drawn as an empty chart or a table of zeros;
every offender and worst sample is named by its place: the framework's own file and the index in
it for an imported dump, else the layout file and row.
"""

from __future__ import annotations

import html
from typing import Any

from harness.audit.result.audit_result import AuditResult, InvariantResult, human_size
from harness.report.html_page import CSS
from harness.report.svg import svg_grouped_bars

_STATUS = {"checked": "PASS", "violated": "FAIL", "suspect": "SUSPECT", "not checkable": "skip"}
"""The badge (and its CSS class) of each status: a detector's suspicion is not a failure."""


def _every(count: int) -> int:
    return max(1, count // 16)


def _chart_or_line(
    title: str, cats: list[str], series: list[tuple[str, list[Any], str]], *, over: str = "step", **kw: Any
) -> str:
    """A chart of the series that were measured; a sentence instead when every value is 0: ``TITLE: 0 in
    every step.`` (``over``: what the categories are), naming the series only where there are several
    (one series' name is the title's own words)."""
    measured = [(name, vals, colour) for name, vals, colour in series if any(v is not None for v in vals)]
    if not measured:
        return ""
    if all(not v for _, vals, _ in measured for v in vals if v is not None):
        names = " and ".join(name for name, _, _ in measured) + " " if len(measured) > 1 else ""
        return f"<p class=sub>{html.escape(title)}: {html.escape(names)}0 in every {html.escape(over)}.</p>"
    return svg_grouped_bars(title, cats, measured, **kw)


def _not_measured(result: AuditResult, name: str, what: str) -> str:
    """``what: not measured — missing …`` for a metric the dump does not allow."""
    found = next((r for r in result.invariants if r.name == name), None)
    if found is None or found.status != "not checkable":
        return ""
    why = found.line(result.hints, result.step_name).split("— missing ", 1)[-1]
    return f"<p class=sub>{html.escape(what)}: not measured — missing {html.escape(why)}</p>"


def _trend_charts(result: AuditResult) -> list[str]:
    steps = result.steps
    if not steps:
        return []
    cats = [str(s["step"]) for s in steps]
    charts = []
    step = result.step_name  # slime's steps are rollout ids
    common: dict[str, Any] = {"x_label": step, "over": step, "label_every": _every(len(cats)),
                              "width": max(560, 24 * len(cats) + 120)}  # fmt: skip
    if any(s["mean_abs_diff"] is not None for s in steps):
        charts.append(
            _chart_or_line(
                f"Train–inference gap per {step}: mean |Δ log-prob|",
                cats,
                [
                    ("all tokens", [s["mean_abs_diff"] for s in steps], "#555"),
                    ("routes agreed", [s["mean_abs_diff_agreed"] for s in steps], "#2b6cb0"),
                    ("routes flipped", [s["mean_abs_diff_flipped"] for s in steps], "#d9822b"),
                ],
                y_label="mean |Δ|",
                **common,
            )
        )
    else:
        charts.append(_not_measured(result, "logprob_gap", "Train–inference gap"))
    disagreement = [s["disagreement"] for s in steps]
    if any(v is not None for v in disagreement):
        charts.append(
            _chart_or_line(
                f"Routes that differ (trainer vs engine) per {step}",
                cats,
                [("routes differ (trainer vs engine)", disagreement, "#d9822b")],
                y_label="fraction",
                percent=True,
                **common,
            )
        )
    else:
        charts.append(_not_measured(result, "agreement", "Routes that differ (trainer vs engine)"))
    charts.append(
        _chart_or_line(
            f"Rows without a captured route per {step}",
            cats,
            [("rows without a captured route", [s["fallback_fraction"] for s in steps], "#777")],
            y_label="fraction",
            percent=True,
            **common,
        )
    )
    layers = [r for r in result.layers if r.get("disagreement") is not None]
    if layers:
        charts.append(
            _chart_or_line(
                "Routing disagreement per MoE layer, whole run",
                [f"L{r['layer']}" for r in layers],
                [("routes differ", [r["disagreement"] for r in layers], "#d9822b")],
                y_label="routes that differ",
                x_label="decoder layer",
                over="MoE layer",
                percent=True,
                label_every=_every(len(layers)),
                width=max(560, 14 * len(layers) + 120),
            )
        )
    return [c for c in charts if c]


def _offender_table(inv: InvariantResult, step: str = "step") -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td class=num>{o['step']}</td><td class=mono>{e(o['sample_key'])}</td>"
        f"<td class=num>{'' if o['row'] is None else o['row']}</td>"
        f"<td class=num>{'' if o['layer'] is None else o['layer']}</td>"
        f"<td>{e(o['expected'])}</td><td>{e(o['actual'])}</td><td class=mono>{e(o['where'])}</td></tr>"
        for o in inv.offenders
    )
    what = {"strict": "first offenders", "suspicion": "first suspected"}.get(inv.kind, "worst samples")
    return (
        f"<details><summary>{len(inv.offenders)} {what}</summary><table><thead><tr>"
        f"<th>{e(step)}</th><th>sample</th><th>row</th><th>layer</th><th>expected</th><th>got</th><th>where</th>"
        f"</tr></thead><tbody>{rows}</tbody></table></details>"
    )


def _invariant_rows(result: AuditResult) -> str:
    e = html.escape
    out = []
    for inv in result.invariants:
        mark = _STATUS[inv.status]
        line = inv.line(result.hints, result.step_name)
        detail = e(line.split(None, 1)[1] if " " in line else line)
        if inv.offenders:
            detail += _offender_table(inv, result.step_name)
        out.append(
            f'<tr class="{mark}"><td><span class="badge {mark}">{e(inv.status)}</span></td>'
            f"<td>{e(inv.kind)}</td><td class=mono>{e(inv.name)}</td><td class=msg>{detail}</td></tr>"
        )
    return "".join(out)


_WORST_METRIC = {"mean_abs_diff": "logprob_gap", "disagreement": "agreement"}


def _worst_table(result: AuditResult, rows: list[dict[str, Any]], figure: str) -> str:
    e = html.escape
    if not rows:
        reason = _not_measured(result, _WORST_METRIC.get(figure, figure), f"Worst samples by {figure}")
        return reason or f"<p class=sub>Worst samples by {e(figure)}: no sample above 0.</p>"
    body = "".join(
        f"<tr><td class=num>{r['step']}</td><td class=mono>{e(r['sample_key'])}</td>"
        f"<td class=mono>{e(r['group_key'])}</td><td class=num>{r[figure]:.4g}</td>"
        f"<td class=num>{r['response_tokens']}</td><td class=num>{r['violations']}</td>"
        f"<td class=mono>{e(r.get('where') or '')}</td></tr>"
        for r in rows
    )
    return (
        f"<h3>Worst samples by {e(figure)}</h3><table><thead><tr><th>{e(result.step_name)}</th>"
        "<th>sample</th><th>group</th>"
        f"<th>{e(figure)}</th><th>response tokens</th><th>invariants violated</th><th>where</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )


def _read(result: AuditResult) -> str:
    """``2 files · 19 samples · 41.2 KiB``; for an imported dump the files of the dump read and the bytes
    of the run layout they were imported into, each said so."""
    size = human_size(result.bytes_read)
    if result.dump_files is None:
        return f"{result.files_read()} · {result.counted()} · {size}"
    return f"{result.files_read()} read · {result.counted()} · {size} of run layout"


FOLLOW_RELOAD_SECONDS = 10
"""How often a followed run's page reloads itself in the browser (it is rewritten after each step)."""


def audit_html(
    result: AuditResult, *, title: str, command: str, seconds: float, following: str = "", live: bool = False
) -> str:
    """The page for ``result`` (``title``: the run audited). ``following``: where ``rrh audit --follow``
    is, or how it ended; ``live``: the run goes on (the page reloads every ``FOLLOW_RELOAD_SECONDS``)."""
    e = html.escape
    violated, suspected = result.violated, result.suspected
    status = "fail" if violated else "suspect" if suspected else "pass"
    status = "incomplete" if result.input_errors else status
    text = (
        f"{len(violated)} strict invariant(s) violated"
        if violated
        else "no strict invariant violated"
        + (", but some files could not be read" if result.input_errors else "")
    )
    if suspected:
        names = ", ".join(r.name for r in suspected)
        said = f"{len(suspected)} detector(s) suspect a fault ({names})"
        text += f"; {said}: a suspicion, not a broken invariant"
    errors = "".join(f'<p class="error">{e(x)}</p>' for x in result.input_errors)
    drift = "".join(f'<p class="note">inferred: {e(x)}</p>' for x in result.inferred)
    drift += "".join(f'<p class="note">drift: {e(x)}</p>' for x in result.drift)
    drift += "".join(f'<p class="note">{e(x)}</p>' for x in result.notes)
    charts = "".join(_trend_charts(result)) or "<p class=sub>No metric to plot.</p>"
    reload = f'\n<meta http-equiv="refresh" content="{FOLLOW_RELOAD_SECONDS}">' if live else ""
    said = f"following the run: {following}" if live else following
    live_note = f'<p class="note">{e(said)}</p>' if following else ""
    worst = "".join(_worst_table(result, rows, figure) for figure, rows in result.worst.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rrh audit — {e(title)}: {e(status.upper())}</title>{reload}
<style>{CSS}</style></head>
<body><main>
<h1>Routing replay audit: {e(title)}</h1>
<p class="sub">{e(_read(result))} ·
{seconds:.1f}s · <span class="mono">{e(command)}</span><br>sources: {e("; ".join(result.sources))}</p>
{live_note}
<div class="verdict {e(status)}"><div class="status">{e(status.upper())}</div><p>{e(text)}</p></div>
{errors}{drift}
<h2>Invariants</h2>
<table><thead><tr><th></th><th>kind</th><th>invariant</th><th>detail</th></tr></thead>
<tbody>{_invariant_rows(result)}</tbody></table>
<h2>Trends</h2>
<div class="charts">{charts}</div>
<h2>Worst samples</h2>
{worst or "<p class=sub>No per-sample figure.</p>"}
<footer>Generated by <span class="mono">rrh audit</span>. Machine-readable twin:
<span class="mono">rrh audit --json PATH</span>; tables:
<span class="mono">rrh audit --summary DIR</span>.</footer>
</main></body></html>
"""
