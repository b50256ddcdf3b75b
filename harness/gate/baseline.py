"""Gate baselines: what one engine version did, stored as JSON, and the comparison the gate runs.

A baseline records, for one engine at one version (``fixtures/baselines/<engine>.json``):

- ``convention``: the observed payload convention — ``dtype``, ``row_rule``, ``layer_axis`` (and
  whatever else the engine's observer adds);
- ``observations``: engine-specific facts compared exactly (for ``hf``: per model family, what the
  router returns and which gate-weight rules reproduce its weights);
- ``invariants``: the outcome of every suite test (``passed`` / ``failed`` / ``skipped``);
- ``metrics``: ``{"value", "tolerance", "better"}`` where ``better`` is ``"lower"``, ``"higher"`` or
  ``"equal"`` (two-sided); a metric undefined on this observation (a ratio whose denominator is 0)
  has ``"value": null`` and says why in ``"undefined"`` — never a silent NaN;
- ``figures`` (optional): what the engine did that it does not promise, ``{"value", "why"}``, e.g.
  whether two greedy runs of vLLM on CPU gave the same tokens (FACTS §6: vLLM promises neither
  run-to-run determinism nor batch invariance there). A change of a figure is a note, never a
  regression: a gate that failed on it would fail on a busy or another machine, not on a bug.

``harness.gate.compare`` compares an observation with its baseline.

Writes are atomic (``harness.atomic``). Reading trusts nothing: a value or tolerance that is not a
finite number (``NaN``, ``Infinity``, ``1e999``, an integer too large for a float, a boolean)
would make every comparison pass or crash, so ``load_baseline`` refuses it with ``BaselineError``,
like a tolerance beyond what its metric can take (``max_tolerance``: 1 for a fraction), undecodable
text, nesting deeper than ``MAX_DEPTH`` and a path that is not a readable file.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from harness.atomic import atomic_write
from harness.errors import HarnessError
from harness.outcomes import OUTCOMES

MAX_DEPTH = 32
"""The deepest nesting of objects and lists a baseline may have (the recorded ones have 5)."""

FORMAT_NAME = "rrh.gate_baseline"
FORMAT_VERSION = 1
BETTER = ("lower", "higher", "equal")

FRACTION_METRICS = ("disagreement",)
"""Name endings of the metrics that are fractions in [0, 1]: a tolerance above 1 cannot be exceeded."""
MAX_TOLERANCE = 100.0
"""The largest tolerance of any other metric: absolute log-prob gaps (nats), logit moves, ratios of
gaps. The recorded ones are at most 0.25; a finite but huge tolerance (``99999999999999999999``)
would switch the metric's gate off as surely as ``Infinity``, so it is refused like it."""


def max_tolerance(name: str) -> float:
    """The largest tolerance metric ``name`` may have: 1 for a fraction, else ``MAX_TOLERANCE``."""
    return 1.0 if name.endswith(FRACTION_METRICS) else MAX_TOLERANCE


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "BaselineError",
    "figure",
    "load_baseline",
    "metric",
    "new_baseline",
    "save_baseline",
    "validate_baseline",
]


class BaselineError(HarnessError, ValueError):
    """A baseline file is missing, unreadable or malformed."""


def metric(value: float, tolerance: float, better: str = "equal", *, undefined: str = "") -> dict[str, Any]:
    """One metric entry: ``value`` with an absolute ``tolerance`` in the direction ``better``.

    A NaN ``value`` is a metric this observation leaves undefined: it is stored as null beside
    ``undefined``, the reason, which it requires — a NaN without a reason is a failed measurement,
    not an observation. An infinite value, a reason beside a number, or a tolerance that is not a
    finite non-negative number, is a ``BaselineError``.
    """
    if better not in BETTER:
        raise BaselineError(f"metric.better: expected one of {BETTER}, got {better!r}")
    tol = _finite(_as_float(tolerance))
    if tol is None or tol < 0:
        raise BaselineError(f"metric.tolerance: expected a finite non-negative number, got {tolerance!r}")
    if tol > MAX_TOLERANCE:
        raise BaselineError(
            f"metric.tolerance: expected at most MAX_TOLERANCE={MAX_TOLERANCE}, got {tolerance!r}"
        )
    number = _json_float(value)
    if number is not None and _finite(number) is None:
        raise BaselineError(f"metric.value: expected a finite number or NaN (undefined), got {value!r}")
    if number is None and not undefined:
        raise BaselineError("metric.value: NaN with no reason; expected a number, or NaN and undefined=why")
    if number is not None and undefined:
        raise BaselineError(f"metric.undefined: expected no reason beside the value {number!r}")
    entry: dict[str, Any] = {"value": number, "tolerance": tol, "better": better}
    if undefined:
        entry["undefined"] = undefined
    return entry


