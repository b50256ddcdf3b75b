"""The JSON document of an ``rrh check`` report (``rrh check --json``).

``to_dict`` follows ``harness/schemas/check_report.schema.json`` (JSON Schema draft 2020-12; the
tests validate it with ``jsonschema``). A number that is undefined (nan: a gap over zero flipped
tokens) is ``None`` in the report and ``null`` in JSON, which has no nan. The counts, the header
line and the verdict are derived from the report (:mod:`harness.report.verdict`) as it is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from importlib import resources
from typing import Any

from harness.report.model import LEGEND, CheckReport
from harness.report.verdict import header, verdict

SCHEMA_ID = "https://routing-replay-harness.invalid/schemas/check_report.schema.json"
FORMAT = "rrh-check-report/1"


def to_dict(report: CheckReport) -> dict[str, Any]:
    """The JSON document (the schema's ``check_report``) of ``report``."""
    return {
        "$schema": SCHEMA_ID,
        "format": FORMAT,
        "created": report.created,
        "command": report.command,
        "subject": _plain(report.subject),
        "engine": report.engine,
        "family": report.family,
        "header": header(report),
        "runs": _plain(report.runs),
        "invariants": _plain(report.invariants),
        "counts": _plain(report.counts),
        "labs": _plain(report.labs),
        "notes": list(report.notes),
        "errors": list(report.errors),
        "environment": _plain(report.environment),
        "wall_seconds": report.wall_seconds,
        "legend": dict(LEGEND),
        "verdict": _plain(verdict(report)),
    }


def _plain(value: Any) -> Any:
    """Dataclasses as dicts and tuples as lists, recursively: the JSON form of a model value."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def to_json(report: CheckReport) -> str:
    """The JSON document as text; a nan that slipped through is an error, not invalid JSON."""
    return json.dumps(to_dict(report), indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def schema() -> dict[str, Any]:
    """The checked-in JSON Schema (draft 2020-12) of :meth:`CheckReport.to_dict`."""
    text = resources.files("harness").joinpath("schemas").joinpath("check_report.schema.json").read_text()
    return dict(json.loads(text))
