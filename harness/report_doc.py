"""Former home of the ``rrh check`` document; it is now the package :mod:`harness.report`.

Kept so that code written against the old path keeps importing; new code imports
:mod:`harness.report`. The hand-written JSON-Schema validator that lived here is gone: the tests
validate the document with ``jsonschema`` (the ``dev`` extra).
"""

from harness.report import (
    FORMAT,
    HIST_EDGES,
    LEGEND,
    MARKS,
    SCHEMA_ID,
    LabRun,
    SuiteRun,
    build_report,
    environment,
    header_line,
    histogram,
    schema,
    svg_grouped_bars,
    to_html,
    to_json,
    write_report,
)

__all__ = [
    "FORMAT",
    "HIST_EDGES",
    "LEGEND",
    "MARKS",
    "SCHEMA_ID",
    "LabRun",
    "SuiteRun",
    "build_report",
    "environment",
    "header_line",
    "histogram",
    "schema",
    "svg_grouped_bars",
    "to_html",
    "to_json",
    "write_report",
]