def _as_float(x: object) -> float | None:
    """A number of any kind the harness measures (Python, numpy or 0-d torch) as a float, else None."""
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None


def _finite(x: object) -> float | None:
    """``x`` as a float when it is a finite int or float (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        number = float(x)
    except OverflowError:  # an int beyond the float range
        return None
    return number if math.isfinite(number) else None


def _depth(doc: object) -> int:
    """How deeply objects and lists nest in ``doc`` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(doc, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level + 1)
            if deepest > MAX_DEPTH:
                break
            stack += [(child, level + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return deepest


def _bad_text(doc: object) -> str | None:
    """The first string (key or value) of ``doc`` that is not Unicode text (a lone surrogate from a
    ``\\ud800`` escape: it could never be printed or written back), else None."""
    stack = [doc]
    while stack:
        node = stack.pop()
        items = list(node.items()) if isinstance(node, dict) else node if isinstance(node, list) else [node]
        for item in items:
            for text in item if isinstance(item, tuple) else (item,):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        return text
                elif isinstance(text, (dict, list)):
                    stack.append(text)
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all distinct (``json`` would keep the last of two silently)."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"duplicate key {key[:80]!r} in one object")
        doc[key] = value
    return doc


TOP_KEYS = ("format", "format_version", "engine", "version", "harness_version", "convention",
            "observations", "invariants", "metrics", "figures")  # fmt: skip
FIGURE_KEYS = ("value", "why")
METRIC_KEYS = ("value", "tolerance", "better", "undefined")


def _json_float(value: float) -> float | None:
    value = float(value)
    return None if math.isnan(value) else value  # JSON has no NaN: null means "undefined"


def new_baseline(
    engine: str,
    version: str,
    *,
    convention: dict[str, Any],
    invariants: dict[str, str],
    metrics: dict[str, dict[str, Any]],
    observations: dict[str, Any] | None = None,
    figures: dict[str, dict[str, Any]] | None = None,
    harness_version: str = "",
) -> dict[str, Any]:
    """A baseline document (validated)."""
    doc = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "engine": engine,
        "version": version,
        "harness_version": harness_version,
        "convention": convention,
        "observations": observations or {},
        "invariants": dict(sorted(invariants.items())),
        "metrics": dict(sorted(metrics.items())),
    }
    if figures:
        doc["figures"] = dict(sorted(figures.items()))
    validate_baseline(doc)
    return doc


def validate_baseline(doc: object, source: str = "baseline") -> dict[str, Any]:
    """Check the document's shape; ``BaselineError`` names the field and the expected value."""
    if not isinstance(doc, dict):
        raise BaselineError(f"{source}: expected a JSON object, got {type(doc).__name__}")
    if _depth(doc) > MAX_DEPTH:
        raise BaselineError(f"{source}: expected objects and lists nested at most {MAX_DEPTH} deep")
    unknown = sorted(str(k) for k in doc if k not in TOP_KEYS)
    if unknown:
        raise BaselineError(
            f"{source}: {unknown[0][:80]!r}: an unknown field; expected only {list(TOP_KEYS)}"
        )
    if doc.get("format") != FORMAT_NAME:
        raise BaselineError(f"{source}: format: expected {FORMAT_NAME!r}, got {doc.get('format')!r:.80}")
    version = doc.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise BaselineError(
            f"{source}: format_version: expected {FORMAT_VERSION}, got {doc.get('format_version')!r}"
        )
    for key in ("engine", "version", "harness_version"):
        if key == "harness_version" and key not in doc:
            continue
        if not isinstance(doc.get(key), str) or (not doc[key] and key == "engine"):
            raise BaselineError(f"{source}: {key}: expected a string, got {doc.get(key)!r:.80}")
    for key in ("convention", "observations", "invariants", "metrics"):
        if not isinstance(doc.get(key), dict):
            raise BaselineError(f"{source}: {key}: expected an object, got {type(doc.get(key)).__name__}")
    for name, outcome in doc["invariants"].items():
        if outcome not in OUTCOMES:
            raise BaselineError(
                f"{source}: invariants[{name!r}]: expected one of {OUTCOMES}, got {outcome!r}"
            )
    for name, entry in doc["metrics"].items():
        where = f"{source}: metrics[{name!r}]"
        if not isinstance(entry, dict):
            raise BaselineError(f"{where}: expected an object with value, tolerance, better")
        if not name:
            raise BaselineError(f"{where}: expected a metric name")
        extra = sorted(k for k in entry if k not in METRIC_KEYS)
        if extra:
            raise BaselineError(
                f"{where}.{extra[0][:80]}: an unknown field; expected only {list(METRIC_KEYS)}"
            )
        value, tol, better = entry.get("value"), entry.get("tolerance"), entry.get("better")
        if value is not None and _finite(value) is None:
            raise BaselineError(f"{where}.value: expected a finite number or null, got {value!r:.80}")
        reason = entry.get("undefined")
        if value is None and not (isinstance(reason, str) and reason):
            raise BaselineError(f"{where}.undefined: expected why the value is null, got {reason!r:.80}")
        if value is not None and reason is not None:
            raise BaselineError(f"{where}.undefined: expected no reason beside the value {value!r}")
        tolerance = _finite(tol)
        if tolerance is None or tolerance < 0:
            raise BaselineError(f"{where}.tolerance: expected a finite non-negative number, got {tol!r:.80}")
        if tolerance > (bound := max_tolerance(name)):
            kind = "a fraction in [0, 1]" if bound == 1.0 else "MAX_TOLERANCE"
            raise BaselineError(f"{where}.tolerance: expected at most {bound} ({kind}), got {tol!r:.80}")
        if better not in BETTER:
            raise BaselineError(f"{where}.better: expected one of {BETTER}, got {better!r}")
    _validate_figures(doc, source)
    return doc


def figure(value: float, why: str) -> dict[str, Any]:
    """One figure entry: ``value`` (finite), recorded and compared as a note, and ``why`` it is not
    gated (what the engine does not promise)."""
    number = _finite(_as_float(value))
    if number is None:
        raise BaselineError(f"figure.value: expected a finite number, got {value!r}")
    if not why:
        raise BaselineError("figure.why: expected why the figure is not gated")
    return {"value": number, "why": why}


def _validate_figures(doc: dict[str, Any], source: str) -> None:
    figures = doc.get("figures", {})
    if not isinstance(figures, dict):
        raise BaselineError(f"{source}: figures: expected an object, got {type(figures).__name__}")
    for name, entry in figures.items():
        where = f"{source}: figures[{name!r}]"
        if not isinstance(entry, dict) or sorted(entry) != sorted(FIGURE_KEYS):
            raise BaselineError(f"{where}: expected an object with exactly {list(FIGURE_KEYS)}")
        if _finite(entry["value"]) is None:
            raise BaselineError(f"{where}.value: expected a finite number, got {entry['value']!r:.80}")
        if not isinstance(entry["why"], str) or not entry["why"]:
            raise BaselineError(f"{where}.why: expected a reason, got {entry['why']!r:.80}")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} overflows a float")
    return number


def load_baseline(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a baseline file; every problem is a ``BaselineError`` naming the path."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BaselineError(f"{path}: no baseline; record one with --update") from None
    except OSError as err:
        raise BaselineError(f"{path}: cannot read the baseline ({err.strerror or err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BaselineError(f"{path}: not UTF-8 text (byte {err.start}); expected a JSON baseline") from None
    try:
        doc = json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except RecursionError:
        raise BaselineError(f"{path}: expected objects and lists nested at most {MAX_DEPTH} deep") from None
    except ValueError as err:  # JSONDecodeError, non-finite numbers, integers of more than 4,300 digits
        raise BaselineError(f"{path}: not valid JSON ({str(err)[:200]})") from None
    bad = _bad_text(doc)
    if bad is not None:
        raise BaselineError(f"{path}: a string holds a lone surrogate ({bad[:40]!r}); expected Unicode text")
    return validate_baseline(doc, str(path))


def save_baseline(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Validate and write ``doc`` atomically (``harness.atomic``), creating the directory."""
    validate_baseline(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return atomic_write(path, lambda handle: handle.write(text.encode()))
