"""The gate's comparison of an observation with its baseline (``harness.gate.baseline`` documents).

``compare(baseline, observed)`` returns a ``GateReport``: *regressions* (the gate fails) and *notes*.
A change of convention or observation, an invariant that passed and now does not (or was not
run), a metric worse than its baseline by more than the tolerance, or a different engine are
regressions; a new engine version, a newly passing invariant, a better metric or any change of a
figure (what the engine does without promising it) are notes. Structured differences are computed
with deepdiff and printed readably.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.gate.baseline import validate_baseline

__all__ = ["GateReport", "compare"]


@dataclass
class GateReport:
    """What changed between a baseline and an observation."""

    regressions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.regressions

    def format(self) -> str:
        lines = []
        if self.regressions:
            lines.append(f"REGRESSIONS ({len(self.regressions)}):")
            lines += [f"  - {r}" for r in self.regressions]
        if self.notes:
            lines.append(f"notes ({len(self.notes)}):")
            lines += [f"  - {n}" for n in self.notes]
        if not lines:
            lines.append("no difference from the baseline")
        return "\n".join(lines)


def _structured_diff(section: str, old: Any, new: Any) -> list[str]:
    from deepdiff import DeepDiff

    diff = DeepDiff(old, new, ignore_order=True, significant_digits=None, verbose_level=2)
    if not diff:
        return []
    return [
        f"{section}: {line.replace('root', section, 1)}"
        for line in diff.pretty().splitlines()
        if line.strip()
    ]


def _metric_regression(name: str, base: dict[str, Any], new: dict[str, Any]) -> str | None:
    old, tol, better = base["value"], float(base["tolerance"]), base["better"]
    value = new["value"]
    expected = {
        "lower": f"at most {old} + {tol}",
        "higher": f"at least {old} − {tol}",
        "equal": f"{old} ± {tol}",
    }[better]
    if old is None or value is None:
        if old is None and value is None:
            return None
        why = new.get("undefined") or base.get("undefined")
        return f"metrics.{name}: value {value}, expected {expected} (undefined: {why})"
    delta = value - old
    worse = {"lower": delta > tol, "higher": -delta > tol, "equal": abs(delta) > tol}[better]
    return f"metrics.{name}: value {value:.6g}, expected {expected}" if worse else None


def compare(baseline: dict[str, Any], observed: dict[str, Any]) -> GateReport:
    """Compare an observation with its baseline (both validated documents); see the module docstring."""
    validate_baseline(baseline, "baseline")
    validate_baseline(observed, "observed")
    report = GateReport()
    if baseline["engine"] != observed["engine"]:
        report.regressions.append(
            f"engine: observed {observed['engine']!r}, expected {baseline['engine']!r} (wrong baseline file?)"
        )
        return report
    if baseline["version"] != observed["version"]:
        report.notes.append(f"version: {baseline['version']} → {observed['version']}")
    for section in ("convention", "observations"):
        report.regressions += _structured_diff(section, baseline[section], observed[section])

    old_inv, new_inv = baseline["invariants"], observed["invariants"]
    for name, old in old_inv.items():
        new = new_inv.get(name)
        if new is None:
            if old == "passed":
                report.regressions.append(f"invariants[{name}]: not run, expected passed")
            else:
                report.notes.append(f"invariants[{name}]: no longer collected (was {old})")
        elif old == "passed" and new != "passed":
            report.regressions.append(f"invariants[{name}]: {new}, expected passed")
        elif old != new:
            report.notes.append(f"invariants[{name}]: {old} → {new}")
    for name in sorted(set(new_inv) - set(old_inv)):
        (report.regressions if new_inv[name] == "failed" else report.notes).append(
            f"invariants[{name}]: new test, {new_inv[name]}"
            + (", expected passed" if new_inv[name] == "failed" else "")
        )

    old_m, new_m = baseline["metrics"], observed["metrics"]
    for name, base in old_m.items():
        if name not in new_m:
            report.regressions.append(f"metrics.{name}: not measured, expected {base['value']}")
            continue
        value = new_m[name]["value"]
        problem = _metric_regression(name, base, new_m[name])
        if problem:
            report.regressions.append(problem)
        elif value != base["value"]:
            report.notes.append(f"metrics.{name}: {base['value']} → {value} (within ±{base['tolerance']})")
    for name in sorted(set(new_m) - set(old_m)):
        report.notes.append(f"metrics.{name}: new metric, {new_m[name]['value']}")
    old_f, new_f = baseline.get("figures", {}), observed.get("figures", {})
    for name in sorted(set(old_f) | set(new_f)):
        was, now = old_f.get(name, {}).get("value"), new_f.get(name, {}).get("value")
        if was != now:
            why = (new_f.get(name) or old_f[name])["why"]
            report.notes.append(f"figures.{name}: {was} → {now} (not gated: {why})")
    return report
