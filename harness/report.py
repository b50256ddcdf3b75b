"""Plain-text tables for the terminal (no dependencies)."""

from __future__ import annotations

from collections.abc import Sequence

from harness.check import CheckOutcome

_MARK = {"passed": "PASS", "failed": "FAIL", "skipped": "skip"}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], max_width: int = 90) -> str:
    """Left-aligned columns separated by two spaces; cells longer than ``max_width`` are cut."""
    cells = [
        [str(c) if len(str(c)) <= max_width else str(c)[: max_width - 1] + "…" for c in row] for row in rows
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def format_outcomes(outcomes: Sequence[CheckOutcome]) -> str:
    """The invariant table of ``rrh check``, then one summary line."""
    rows = [(o.suite, o.invariant, _MARK.get(o.outcome, o.outcome), o.detail) for o in outcomes]
    counts = {k: sum(o.outcome == k for o in outcomes) for k in ("passed", "failed", "skipped")}
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    return format_table(("suite", "invariant", "result", "detail"), rows) + "\n\n" + summary
