"""Plain-text output for the terminal (no dependencies): tables, the check report, progress."""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import TextIO

from harness.check.suites import CheckOutcome
from harness.outcomes import count_outcomes
from harness.report.markup import plain_text
from harness.report.model import MARKS, Mark
from harness.report.verdict import Verdict
from harness.table import format_table as format_table  # re-exported (callers of harness.report)

RULES: dict[str, str] = {
    "splice": "rule: reference_impl.splice.splice, DESIGN §3.4 (P = prompt length, a_j = new tokens of "
    "attempt j, Σa = a_1 + … + a_n; the spliced trace has P + Σa − 1 rows)",
    "rollout_coverage": "rule: DESIGN §3.1 coverage (P = prompt length, R = response length; rows for "
    "positions [start, P + R − 1)) and reference_impl.splice.splice, §3.4",
    "conventions": "rule: harness.conventions (the engine's payload → canonical trace), DESIGN §3.1 "
    "coverage and §3.2 validity (P = prompt length, R = response length)",
    "layouts": "rule: reference_impl.layouts, DESIGN §3.5 placement and layouts, §3.6 replay mask",
    "distributed": "rule: reference_impl.distributed (sharded forward), DESIGN §3.5 placement and layouts",
    "replay": "rule: reference_impl.routers (each family's gate-weight rule) and reference_impl.model, "
    "DESIGN §3.7 replay effect, §3.8 no silent fallback",
    "hf": "rule: harness.trainers.hf (each family's own weight rule), DESIGN §3.7 replay effect, §3.8",
    "megatron": "rule: harness.trainers.megatron (RouterReplay targets), DESIGN §3.5 and §3.7",
    "training": "rule: reference_impl.training, DESIGN §3.9 modes (R2, R3, reference log-probs)",
    "r2": "rule: reference_impl.training, DESIGN §3.9 modes (R2: record in old-log-prob, replay in update)",
    "mismatch_lab": "rule: harness.lab.reference, DESIGN §3.10 effect on the gap",
    "vllm": "rule: the same invariants on real vLLM payloads and rollouts: DESIGN §3.4 splice (the "
    "first-computed row per position), §3.1–3.2 decoding, §3.5–3.6 placement, §3.10 the lab through "
    "the subject's install_hf_replay (harness.lab.engine)",
}
"""Where each suite's rule is written down: the reference function and the DESIGN section, with
the symbols its messages use defined."""


def format_outcomes(outcomes: Sequence[CheckOutcome], width: int = 110) -> str:
    """The invariant table of ``rrh check``, then one summary line.

    Failures first, each with the suite's own message in plain words, the falsifying example
    (the counterexample the suite described) and the rule it broke (``RULES``); then the invariants
    that held on the subject; then passes that never called the subject (they check the harness,
    not the subject, and are listed apart); then skips, one line per reason (a missing capability
    names it once, however many tests needed it). Conformance tests of the harness's own backends
    (``conformance/``) follow under their own header, with their own summary line.
    """
    suites = [o for o in outcomes if not o.conformance]
    own = [o for o in outcomes if o.conformance]
    text = _format_table(suites, width) if suites or not own else ""
    if own:
        section = "conformance of the harness's own backends (no subject involved)\n"
        section += _format_table(own, width, conformance=True)
        text = f"{text}\n\n{section}" if text else section
    return text


