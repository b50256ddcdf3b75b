"""What ``rrh check`` tells its reader: in the terminal, as a JSON document, as an HTML page.

One concept per module, bottom to top:

- :mod:`~harness.report.environment` — where it ran (versions, CPU, GPU), read without importing engines;
- :mod:`~harness.report.model` — the typed :class:`CheckReport`: what one run found;
- :mod:`~harness.report.verdict` — the header line and the verdict in words;
- :mod:`~harness.report.document` — the report's JSON document (schema:
  ``harness/schemas/check_report.schema.json``);
- :mod:`~harness.report.build` — a :class:`CheckReport` from suite outcomes and mismatch-lab results;
- :mod:`~harness.report.svg` — the grouped-bar SVG chart (why no plotting library: its docstring);
- :mod:`~harness.report.charts` — the lab's charts drawn with it;
- :mod:`~harness.report.markup` — the docstrings' inline reStructuredText, as plain text or HTML;
- :mod:`~harness.report.html_page` — the self-contained HTML page;
- :mod:`~harness.report.write` — the ``--html`` / ``--json`` files;
- :mod:`~harness.report.terminal` — tables, the invariant table, the verdict, the progress lines.
"""

from harness.report.build import HIST_EDGES, LabRun, SuiteRun, build_report, histogram
from harness.report.document import FORMAT, SCHEMA_ID, schema, to_dict, to_json
from harness.report.environment import Environment, environment
from harness.report.html_page import to_html
from harness.report.model import (
    LEGEND,
    MARKS,
    ArmSummary,
    CheckReport,
    Counts,
    Histogram,
    InvariantResult,
    LabSummary,
    RunSummary,
    SubjectInfo,
)
from harness.report.svg import svg_grouped_bars
from harness.report.terminal import (
    RULES,
    Progress,
    format_failures,
    format_legend,
    format_outcomes,
    format_table,
    format_verdict,
)
from harness.report.verdict import Verdict, header, header_line, verdict
from harness.report.write import write_report

__all__ = [
    "FORMAT",
    "HIST_EDGES",
    "LEGEND",
    "MARKS",
    "RULES",
    "SCHEMA_ID",
    "ArmSummary",
    "CheckReport",
    "Counts",
    "Environment",
    "Histogram",
    "InvariantResult",
    "LabRun",
    "LabSummary",
    "Progress",
    "RunSummary",
    "SubjectInfo",
    "SuiteRun",
    "Verdict",
    "build_report",
    "environment",
    "format_failures",
    "format_legend",
    "format_outcomes",
    "format_table",
    "format_verdict",
    "header",
    "header_line",
    "histogram",
    "schema",
    "svg_grouped_bars",
    "to_dict",
    "to_html",
    "to_json",
    "verdict",
    "write_report",
]
