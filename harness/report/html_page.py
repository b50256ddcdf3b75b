"""The report as one self-contained HTML page: inline CSS and SVG, no script, nothing fetched.

The file can be attached to a PR or a CI artifact and opened anywhere; it shows the same
:class:`CheckReport` as the JSON document, for a reader rather than a program.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from harness.report.charts import histogram_chart, layer_chart
from harness.report.document import FORMAT
from harness.report.environment import Environment
from harness.report.markup import html_text
from harness.report.model import LEGEND, CheckReport, InvariantResult, LabSummary, Mark
from harness.report.verdict import header, percent, scientific, verdict

CSS = """
:root { --pass:#1e7d32; --fail:#b3261e; --skip:#6b6b6b; --ink:#1d1d1f; --muted:#5f6368; --line:#e3e3e6; }
* { box-sizing: border-box; }
body { font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--ink); margin: 0; background: #f6f7f9; }
main { max-width: 1120px; margin: 0 auto; padding: 24px 28px 48px; background: #fff; min-height: 100vh; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.sub { color: var(--muted); margin: 0 0 14px; }
.verdict { border-radius: 8px; padding: 14px 18px; margin: 14px 0; border-left: 6px solid; }
.verdict.pass { background: #edf7ee; border-color: var(--pass); }
.verdict.fail { background: #fdecea; border-color: var(--fail); }
.verdict.incomplete { background: #fff6e0; border-color: #c98a00; }
.verdict.suspect { background: #fff6e0; border-color: #c98a00; }
.verdict .status { font-weight: 700; font-size: 16px; letter-spacing: .02em; }
.counts span { display: inline-block; margin-right: 14px; }
.legend { color: var(--muted); font-size: 13px; margin: 6px 0 12px; }
.legend b { color: var(--ink); }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: #fafafb; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.badge { display: inline-block; min-width: 40px; text-align: center; border-radius: 4px; padding: 1px 6px;
         font-weight: 700; font-size: 12px; color: #fff; }
.badge.PASS { background: var(--pass); } .badge.FAIL { background: var(--fail); }
.badge.skip { background: var(--skip); } .badge.SUSPECT { background: #c98a00; }
tr.FAIL td { background: #fff7f6; } tr.SUSPECT td { background: #fffaf0; }
.msg { color: var(--ink); } .example { color: var(--muted); margin-top: 3px; }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
.charts { display: flex; flex-wrap: wrap; gap: 18px; }
svg.chart { background: #fff; border: 1px solid var(--line); border-radius: 6px; max-width: 100%;
            height: auto; }
svg .ct { font-size: 13px; font-weight: 600; fill: var(--ink); }
svg .tick { font-size: 11px; fill: var(--muted); } svg .axis { font-size: 11px; fill: var(--ink); }
svg .val { font-size: 10px; fill: var(--ink); }
svg .grid { stroke: #eceef1; } svg .axisline { stroke: #9aa0a6; }
.note { color: #8a5a00; } .error { color: var(--fail); font-weight: 600; }
details summary { cursor: pointer; color: var(--muted); margin: 6px 0; }
footer { color: var(--muted); font-size: 12px; margin-top: 32px; }
"""


def _badge(mark: Mark) -> str:
    return f'<span class="badge {html.escape(mark)}">{html.escape(mark)}</span>'


def _invariant_rows(items: Sequence[InvariantResult], spec: str) -> str:
    e = html.escape
    rows = []
    for i in items:
        detail = ""
        if i.message:
            detail += f'<div class="msg">{e(i.message)}</div>'
        if i.example:
            detail += f'<div class="example">counterexample: {e(i.example)}</div>'
        if i.result == "FAIL":
            rerun = f"pytest {i.nodeid} --rr-subject {spec}"
            detail += f'<div class="example">rerun: <code>{e(rerun)}</code></div>'
        rows.append(
            f'<tr class="{e(i.result)}"><td>{_badge(i.result)}</td><td>{e(i.suite)}</td>'
            f'<td>{html_text(i.invariant)}</td><td>{detail}</td><td class="num">{i.seconds:.2f}s</td></tr>'
        )
    return "\n".join(rows)


def _lab_html(lab: LabSummary) -> str:
    e = html.escape
    cfg = lab.config
    rows = []
    for a in lab.arms:
        g, gf = a.gap, a.gap_on_flipped
        rows.append(
            f"<tr><td><b>{e(a.name)}</b></td><td class=num>{percent(a.disagreement)}</td>"
            f"<td class=num>{percent(a.token_disagreement)}</td>"
            f"<td class=num>{scientific(g['mean_abs_diff'])}</td>"
            f"<td class=num>{scientific(g['max_abs_diff'])}</td><td class=num>{scientific(g['k3'])}</td>"
            f"<td class=num>{percent(g['extreme_fraction'])}</td>"
            f"<td class=num>{scientific(gf['mean_abs_diff'])}</td></tr>"
        )
    charts = [layer_chart(lab)]
    notes = []
    for flipped in (False, True):
        chart = histogram_chart(lab, flipped=flipped)
        if chart:
            charts.append(chart)
        elif not flipped:
            notes.append(
                "The |Δ log-prob| histograms need the lab's per-token |Δ| (LabArm.abs_delta); "
                "this lab result does not carry them."
            )
    if lab.note:
        notes.append(lab.note)
    sampler = "real vLLM" if lab.engine == "vllm" else "KV-cache decode"
    shape = (
        f"{cfg.get('num_experts')} experts top-{cfg.get('top_k')}, {cfg.get('num_layers')} layers, "
        f"{cfg.get('dtype')}; {cfg.get('batch')} rollouts × {cfg.get('response_len')} tokens sampled by "
        f"{sampler}, recomputed by the trainer in one full forward, without replay and with R3. "
        f"{lab.flipped_tokens} of {lab.response_tokens} response tokens had flipped routing "
        f"({lab.seconds:.1f}s)."
    )
    heads = (
        "trainer", "routes that differ", "tokens with a differing route", "mean |Δ|", "max |Δ|",
        "k3 KL", "F(τ=2)", "mean |Δ| on flipped tokens",
    )  # fmt: skip
    return (
        f"<h3>{e(lab.engine)} mismatch lab — {e(lab.family)}</h3>\n"
        f'<p class="sub">{e(shape)}</p>\n'
        f"<table><thead><tr>{''.join(f'<th>{e(h)}</th>' for h in heads)}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n"
        f'<div class="charts">{"".join(charts)}</div>\n'
        + "".join(f'<p class="note">{e(m)}</p>' for m in notes)
    )


def _env_html(env: Environment) -> str:
    e = html.escape
    rows = [
        ("harness", env.harness),
        ("python", env.python),
        ("torch", env.torch),
        ("numpy", env.numpy),
        ("transformers", env.transformers or "not installed"),
        ("hypothesis", env.hypothesis),
        ("pytest", env.pytest or "?"),
        *((name, version or "not installed") for name, version in env.engines.items()),
        ("CPU", f"{env.cpu} ({env.cores} cores)"),
        ("GPU", env.gpu or "none"),
        ("platform", env.platform),
    ]
    return "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows) + "</table>"


def to_html(report: CheckReport) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG; no script, nothing fetched)."""
    e = html.escape
    v = verdict(report)
    c = report.counts
    spec = report.subject.spec
    failed = report.results("FAIL")
    others = [i for i in report.invariants if i.result != "FAIL"]
    legend = " · ".join(f"<b>{e(k)}</b> {e(text)}" for k, text in LEGEND.items())
    runs = "".join(
        f"<li>{e(r.name)}: {r.tests} tests, {r.seconds:.1f}s "
        f"<span class=mono>{e(r.selection)}</span>"
        + (f' <span class="note">{e(r.note)}</span>' if r.note else "")
        + "</li>"
        for r in report.runs
    )
    fail_block = ""
    if failed:
        fail_block = (
            "<h2>Violated invariants</h2><table><thead><tr><th></th><th>suite</th><th>invariant</th>"
            "<th>what went wrong</th><th>time</th></tr></thead>"
            f"<tbody>{_invariant_rows(failed, spec)}</tbody></table>"
        )
    all_block = (
        f"<table><thead><tr><th></th><th>suite</th><th>invariant</th><th>detail</th><th>time</th></tr></thead>"
        f"<tbody>{_invariant_rows(others, spec)}</tbody></table>"
        if report.runs
        else "<p class=sub>No suite ran (--no-suites): no invariant was checked.</p>"
    )
    verified = len(report.verified)  # the verdict's count: passes that ran on the subject
    without = (
        f'<span class="sub">{c.passed - verified} passed without calling the subject</span>'
        if c.passed > verified
        else ""
    )
    counts = (
        f'<div class="counts"><span>{_badge("PASS")} {verified}</span>'
        f"<span>{_badge('FAIL')} {c.failed}</span>\n<span>{_badge('skip')} {c.skipped}</span>{without}</div>"
        if report.runs
        else ""
    )
    notes = "".join(f'<p class="error">{e(n)}</p>' for n in report.errors)
    notes += "".join(f'<p class="note">{e(n)}</p>' for n in report.notes)
    labs = "".join(_lab_html(lab) for lab in report.labs) or "<p class=sub>No mismatch lab ran.</p>"
    caps = ", ".join(report.subject.capabilities) or "none"
    name = report.subject.name
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rrh check — {e(name)}: {e(v.status.upper())}</title>
<style>{CSS}</style></head>
<body><main>
<h1>Routing replay check: {e(name)}</h1>
<p class="sub">{e(header(report))}<br>capabilities: {e(caps)} · {e(report.created)} ·
{report.wall_seconds:.1f}s · <span class="mono">{e(report.command)}</span></p>
<div class="verdict {e(v.status)}"><div class="status">{e(v.status.upper())}</div>
{counts}<p>{e(v.text)}</p></div>
<p class="legend">{legend}</p>
{notes}
{fail_block}
<h2>Invariants</h2>
<ul class="sub">{runs}</ul>
{all_block}
<h2 id="lab">Mismatch lab: does R3 remove the train–inference gap?</h2>
<p class="sub">Δ = log π<sub>train</sub>(y) − log π<sub>infer</sub>(y) on each sampled response token.
R3 must make routing disagreement exactly 0 and shrink |Δ| where routing had flipped.</p>
{labs}
<h2 id="environment">Environment</h2>
{_env_html(report.environment)}
<footer>Generated by <span class="mono">rrh check</span>
(routing-replay-harness {e(report.environment.harness)}). Machine-readable twin:
<span class="mono">rrh check --json PATH</span> (schema {e(FORMAT)}).</footer>
</main></body></html>
"""
