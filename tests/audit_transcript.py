"""Golden transcripts of ``rrh audit``: what a user sees, compared with a committed copy.

A transcript is the CLI's whole terminal output (stderr, then stdout), its ``--json`` report and its
``--summary`` tables, of one audit of a fixture dump. It is compared, line for line, with
``tests/transcripts/<name>.txt``, so a garbled line (notes printed a letter a line), a place that
moved (an offender naming a temporary file instead of the framework's own) or a hint about another
framework fails CI. What differs from run to run is replaced before comparing: the fixture's
directory (``<DUMP>``), scratch paths (``<TMP>``), seconds and sizes (Parquet's bytes depend on the
pyarrow release, so a framework's tox env compares with the same transcript).

``RRH_UPDATE_TRANSCRIPTS=1 pytest …`` rewrites the transcripts instead; review the diff.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

TRANSCRIPTS = Path(__file__).parent / "transcripts"
UPDATE = os.environ.get("RRH_UPDATE_TRANSCRIPTS") == "1"


def normalise(text: str, replace: dict[str, str]) -> str:
    for old, new in sorted(replace.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(old, new)
    text = re.sub(r"rrh-audit-(?!report/)[A-Za-z0-9_]+", "rrh-audit-<TMP>", text)
    text = re.sub(r" in \d+\.\ds\b", " in <T>s", text)
    text = re.sub(r"\b\d+(\.\d)? (B|KiB|MiB|GiB)\b", "<SIZE>", text)
    return text


def _tables(directory: Path) -> list[str]:
    import pyarrow.parquet as pq

    out = []
    for path in sorted(directory.glob("*.parquet")):
        out.append(f"--- summary {path.name}")
        out += [
            json.dumps(row, sort_keys=True, ensure_ascii=False) for row in pq.read_table(path).to_pylist()
        ]
    return out


def transcript(capsys: pytest.CaptureFixture[str], args: list[str], dump: Path, scratch: Path) -> str:
    """``rrh audit ARGS --json … --summary …`` (serial, no progress bar), normalised (module docstring)."""
    from harness.cli import main

    report, tables = scratch / "report.json", scratch / "summary"
    argv = [
        "audit",
        *args,
        "--executor",
        "serial",
        "--no-progress",
        "--json",
        str(report),
        "--summary",
        str(tables),
    ]
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [f"$ rrh audit {' '.join(args)}", f"exit {code}", "--- stderr", *err.splitlines()]
    lines += ["--- stdout", *out.splitlines()]
    if report.exists():
        doc: dict[str, Any] = json.loads(report.read_text())
        try:
            import jsonschema
        except ImportError:  # the dev extra's; a framework's tox env may lack it
            jsonschema = None
        if jsonschema is not None:
            schema = Path(__file__).parents[1] / "harness" / "schemas" / "audit_report.schema.json"
            jsonschema.validate(doc, json.loads(schema.read_text()))
        doc["seconds"], doc["bytes_read"] = 0, 0
        lines += ["--- json", *json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False).splitlines()]
    if tables.exists():
        lines += _tables(tables)
    return normalise("\n".join(lines) + "\n", {str(dump): "<DUMP>", str(scratch): "<TMP>"})


def check(name: str, text: str) -> None:
    """``text`` equals ``tests/transcripts/NAME.txt`` (or, with ``RRH_UPDATE_TRANSCRIPTS=1``, becomes it)."""
    path = TRANSCRIPTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.is_file(), f"{path} missing: run with RRH_UPDATE_TRANSCRIPTS=1 and review it"
    expected = path.read_text()
    if text != expected:
        got, want = text.splitlines(), expected.splitlines()
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        pytest.fail(
            f"rrh audit's transcript differs from {path.name} at line {first + 1}:\n"
            f"  expected: {want[first] if first < len(want) else '<end>'}\n"
            f"  got:      {got[first] if first < len(got) else '<end>'}\n"
            "(RRH_UPDATE_TRANSCRIPTS=1 rewrites it; review the diff)",
            pytrace=False,
        )
