"""Writing the report's files: ``rrh check --html PATH`` and ``--json PATH``."""

from __future__ import annotations

from pathlib import Path

from harness.report.document import to_json
from harness.report.html_page import to_html
from harness.report.model import CheckReport


def write_report(report: CheckReport, *, html_path: str | None = None, json_path: str | None = None) -> None:
    """Write the HTML and/or JSON form of ``report`` (parent directories are created)."""
    for path, render in ((html_path, to_html), (json_path, to_json)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(render(report), encoding="utf-8")
