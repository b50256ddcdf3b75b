"""Run the invariant suites in-process against a subject and collect one outcome per test.

``rrh check`` is a thin layer over pytest: the suites in ``suites/`` are the single definition of
every invariant, and this module runs them quietly and keeps what a report needs: for each test
its invariant (the docstring's first line), PASS/FAIL/skip, and for a failure the suite's own
assertion message in plain words plus, for a property-based test, hypothesis's shrunk
counterexample reduced to a readable form (:func:`reduce_example`).
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

#: ``progress(done, total, outcome)`` is called once per finished test (``total`` is the number of
#: selected tests, known once collection is over).
ProgressCallback = Callable[[int, int, "CheckOutcome"], None]


@dataclass(frozen=True)
class CheckOutcome:
    """The result of one test of a suite.

    ``outcome`` is pytest's: ``"passed"``, ``"failed"`` or ``"skipped"``; a suite file that cannot
    even be collected is one ``"failed"`` outcome whose ``detail`` names the error. ``detail`` is the
    failure's message in plain words (first line, no ``assert …`` rewriting noise) or the skip
    reason; ``example`` is the falsifying example of a property-based test in words ("" if none).
    """

    nodeid: str
    suite: str
    invariant: str
    outcome: str  # "passed" | "failed" | "skipped"
    detail: str
    seconds: float
    example: str = ""
    capabilities: tuple[str, ...] = ()


def suites_dir() -> Path:
    """Where the installed suites live (the ``suites`` package ships with the harness)."""
    import suites

    return Path(suites.__file__).parent


# --------------------------------------------------------------------------------------------
# failure text → plain words
# --------------------------------------------------------------------------------------------

_EXAMPLE_HEAD = re.compile(r"^Falsifying(?: explicit)? example: (\w+)\((.*)$")
_HYPOTHESIS_NOISE = (
    "(note:",
    "You can reproduce this example",
    "You can add @seed",
    "Explanation:",
    "Highest target score",
    "Trying example",
)


def split_failure(message: str) -> tuple[str, str]:
    """``(message, example)`` of an exception's text as pytest reports it (``reprcrash.message``).

    ``message`` is the first line of the exception's own message without ``AssertionError:`` and
    without pytest's ``assert 11 == 7`` rewriting; other exception types keep their name
    (``ValueError: …``). A bare ``assert x`` with no message gives ``"assert x"`` (the caller may
    have something better, see :func:`failure_summary`). ``example`` is the reduced falsifying
    example hypothesis appended as a note, or ``""``.
    """
    lines = message.strip().splitlines()
    example_lines: list[str] = []
    for i, line in enumerate(lines):
        if _EXAMPLE_HEAD.match(line.strip()):
            example_lines, lines = lines[i:], lines[:i]
            break
    lines = [line for line in lines if line.strip() and not line.startswith(_HYPOTHESIS_NOISE)]
    first = lines[0].strip() if lines else ""
    for prefix in ("AssertionError: ", "AssertionError"):
        if first.startswith(prefix):
            first = first[len(prefix) :].strip()
            break
    if not first and len(lines) > 1:
        first = lines[1].strip()
    # ``+ Exception Group Traceback`` and similar framing lines say nothing: take the first real one.
    if first.startswith(("+ Exception Group", "| ")):
        real = [ln.strip(" |+-") for ln in lines if ln.strip(" |+-") and "Exception Group" not in ln]
        first = real[0] if real else first
    return first, reduce_example("\n".join(example_lines), already_said=first)


def skip_reason(text: str) -> str:
    """A skip's own reason: its first line, without hypothesis's "Failing explicit example: …" notes.

    A test skipped inside a hypothesis ``@example`` carries the example hypothesis was running in
    its message; it says nothing about why the test was skipped.
    """
    lines = [ln.strip() for ln in text.removeprefix("Skipped: ").splitlines() if ln.strip()]
    lines = [
        ln
        for ln in lines
        if not ln.startswith(("Failing explicit example", "Falsifying", *_HYPOTHESIS_NOISE))
    ]
    return lines[0] if lines else "skipped"


def reduce_example(text: str, already_said: str = "") -> str:
    """Hypothesis's ``Falsifying example: test(\\n    arg=…,\\n)`` as ``arg: …; arg=…`` in words.

    The ``subject`` argument is dropped (the report names the subject); values that are harness
    objects with a ``describe()`` (a :class:`~reference_impl.episode.Schedule`), or tuples of them, are
    described in plain words, and left out when ``already_said`` (the failure message) already
    holds that description; other values are put on one line.
    """
    lines = text.strip().splitlines()
    head = _EXAMPLE_HEAD.match(lines[0].strip()) if lines else None
    if head is None:
        return ""
    if head.group(2):  # a short example on one line: test(a=1, b=(2, 3))
        inline = head.group(2).removesuffix(")")
        lines = [lines[0], *(f"    {arg.strip()}," for arg in _split_top_level(inline)), ")"]
    args: list[tuple[str, list[str]]] = []
    for line in lines[1:]:
        if line.strip() == ")":
            break
        m = re.match(r"^    (\w+)=(.*)$", line)
        if m:
            args.append((m.group(1), [m.group(2)]))
        elif args:
            args[-1][1].append(line.strip())
    parts = []
    for name, value_lines in args:
        if name == "subject":
            continue
        value = _one_line("".join(_join(value_lines))).rstrip(",")
        value = re.sub(r",?\s*# or any other generated value$", "", value).rstrip(",")
        words = _describe(value, already_said)
        if words is None:
            parts.append(f"{name}={value}")
        elif words not in already_said:
            parts.append(f"{name}: {words}")
    return "; ".join(parts)


def _split_top_level(text: str) -> list[str]:
    """``text`` split at commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote and text[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _join(lines: list[str]) -> list[str]:
    """Continuation lines of a pretty-printed repr, joined with a space after separators only."""
    out: list[str] = []
    for line in lines:
        if out and out[-1].endswith((",", ":")):
            out.append(" ")
        out.append(line)
    return out


def _one_line(value: str) -> str:
    return re.sub(r"\s+", " ", value).strip()


def _describe(value: str, already_said: str = "") -> str | None:
    """A value's repr in words when it is (a tuple holding) a harness object that describes itself.

    Inside a tuple, a description ``already_said`` shows as "as above".
    """
    try:
        obj = _safe_eval(ast.parse(value, mode="eval").body, _describable())
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None

    def words(x: Any) -> str | None:
        describe = getattr(x, "describe", None)
        return str(describe()) if callable(describe) else None

    if isinstance(obj, tuple) and any(words(x) is not None for x in obj):
        shown = [words(x) for x in obj]
        return (
            "("
            + ", ".join(
                repr(x) if w is None else ("as above" if w and w in already_said else w)
                for x, w in zip(obj, shown, strict=True)
            )
            + ")"
        )
    return words(obj)


def _describable() -> dict[str, Any]:
    from reference_impl.episode import AttemptPlan, Schedule

    return {"Schedule": Schedule, "AttemptPlan": AttemptPlan}


def _safe_eval(node: ast.expr, known: dict[str, Any]) -> Any:
    """Literals, tuples/lists and calls of the ``known`` constructors; nothing else is evaluated."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        items = [_safe_eval(e, known) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_safe_eval(node.operand, known)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in known:
        args = [_safe_eval(a, known) for a in node.args]
        kwargs = {k.arg: _safe_eval(k.value, known) for k in node.keywords if k.arg}
        return known[node.func.id](*args, **kwargs)
    raise ValueError(f"not evaluated: {ast.dump(node)[:40]}")


def failure_summary(report: pytest.TestReport) -> tuple[str, str]:
    """``(message, example)`` of a failed test report, in plain words (see :func:`split_failure`)."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:  # a string longrepr (e.g. an internal error): its last line says most
        text = str(longrepr).strip()
        return (text.splitlines()[-1] if text else "failed"), ""
    message, example = split_failure(str(crash.message))
    if not message or message.startswith("assert "):
        # No message of its own: the failing source line says more than pytest's ``assert False``.
        source = _failing_source_line(longrepr)
        if source:
            message = f"{source} did not hold" + (f" ({message})" if message else "")
    return message or "failed", example


def _failing_source_line(longrepr: Any) -> str:
    """The ``>``-marked source line of the innermost traceback entry, or ``""``."""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", None) or []
    if not entries:
        chain = getattr(longrepr, "chain", None) or []
        entries = chain[-1][0].reprentries if chain else []
    for entry in reversed(entries):
        for line in getattr(entry, "lines", []) or []:
            if line.startswith(">"):
                return _one_line(line[1:])
    return ""


# --------------------------------------------------------------------------------------------
# the pytest run
# --------------------------------------------------------------------------------------------


def _first_paragraph(doc: str) -> str:
    """A docstring's first paragraph on one line (a sentence may wrap onto a second line)."""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(line.strip() for line in paragraph.splitlines()).strip()


class _Collector:
    """A pytest plugin object that records each test's docstring and outcome."""

    def __init__(self, progress: ProgressCallback | None = None) -> None:
        self.docs: dict[str, str] = {}
        self.outcomes: list[CheckOutcome] = []
        self.total = 0
        self._seen: set[str] = set()
        self._progress = progress

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
            label = _first_paragraph(doc) or item.name
            _, bracket, param = item.name.partition("[")
            self.docs[item.nodeid] = f"[{param} {label}" if bracket else label

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.total = len(session.items)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if not report.failed:
            return
        text = str(report.longrepr).strip().splitlines()
        error = next(
            (ln[1:].strip() for ln in reversed(text) if ln.startswith("E ")), text[-1] if text else ""
        )
        self._add(
            CheckOutcome(
                nodeid=report.nodeid,
                suite=Path(report.nodeid.split("::")[0]).stem.removeprefix("test_"),
                invariant="the suite loads",
                outcome="failed",
                detail=f"the suite could not be collected: {error}",
                seconds=0.0,
            )
        )

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # One outcome per test: the call phase, or an earlier phase that skipped or failed.
        if report.nodeid in self._seen or (report.when != "call" and report.passed):
            return
        self._seen.add(report.nodeid)
        detail, example = "", ""
        if report.skipped and isinstance(report.longrepr, tuple):
            detail = skip_reason(str(report.longrepr[2]))
        elif report.failed:
            detail, example = failure_summary(report)
            if report.when != "call":
                detail = f"{report.when} failed: {detail}"
        module = report.nodeid.split("::")[0]
        caps: Any = dict(report.user_properties).get("rr_capabilities", ())
        self._add(
            CheckOutcome(
                nodeid=report.nodeid,
                suite=Path(module).stem.removeprefix("test_"),
                invariant=self.docs.get(report.nodeid, report.nodeid.split("::")[-1]),
                outcome=report.outcome,
                detail=detail,
                seconds=report.duration,
                example=example,
                capabilities=tuple(caps),
            )
        )

    def _add(self, outcome: CheckOutcome) -> None:
        self.outcomes.append(outcome)
        if self._progress is not None:
            self._progress(len(self.outcomes), max(self.total, len(self.outcomes)), outcome)


def _suite_modules(root: Path) -> list[str]:
    """The names of the imported modules whose files lie under ``root``."""
    files = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items())}
    return [name for name, file in files.items() if file and Path(file).resolve().is_relative_to(root)]


