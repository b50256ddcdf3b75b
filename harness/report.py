"""Plain-text output for the terminal (no dependencies): tables, the check report, progress."""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

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


def format_outcomes(outcomes: Sequence[CheckOutcome], width: int = 110) -> str:
    """The invariant table of ``rrh check``, then one summary line.

    One row per invariant (result, suite, invariant). Under a FAIL row, indented: the suite's own
    message in plain words and the falsifying example (hypothesis's shrunk counterexample); under a
    skip row, the reason.
    """
    suite_w = max([len("suite"), *(len(o.suite) for o in outcomes)])
    indent = " " * (6 + 2 + suite_w + 2)
    inv_w = max(40, width - len(indent))
    lines = [f"{'result':<6}  {'suite':<{suite_w}}  invariant", f"{'-' * 6}  {'-' * suite_w}  {'-' * inv_w}"]
    wrap = textwrap.TextWrapper(width=width, initial_indent=indent + "↳ ", subsequent_indent=indent + "  ")
    for o in outcomes:
        invariant = o.invariant if len(o.invariant) <= inv_w else o.invariant[: inv_w - 1] + "…"
        lines.append(f"{_MARK.get(o.outcome, o.outcome):<6}  {o.suite:<{suite_w}}  {invariant}")
        if o.outcome == "failed":
            lines += wrap.wrap(o.detail or "failed")
            if o.example:
                lines += wrap.wrap(f"counterexample: {o.example}")
        elif o.outcome == "skipped" and o.detail:
            lines += wrap.wrap(o.detail)
    counts = {k: sum(o.outcome == k for o in outcomes) for k in ("passed", "failed", "skipped")}
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    return "\n".join(lines) + "\n\n" + summary


def format_failures(outcomes: Sequence[CheckOutcome], subject_spec: str) -> str:
    """How to rerun each failure on its own (the table above says what went wrong)."""
    failed = [o for o in outcomes if o.outcome == "failed"]
    if not failed:
        return ""
    lines = ["rerun a failure on its own:"]
    lines += [f"  pytest {o.nodeid} --rr-subject {subject_spec}" for o in failed]
    return "\n".join(lines)


def format_legend(legend: Mapping[str, str]) -> str:
    return "\n".join(f"  {mark:<4}  {text}" for mark, text in legend.items())


def format_verdict(verdict: Mapping[str, str], width: int = 100) -> str:
    """``VERDICT: PASS`` and the paragraph, wrapped."""
    head = f"verdict: {verdict['status'].upper()}"
    return head + "\n" + textwrap.fill(verdict["text"], width=width)


class Progress:
    """One line per finished test on ``stream`` (stderr): updated in place on a TTY, plain lines otherwise.

    The stream is fixed when the object is made, so pytest's output capture does not swallow it.
    """

    def __init__(self, stream: TextIO | None = None, *, prefix: str = "") -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.prefix = prefix
        self._open = False

    def __call__(self, done: int, total: int, outcome: CheckOutcome) -> None:
        mark = _MARK.get(outcome.outcome, outcome.outcome)
        self.line(f"[{done}/{total}] {self.prefix}{outcome.suite} {mark}: {outcome.invariant}")

    def line(self, text: str) -> None:
        if self.tty:
            cols = shutil.get_terminal_size((100, 20)).columns - 1
            shown = text if len(text) <= cols else text[: cols - 1] + "…"
            self.stream.write("\r\x1b[2K" + shown)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        """End the in-place line (TTY) so the next output starts on a fresh line."""
        if self._open:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._open = False


def describe_counts(counts: Mapping[str, Any]) -> str:
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
