"""Plain-text tables for the terminal (no dependencies): the check report's and the mismatch lab's."""

from __future__ import annotations

from collections.abc import Sequence


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