@contextlib.contextmanager
def _fresh_suite_modules() -> Iterator[None]:
    """Import the suite modules anew for a nested run; the enclosing session's come back after.

    Hypothesis fixes a test's settings when its module is imported (``@settings(max_examples=…)``
    inherits the profile active then), so a nested run that reused an enclosing session's modules
    would run under that session's profile, not its own (a kill run would shrink and explain each
    failure: a 0.5 s kill took 45 s).
    """
    root = suites_dir().resolve()
    saved = {name: sys.modules.pop(name) for name in _suite_modules(root)}
    try:
        yield
    finally:
        for name in _suite_modules(root):
            del sys.modules[name]
        sys.modules.update(saved)


def run_suites(
    subject: str,
    *,
    select: str = "not slow and not gpu",
    paths: Sequence[str] | None = None,
    extra: Sequence[str] = (),
    keyword: str | None = None,
    progress: ProgressCallback | None = None,
) -> tuple[list[CheckOutcome], str]:
    """Run the suites against ``subject`` (a ``module:attr`` spec) and return outcomes and pytest's log.

    ``select`` is a marker expression (``-m``), ``keyword`` a ``-k`` expression (e.g. one
    transformers model family), ``extra`` further pytest arguments (``-x``,
    ``--hypothesis-seed=N``). ``progress`` is called after each test. The hypothesis profile
    active before the run is restored after it, so a run inside a test session leaves the
    session's settings alone.
    """
    from harness import pytest_plugin

    collector = _Collector(progress)
    profile = settings.get_current_profile_name()
    requested = list(pytest_plugin._requested)  # an enclosing test's own capabilities
    args = [
        *(paths or [str(suites_dir())]),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-m",
        select,
        *(["-k", keyword] if keyword else []),
        "--rr-subject",
        subject,
        *extra,
    ]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log), _fresh_suite_modules():
            pytest.main(args, plugins=[collector])
    finally:
        settings.load_profile(profile)
        pytest_plugin._requested[:] = requested
    return collector.outcomes, log.getvalue()