def _format_table(outcomes: Sequence[CheckOutcome], width: int, conformance: bool = False) -> str:
    suite_w = max([len("suite"), *(len(o.suite) for o in outcomes)])
    indent = " " * (6 + 2 + suite_w + 2)
    inv_w = max(40, width - len(indent))
    lines = [f"{'result':<6}  {'suite':<{suite_w}}  invariant", f"{'-' * 6}  {'-' * suite_w}  {'-' * inv_w}"]
    wrap = textwrap.TextWrapper(width=width, initial_indent=indent + "↳ ", subsequent_indent=indent + "  ")

    def row(o: CheckOutcome, mark: str) -> None:
        text = plain_text(o.invariant)
        invariant = text if len(text) <= inv_w else text[: inv_w - 1] + "…"
        lines.append(f"{mark:<6}  {o.suite:<{suite_w}}  {invariant}")

    failed = [o for o in outcomes if o.outcome == "failed"]
    for o in failed:
        row(o, "FAIL")
        lines.extend(wrap.wrap(o.detail or "failed"))
        if o.example:
            lines.extend(wrap.wrap(f"counterexample: {o.example}"))
        if o.suite in RULES:
            lines.extend(wrap.wrap(RULES[o.suite]))
    passed = [o for o in outcomes if o.outcome == "passed"]
    for o in passed:
        if o.capabilities or conformance:
            row(o, "PASS")
    for o in passed:
        if not o.capabilities and not conformance:
            row(o, "pass")
            lines.extend(wrap.wrap("did not call the subject (checks the harness itself)"))
    skips: dict[str, list[CheckOutcome]] = {}
    for o in outcomes:
        if o.outcome == "skipped":
            skips.setdefault(o.detail or "skipped", []).append(o)
    for reason, group in skips.items():
        suites = ", ".join(dict.fromkeys(o.suite for o in group))
        lines.append(f"{'skip':<6}  {'':<{suite_w}}  {len(group)} test{'s' * (len(group) > 1)} ({suites})")
        lines.extend(wrap.wrap(reason))
    counts = count_outcomes(o.outcome for o in outcomes)
    if conformance:
        return "\n".join(lines) + f"\n\n{counts}"
    used = sum(bool(o.capabilities) for o in passed)
    summary = (
        f"{used} passed on the subject, {counts.passed - used} passed without it, {counts.failed} failed, "
        f"{counts.skipped} skipped"
    )
    return "\n".join(lines) + "\n\n" + summary


def format_failures(outcomes: Sequence[CheckOutcome], subject_spec: str) -> str:
    """How to rerun each failure on its own (the table above says what went wrong)."""
    failed = [o for o in outcomes if o.outcome == "failed"]
    if not failed:
        return ""
    lines = ["rerun a failure on its own:"]
    lines += [f"  pytest {o.nodeid} --rr-subject {subject_spec}" for o in failed]
    return "\n".join(lines)


def format_legend(legend: Mapping[Mark, str]) -> str:
    return "\n".join(f"  {mark:<4}  {text}" for mark, text in legend.items())


def format_verdict(verdict: Verdict, width: int = 100) -> str:
    """``VERDICT: PASS`` and the paragraph, wrapped."""
    head = f"verdict: {verdict.status.upper()}"
    return head + "\n" + textwrap.fill(verdict.text, width=width)


class Progress:
    """What ``rrh check`` says on ``stream`` (stderr) while one step (a suite run, a lab) runs.

    One line per step, when it ends (:meth:`finish`); on a TTY, meanwhile, a line updated in place
    counts the step's finished tests. ``verbose`` (``rrh check -v``) adds one line per finished test:
    ``[3/122] reference suites · splice PASS: invariant``. The stream is fixed when the object is
    made, so pytest's output capture does not swallow it.
    """

    def __init__(self, stream: TextIO | None = None, *, label: str = "", verbose: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.label = label
        self.verbose = verbose
        self._open = False

    def __call__(self, done: int, total: int, outcome: CheckOutcome) -> None:
        """One finished test: its line (verbose), or the in-place count (TTY)."""
        if self.verbose:
            mark = MARKS.get(outcome.outcome, outcome.outcome)
            prefix = f"{self.label} · " if self.label else ""
            self._clear()
            self.stream.write(
                f"[{done}/{total}] {prefix}{outcome.suite} {mark}: {plain_text(outcome.invariant)}\n"
            )
            self.stream.flush()
        elif self.tty:
            self.transient(f"{self.label}: {done}/{total} tests…")

    def transient(self, text: str) -> None:
        """``text`` on a line updated in place (TTY only: a log gets each step's final line alone)."""
        if not self.tty:
            return
        cols = shutil.get_terminal_size((100, 20)).columns - 1
        shown = text if len(text) <= cols else text[: cols - 1] + "…"
        self.stream.write("\r\x1b[2K" + shown)
        self.stream.flush()
        self._open = True

    def finish(self, text: str) -> None:
        """The step's one line (it replaces the in-place line on a TTY)."""
        self._clear()
        self.stream.write(text + "\n")
        self.stream.flush()

    def _clear(self) -> None:
        if self._open:
            self.stream.write("\r\x1b[2K")
            self._open = False
