"""The commands README.md and docs/*.md tell a user to type, where each one runs, and how its quoted
output is compared with what it printed (tests/test_doc_commands.py runs them).

A *shown command* is a line of a ```bash block (a line continued with a backslash is one command;
blank lines and ``#`` comment lines are prose) or the text after ``$ `` in a ```console block, whose
following lines, up to the next ``$ ``, are its *quoted output*. A ```text block right after a line
``<!-- output of: COMMAND -->`` is quoted output too (COMMAND is shown on some page). A chain
(``a && b``) is one command, run by bash as one line. A trailing ``# comment`` is kept when the
command runs (bash ignores it) and left out of the command's name in :data:`WHERE`.

:data:`WHERE` says, for every shown command, where it runs: in the default test run (``QUICK``), in a
``.ci/run`` step (``CI``, ``VLLM_RECIPE``, the framework steps) or in ``tox -e vllm-cpu`` (``VLLM``)
— or that an existing CI line already runs the same thing (:class:`SameAs`), or why it cannot run in
any test (:class:`NotRun`). A command added to a page fails ``test_every_shown_command_has_a_place``
until it has an entry.

How a command runs (:func:`run_page`): in a copy of the clone (the files git would commit: tracked
and untracked-but-not-ignored, made a git repository), with ``bash -c`` exactly as shown, with the
copy first on ``PYTHONPATH``, the test's interpreter first on ``PATH``, and ``CI=true`` (as .ci/run
runs: derandomized hypothesis). Paths under ``/tmp/`` are the page's scratch space and go to a
private directory, so that two runs never share them; what is printed is mapped back before it is
compared. After the page's commands ``git status --porcelain`` of the copy must be what it was: a
documented command writes outside the clone or where .gitignore covers.

How quoted output is compared (:func:`output_problems`): every quoted line must be a printed line,
in order; consecutive quoted lines are consecutive printed lines, and a line ``…`` alone stands for
any number of printed lines; inside a line ``…`` stands for any text. Numbers are compared exactly,
except on the lines a command's :attr:`Run.loose` patterns name — bf16 figures, which vary with the
CPU's kernels (docs/check.md), and timings — where a printed number within a factor of
:data:`LOOSE_FACTOR` of the quoted one matches (a quoted 0 must be printed 0).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LOOSE_FACTOR = 2.0
"""A loose figure (bf16, timing) matches a printed one within this factor either way."""

QUICK = "default run"
CI = ".ci/run, the CI venv (tests/test_doc_commands.py -m slow)"
VLLM_RECIPE = ".ci/run, before tox -e vllm-cpu (RRH_DOC_ENV=vllm-recipe)"
VLLM = "tox -e vllm-cpu, after verl 0.9.1 is installed beside vLLM (-m vllm)"
SGLANG = "tox -e sglang-cpu (-m sglang)"
VERL_MCORE = ".ci/run, the verl 0.9.1 + megatron-core 0.19.2 step (RRH_DOC_ENV=verl-0.9.1-mcore-0.19.2)"
SKYRL = ".ci/run, the SkyRL 0.4.0 step (RRH_DOC_ENV=skyrl-0.4.0)"
WHERES = (QUICK, CI, VLLM_RECIPE, VLLM, SGLANG, VERL_MCORE, SKYRL)

LAB = (
    r"^mismatch lab: ",
    r"^(no replay|R3)  ",
    r"^per-layer disagreement without replay: ",
    r"mismatch lab \([^)]*\): \S+ of routes flipped without replay",
)
"""The mismatch lab's lines in ``rrh check``'s output (its table, and its line while it runs): bf16
figures."""


@dataclass(frozen=True)
class Run:
    """Run the command there, as shown; it exits ``exit`` and prints what the page quotes."""

    where: str
    exit: int = 0
    loose: tuple[str, ...] = ()
    """Patterns of printed lines whose numbers are bf16 figures or timings (``LOOSE_FACTOR``)."""
    fresh_venv: bool = False
    """Run in a new virtualenv (the command installs what it needs), not the test's interpreter."""
    subject: bool = False
    """The page's ``my_subject.py`` (its ```python block) and a framework behind it on PYTHONPATH."""
    printed_in_page: bool = False
    """What it prints is a generated part of the page: it must appear there verbatim."""
    requires: tuple[str, ...] = ()
    """Programs on PATH (``duckdb``) or modules (``python -m mkdocs``) it needs from the dev extra;
    outside CI (``CI`` unset) a command whose requirement is missing is left out with a warning (a
    venv made before the extra named it), under CI it runs and fails."""
    in_process: bool = False
    """An ``rrh`` command run by ``harness.cli.main`` in the test's process (real vLLM: the engine
    starts once for the page, not once per command); the program path must be this env's ``rrh``.
    No command has a wall-clock limit: one that installs an env takes what the machine allows, and
    a hang (no CPU used by the command and its processes) is failed by the stall watch
    (``harness.testing.stall``)."""


@dataclass(frozen=True)
class SameAs:
    """An existing CI line runs the same thing (the same code path, a superset or the same selection
    with reporting flags); running both would cost minutes for nothing. ``lines`` are in ``file``."""

    file: str
    lines: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class NotRun:
    """No test can run it: why."""

    why: str


RECIPE_ONCE = "tox -e vllm-cpu --notest"
TEST_COMMAND = (
    "python -m pip install torch==2.13.0 -e '.[dev,hf,megatron,audit,ray]' && "
    "python -m pytest -n 2 --hypothesis-profile ci"
)
SGLANG_RUN = (
    "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=ci/sglang_cpu .tox/sglang-cpu/bin/rrh run runs/sglang-r3 "
    "--engine sglang --replay R3 --steps 2 && .tox/sglang-cpu/bin/rrh audit runs/sglang-r3"
)
SMALL_RUN = ".tox/vllm-cpu/bin/rrh run runs/{} --replay {} --steps {} --prompts 1 --group 2 --response-len 10"
VERL = "harness.subjects.frameworks.verl:VERL_0_9_1"
MUTANT_CHECK = "rrh check --subject harness.mutants.registry:duplication-on-resume --suite splice --no-lab"
MUTANT_KILLS = (
    'python -m pytest tests/test_mutants.py -m slow -k "pp_other or thd or unnormalised or vpp_contiguous"'
)

WHERE: dict[str, Run | SameAs | NotRun] = {
    # README.md
    "python -m pip install torch==2.13.0 -e '.[hf]' && rrh check": Run(CI, fresh_venv=True, loose=LAB),
    TEST_COMMAND: SameAs(".ci/run", (TEST_COMMAND,), "the default suite step runs it verbatim"),
    RECIPE_ONCE: Run(VLLM_RECIPE),
    ".tox/vllm-cpu/bin/rrh run runs/r3 --replay R3 --steps 2 && "
    ".tox/vllm-cpu/bin/rrh audit runs/r3 --html runs/r3.html": Run(VLLM_RECIPE),
    MUTANT_CHECK: Run(QUICK, exit=1),
    "rrh check --subject my_subject:SUBJECT": Run(CI, subject=True),
    "python -m pytest suites/ --rr-subject my_subject:SUBJECT": Run(CI, subject=True),
    # docs/audit.md
    "rrh generate /tmp/rrh-run --faults all": Run(QUICK),
    "rrh audit /tmp/rrh-run --html /tmp/rrh-audit.html --summary /tmp/rrh-summary": Run(QUICK, exit=1),
    "rrh audit runs/r3 --follow --idle 600 --html runs/r3.html --summary runs/r3-summary --tensorboard "
    "runs/r3-tb --on-violation 'cat > runs/r3-finding.json'": NotRun(
        "it follows a run being written; tests/test_audit_follow.py runs these options against a tap "
        "writer and a SkyRL dump copied step by step"
    ),
    "duckdb -c \"select step, mean_abs_diff, disagreement from '/tmp/rrh-summary/steps.parquet'\"": Run(
        QUICK, requires=("duckdb",)
    ),
    # docs/frameworks.md
    f"rrh check --subject {VERL} --suite splice": Run(VERL_MCORE, exit=1),
    "python -m harness.verdicts verl-0.9.1-mcore-0.19.2": SameAs(
        ".ci/run",
        ("verdicts -k 'verl-0.9.1-mcore-0.19.2'",),
        "tests/test_framework_verdicts.py::test_release_verdicts_match is this command's comparison "
        "(harness.verdicts.observe of the release's suites, diffed with the recorded file): 4–5 minutes",
    ),
    "python -m harness.verdicts table": Run(QUICK, printed_in_page=True),
    # docs/gate.md
    "rrh gate --engine reference": Run(CI),
    "rrh gate --engine hf": Run(CI),
    "rrh gate --engine vllm --no-suites": SameAs(
        "tox.ini",
        (
            'python -m pytest conformance/ -m vllm -k "not verl" -rs -rP -p no:logging -p no:cacheprovider '
            "--durations=0 --hypothesis-profile ci {posargs}",
        ),
        "conformance/test_engine_gate.py runs this gate (gate.observe('vllm', suites=False), then "
        "gate.run_gate against the installed release's baseline) and a tampered baseline that must fail",
    ),
    # docs/index.md
    "python -m mkdocs build --strict --site-dir /tmp/rrh-site": Run(QUICK, requires=("python -m mkdocs",)),
    "python -m mkdocs serve": NotRun(
        "a development server: it serves until stopped, on a fixed port; the build line above it "
        "builds what it serves, in the default run"
    ),
    # docs/megatron-depth.md
    "python -m pytest suites/test_megatron.py --hypothesis-profile ci": SameAs(
        ".ci/run",
        (TEST_COMMAND,),
        "the default suite step runs these tests with the same selection and profile (a superset)",
    ),
    "RRH_MEGATRON_LAYOUT=pp2thd,pp2,thd-tp2ep2 python -m pytest suites/test_megatron.py "
    "--hypothesis-profile ci": Run(CI),
    "python -m pytest suites/test_replay.py -k megatron --hypothesis-profile ci": SameAs(
        ".ci/run",
        (TEST_COMMAND,),
        "the default suite step runs these tests with the same selection and profile (a superset)",
    ),
    "RRH_MEGATRON_LAYOUT=pp2thd,thd-tp2ep2,pp2vpp2thd python -m pytest suites/test_megatron.py "
    f"--rr-subject {VERL} --hypothesis-profile ci": Run(VERL_MCORE),
    "python -m pytest tests/test_verl_agent_truncation.py -rs": SameAs(
        ".ci/run",
        ("python -m pytest tests/test_verl_agent_truncation.py -p no:cacheprovider -rs",),
        "the verl step runs it (pytest's cache plugin off)",
    ),
    "python -m pytest tests/test_skyrl_packed.py -rs": Run(SKYRL),
    MUTANT_KILLS: Run(CI),
    # docs/real-engine-suites.md
    "pytest suites/ -m gpu": Run(QUICK),
    "tox -e vllm-cpu": SameAs(".ci/run", ("python -m tox -e vllm-cpu",), "the real-vLLM step"),
    ".tox/vllm-cpu/bin/python -m pytest suites/ -m gpu --rr-subject my_subject:SUBJECT": Run(
        VLLM, subject=True
    ),
    "rrh check --subject my_subject:SUBJECT --engine vllm": Run(VLLM, subject=True),
    "tox -e sglang-cpu": SameAs(".ci/run", ("python -m tox -e sglang-cpu",), "the real-SGLang step"),
    "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=ci/sglang_cpu "
    '.tox/sglang-cpu/bin/python -m pytest suites/ -m "gpu and sglang" '
    "--rr-subject my_subject:SUBJECT": SameAs(
        "tox.ini",
        (
            'python -m pytest suites/ -m "gpu and sglang" -rs -p no:logging -p no:cacheprovider '
            "--durations=5 --hypothesis-profile ci",
        ),
        "[testenv:sglang-cpu] runs the same selection on the default subject (the reference)",
    ),
    "SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=ci/sglang_cpu:. "
    ".tox/sglang-cpu/bin/rrh check --subject my_subject:SUBJECT --engine sglang": NotRun(
        "what it runs is run in [testenv:sglang-cpu]: the SGLang engine suites (its second command) and "
        "the SGLang mismatch lab (conformance/test_engines.py::test_mismatch_lab_on_the_real_engine); "
        "the command itself is not run in CI: one more SGLang env start for the same checks"
    ),
    SGLANG_RUN: Run(SGLANG),
    "RRH_REQUIRE_ENGINES=vllm pytest suites/ -m gpu": SameAs(
        "tox.ini",
        (
            "python -m pytest suites/ -m gpu -rs -p no:logging -p no:cacheprovider --durations=5 "
            "--hypothesis-profile ci",
        ),
        "[testenv:vllm-cpu] sets RRH_REQUIRE_ENGINES = vllm and runs the same selection",
    ),
    # docs/releases-watch.md
    "tox -e mcore-0.19.2 --workdir /tmp/toxwork": SameAs(
        ".ci/run",
        (
            "verdicts -k 'not verl and mcore-0.19.2'",
            "python -m pytest tests/test_mcore_static_buffers.py -p no:cacheprovider -rs",
        ),
        "[testenv:mcore-0.19.2]'s two commands, run in .ci/run's venv after the same install "
        "(ci/install_framework.sh mcore-0.19.2)",
    ),
    "python -m harness.verdicts mcore-0.19.2": SameAs(
        ".ci/run",
        ("verdicts -k 'not verl and mcore-0.19.2'",),
        "tests/test_framework_verdicts.py::test_release_verdicts_match is this command's comparison",
    ),
    "python -m harness.verdicts mcore-0.19.2 --record": NotRun(
        "rewrites fixtures/verdicts/mcore-0.19.2.json, the recorded verdicts the tests compare with: "
        "a maintainer's step after triage"
    ),
    "python -m harness.verdicts mcore-0.19.2 --suites test_megatron.py --record": NotRun(
        "rewrites fixtures/verdicts/mcore-0.19.2.json (see --record)"
    ),
    "python -m harness.verdicts mcore-0.19.2 --new --record": NotRun(
        "rewrites fixtures/verdicts/mcore-0.19.2.json (see --record); --new's collection is "
        "tests/test_framework_verdicts.py::test_new_finds_the_tests_a_recording_holds_no_verdict_for"
    ),
    "python -m harness.verdicts releases": NotRun(
        "asks the package index live: its answer changes whenever a tracked distribution publishes "
        "(and takes 78 s to 18 minutes); the --index-answer line runs the same code on a recorded answer"
    ),
    "python -m harness.verdicts releases --save-answer /tmp/rrh-index-answer.json": NotRun(
        "asks the package index live (see releases)"
    ),
    "python -m harness.verdicts releases --index-answer fixtures/releases/index-answer.json": Run(QUICK),
    # docs/tap-and-run.md
    SMALL_RUN.format("r3", "R3", 2): Run(VLLM, in_process=True),
    SMALL_RUN.format("r2", "R2", 2): Run(VLLM, in_process=True),
    SMALL_RUN.format("none", "none", 2): Run(VLLM, in_process=True),
    SMALL_RUN.format("skip", "R3", 2) + " --subject harness.mutants.registry:hf-one-layer-unreplayed": Run(
        VLLM, in_process=True
    ),
    SMALL_RUN.format("latest", "R3", 2) + " --splice latest": Run(VLLM, in_process=True),
    SMALL_RUN.format("cp", "R3", 1) + " --ranks 2 --split cp": Run(VLLM, in_process=True),
    SMALL_RUN.format("halo", "R3", 1) + " --ranks 2 --split sp-halo": Run(VLLM, in_process=True),
    ".tox/vllm-cpu/bin/rrh audit runs/r3 --html runs/r3.html": Run(VLLM, in_process=True),
    ".tox/verl-0.9.1/bin/rrh run runs/verl --replay R3 --steps 2 --engine-from runs/r3 "
    f"--subject {VERL}": Run(VLLM, in_process=True),
    "rrh audit runs/verl": Run(VLLM, exit=1, in_process=True),
    "rrh bench tap": Run(CI),
}
"""Every shown command (its trailing comment left out) and where it runs."""

NEEDS_VERL = (VERL,)
"""A command naming one of these needs verl installed (in tox -e vllm-cpu: after its verl install)."""


@dataclass(frozen=True)
class Shown:
    """A command shown on a page, and the output the page quotes for it (``None``: none quoted)."""

    page: Path
    line: int
    text: str
    """As shown (continuations joined), trailing comment included."""
    output: str | None = None

    @property
    def name(self) -> str:
        """The command without its trailing comment: its key in :data:`WHERE`."""
        return strip_comment(self.text)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass
class Quoted:
    """A ```text block marked ``<!-- output of: COMMAND -->``."""

    page: Path
    line: int
    command: str
    text: str


def strip_comment(command: str) -> str:
    """``command`` without a trailing ``# comment`` (a ``#`` after whitespace, outside quotes)."""
    quote = None
    for i, c in enumerate(command):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or command[i - 1].isspace()):
            return command[:i].rstrip()
    return command.strip()


FENCE = re.compile(r"^```(\w*)\s*$")
OUTPUT_MARK = re.compile(r"^<!-- output of: (.+) -->$")
TRANSCRIPT_MARK = re.compile(r"^<!-- excerpt of: (tests/transcripts/\S+\.txt), <DUMP> = (\S+) -->$")
"""A quoted audit excerpt of a committed golden transcript (tests/test_audit_transcripts.py compares
the transcript with what the audit prints): every line of the block is a line of the transcript
with ``<DUMP>`` spelled as on the page, a line ending in ``…`` a prefix of one."""


def _fenced(page: Path) -> list[tuple[str, int, list[str], str]]:
    """Each fenced block: (language, line number of its first line, its lines, the line above it)."""
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        blocks.append((opened.group(1), i + 2, lines[i + 1 : end], lines[i - 1] if i else ""))
        i = end + 1
    return blocks


def shown_commands(page: Path) -> list[Shown]:
    found: list[Shown] = []
    for language, first, lines, _ in _fenced(page):
        if language == "bash":
            i = 0
            while i < len(lines):
                start, text = i, lines[i]
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1].rstrip() + " " + lines[i].strip()
                i += 1
                if text.strip() and not text.lstrip().startswith("#"):
                    found.append(Shown(page, first + start, text.strip()))
        elif language == "console":
            starts = [k for k, line in enumerate(lines) if line.startswith("$ ")]
            for n, k in enumerate(starts):
                end = starts[n + 1] if n + 1 < len(starts) else len(lines)
                output = "\n".join(lines[k + 1 : end])
                found.append(Shown(page, first + k, lines[k][2:].strip(), output or None))
    return found


def quoted_outputs(page: Path) -> list[Quoted]:
    """The ```text blocks marked as a shown command's output."""
    return [
        Quoted(page, first, mark.group(1), "\n".join(lines))
        for language, first, lines, above in _fenced(page)
        if language == "text" and (mark := OUTPUT_MARK.match(above))
    ]


def unmarked_text_blocks(page: Path) -> list[int]:
    """Line numbers of ```text blocks without an ``output of`` mark (docs/cli.md's help texts are
    generated from the parsers and compared by tests/test_docs.py)."""
    if page.name == "cli.md":
        return []
    return [
        first
        for language, first, _, above in _fenced(page)
        if language == "text" and not OUTPUT_MARK.match(above) and not TRANSCRIPT_MARK.match(above)
    ]


def transcript_excerpt_problems(page: Path, root: Path) -> list[str]:
    """Lines of the page's transcript excerpts that their transcript does not hold (sizes and times
    compared as the transcript's ``<SIZE>`` and ``<T>``)."""
    problems = []
    for language, first, lines, above in _fenced(page):
        mark = TRANSCRIPT_MARK.match(above)
        if language != "text" or not mark:
            continue
        text = (root / mark.group(1)).read_text().replace("<DUMP>", mark.group(2))
        held = text.splitlines()
        for offset, line in enumerate(lines):
            want = re.sub(r"\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "<SIZE>", line)
            want = re.sub(r" in \d+(\.\d+)?s\b", " in <T>s", want)
            cut = want.endswith(("…", "(…)"))  # cut there, as `…` or `(…)`
            want = want.removesuffix("(…)").removesuffix("…").rstrip() if cut else want
            if not any(h.startswith(want) if cut else h == want for h in held):
                problems.append(f"{page.name}:{first + offset}: not in {mark.group(1)}: {line}")
    return problems


def page_python_subject(page: Path) -> str | None:
    """The page's ```python block that defines ``SUBJECT`` (``my_subject.py``), if any."""
    for language, _, lines, _ in _fenced(page):
        code = "\n".join(lines) + "\n"
        if language == "python" and "\nSUBJECT = " in code:
            return code
    return None


# ---------------------------------------------------------------------------- comparing output

NUMBER = re.compile(r"(?<![A-Za-z0-9_.])\d+(?:\.\d+)?(?:e[-+]\d+)?(?![A-Za-z0-9_])")


def _line_pattern(quoted: str) -> tuple[re.Pattern[str], list[str]]:
    """A regex for the printed lines ``quoted`` stands for (``…`` any text, each number a group),
    and the quoted numbers in order."""
    parts, numbers = [], []
    for k, piece in enumerate(quoted.split("…")):
        if k:
            parts.append(".*?")
        last = 0
        for m in NUMBER.finditer(piece):
            parts.append(re.escape(piece[last : m.start()]) + r"(\S+?)")
            numbers.append(m.group())
            last = m.end()
        parts.append(re.escape(piece[last:]))
    tail = r"(?![0-9.])" if NUMBER.search(quoted.split("…")[-1]) else ""
    return re.compile("".join(parts) + tail), numbers


def _number_matches(quoted: str, printed: str, loose: bool) -> bool:
    if quoted == printed:
        return True
    if not loose:
        return False
    try:
        q, p = float(quoted), float(printed)
    except ValueError:
        return False
    if q == 0 or p == 0:
        return False
    return 1 / LOOSE_FACTOR <= p / q <= LOOSE_FACTOR


def line_matches(quoted: str, printed: str, loose: tuple[str, ...] = ()) -> bool:
    pattern, numbers = _line_pattern(quoted)
    found = pattern.fullmatch(printed)
    if found is None:
        return False
    is_loose = any(re.search(p, printed) for p in loose)
    return all(_number_matches(q, p, is_loose) for q, p in zip(numbers, found.groups(), strict=True))


def output_problems(quoted: str, printed: str, loose: tuple[str, ...] = ()) -> list[str]:
    """Why ``quoted`` is not what ``printed`` shows (empty: it is). See the module docstring."""
    segments: list[list[str]] = [[]]
    for line in quoted.splitlines():
        if line.strip() == "…":
            segments.append([])
        else:
            segments[-1].append(line.rstrip())
    segments = [s for s in segments if s]
    lines = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for segment in segments:
        start = next(
            (
                i
                for i in range(at, len(lines) - len(segment) + 1)
                if all(line_matches(q, lines[i + k], loose) for k, q in enumerate(segment))
            ),
            None,
        )
        if start is None:
            return [_nearest_miss(segment, lines, at, loose)]
        at = start + len(segment)
    return []


def _nearest_miss(segment: list[str], lines: list[str], at: int, loose: tuple[str, ...]) -> str:
    """Say which quoted line of ``segment`` is not printed: the first one that differs where the
    segment's first line is printed, or the first line itself."""
    first = next((i for i in range(at, len(lines)) if line_matches(segment[0], lines[i], loose)), None)
    if first is None:
        return f"quoted line {segment[0]!r} is not printed (after printed line {at})"
    for k, quoted in enumerate(segment):
        got = lines[first + k] if first + k < len(lines) else "(end of output)"
        if not line_matches(quoted, got, loose):
            return f"quoted line {quoted!r}, printed there: {got!r}"
    return f"quoted lines from {segment[0]!r} are not printed"  # unreachable: the segment matched


# ---------------------------------------------------------------------------- running


@dataclass
class Ran:
    command: Shown
    exit: int
    printed: str
    seconds: float


@dataclass
class Workspace:
    """A copy of the clone, made a git repository, and a private scratch directory for ``/tmp/``."""

    root: Path
    scratch: Path
    env: dict[str, str] = field(default_factory=dict)
    status: str = ""

    def git_status(self) -> str:
        return subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all"],
            cwd=self.root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout


def _committable_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [f for f in listed.split("\0") if f and (ROOT / f).is_file()]


def workspace(tmp: Path) -> Workspace:
    """A copy of the clone as a fresh clone would have it (the files git would commit), its own git
    repository with everything staged, so that ``git status`` shows what the commands leave."""
    root, scratch = tmp / "clone", tmp / "scratch"
    scratch.mkdir(parents=True)
    for name in _committable_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    quiet = {"GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp)}
    for args in (["init", "-q"], ["add", "-A"]):
        subprocess.run(["git", *args], cwd=root, check=True, env={**os.environ, **quiet})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(
        CI="true",
        PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        NO_MKDOCS_2_WARNING="1",
    )
    space = Workspace(root, scratch, env)
    space.status = space.git_status()
    return space


SUBJECT_FRAMEWORK = '''"""A framework's partial-rollout merge behind the page's my_subject.py
(tests/doc_commands.py): each engine call adds the rows of its own new positions."""

import torch


def merge_routed_experts(merged, routes, new_tokens):
    if new_tokens == 0:  # nothing new: keep what is merged (an empty start if nothing is yet)
        return torch.as_tensor(routes)[:0] if merged is None and routes is not None else merged
    if routes is None:
        raise ValueError("an attempt that added tokens returned no routes")
    routes = torch.as_tensor(routes)
    if merged is None or len(merged) == 0:  # the first call that adds tokens: its whole payload
        return routes
    merged = torch.as_tensor(merged)
    if len(routes) != len(merged) + new_tokens:
        raise ValueError(f"payload has {len(routes)} rows, expected {len(merged) + new_tokens}")
    return torch.cat([merged, routes[len(merged) :]])
'''


def add_subject(space: Workspace, page: Path) -> None:
    """The page's ``my_subject.py`` and the framework it imports, on the commands' PYTHONPATH (a
    user's own files, outside the clone)."""
    code = page_python_subject(page) or page_python_subject(ROOT / "README.md")  # the README's
    assert code is not None, "README.md lost its ten-line my_subject.py"
    user = space.scratch.parent / "user"
    (user / "my_framework").mkdir(parents=True)
    (user / "my_subject.py").write_text(code)
    (user / "my_framework" / "__init__.py").write_text("")
    (user / "my_framework" / "rollout.py").write_text(SUBJECT_FRAMEWORK)
    space.env["PYTHONPATH"] = os.pathsep.join([str(user), *filter(None, [space.env.get("PYTHONPATH")])])


def fresh_venv(space: Workspace) -> None:
    """A new virtualenv for the commands: its ``python`` first on PATH, no PYTHONPATH (nothing of
    the test's environment is importable). ``run_page`` removes it when the page is done: a torch
    install is ~2 GB that CI's later environments need on the same disk."""
    venv = space.scratch.parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    space.env["PATH"] = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")])
    space.env["VIRTUAL_ENV"] = str(venv)
    space.env.pop("PYTHONPATH", None)


def _in_process(text: str, space: Workspace) -> tuple[int, str]:
    """An ``rrh`` command run through ``harness.cli.main`` in this process, in the copy."""
    import contextlib
    import shlex
    import tempfile

    from harness.cli import main

    words = shlex.split(text, comments=True)
    env_bin = Path(sys.prefix) / "bin"
    program = words[0]
    if program != "rrh":
        link = (space.root / program).parent
        assert link.resolve() == env_bin.resolve(), f"{program}: not this environment's rrh ({env_bin})"
    # A real file, not a StringIO: vLLM silences C libraries through sys.stdout.fileno().
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    cwd, path = Path.cwd(), list(sys.path)
    os.chdir(space.root)
    try:
        with out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                status = main(words[1:])
            except SystemExit as stop:
                status = stop.code if isinstance(stop.code, int) else 1
            out.flush()
            out.seek(0)
            printed = out.read()
    finally:
        os.chdir(cwd)
        sys.path[:] = path  # rrh puts the current directory on it
    return status, printed


def _available(requirement: str, space: Workspace) -> bool:
    """``python -m NAME`` (a module of the test's interpreter) or ``NAME`` (a program on PATH)."""
    import importlib.util

    if requirement.startswith("python -m "):
        return importlib.util.find_spec(requirement.removeprefix("python -m ")) is not None
    return shutil.which(requirement, path=space.env["PATH"]) is not None


def run_command(command: Shown, entry: Run, space: Workspace) -> Ran:
    import time

    text = command.text.replace("/tmp/", f"{space.scratch}/")
    began = time.monotonic()
    if entry.in_process:
        status, printed = _in_process(text, space)
    else:
        done = subprocess.run(
            ["bash", "-c", text],
            cwd=space.root,
            env=space.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        status, printed = done.returncode, done.stdout
    printed = printed.replace(f"{space.scratch}/", "/tmp/")
    return Ran(command, status, printed, time.monotonic() - began)


def quotes_of(name: str) -> list[tuple[str, str]]:
    """Every output the pages quote for the command ``name``: (where, quoted text)."""
    found = []
    for page in PAGES:
        found += [(c.where, c.output) for c in shown_commands(page) if c.name == name and c.output]
        found += [
            (f"{q.page.relative_to(ROOT)}:{q.line}", q.text)
            for q in quoted_outputs(page)
            if strip_comment(q.command) == name
        ]
    return found


def problems_of(ran: Ran, entry: Run) -> list[str]:
    """What is wrong with what ``ran`` did: its exit status, the outputs the pages quote for it."""
    command = ran.command
    tail = "\n".join(ran.printed.splitlines()[-40:])
    if ran.exit != entry.exit:
        return [f"{command.where}: `{command.text}` exited {ran.exit}, expected {entry.exit}:\n{tail}"]
    found = []
    for where, text in quotes_of(command.name):
        for why in output_problems(text, ran.printed, entry.loose):
            found.append(
                f"{where}: the output quoted for `{command.text}` differs: {why}\nprinted:\n{ran.printed}"
            )
    if entry.printed_in_page and ran.printed not in command.page.read_text():
        found.append(f"{command.where}: what `{command.text}` prints is not in the page:\n{ran.printed}")
    return found


def commands_for(where: str) -> dict[Path, list[Shown]]:
    """The pages with commands that run ``where``, each page's in page order. A command shown on
    several pages runs once, with the first page's (README.md's) commands; every page's quotes of
    its output are compared with what it printed."""
    pages: dict[Path, list[Shown]] = {}
    seen: set[str] = set()
    for page in PAGES:
        for command in shown_commands(page):
            entry = WHERE.get(command.name)
            if isinstance(entry, Run) and entry.where == where and command.name not in seen:
                seen.add(command.name)
                pages.setdefault(page, []).append(command)
    return pages


def run_page(
    page: Path, commands: list[Shown], tmp: Path, *, prepare=None, before_each=None
) -> tuple[list[str], list[Ran]]:  # type: ignore[no-untyped-def]
    """Run ``commands`` (``page``'s, in order) in one fresh workspace; return the problems found
    (exit statuses, quoted outputs, files left in the clone) and what each printed."""
    space = workspace(tmp)
    entries = [WHERE[c.name] for c in commands]
    if any(isinstance(e, Run) and e.fresh_venv for e in entries):
        fresh_venv(space)
    try:
        if any(isinstance(e, Run) and e.subject for e in entries):
            add_subject(space, page)
        if prepare is not None:
            prepare(space)
        space.status = space.git_status()  # what the commands leave is compared with this
        problems: list[str] = []
        done: list[Ran] = []
        for command, entry in zip(commands, entries, strict=True):
            assert isinstance(entry, Run)
            if before_each is not None:
                before_each(command)
            missing = [r for r in entry.requires if not _available(r, space)]
            if missing and not os.environ.get("CI"):
                import warnings

                not_run = f"{command.where}: `{command.text}` not run: {missing} not installed"
                warnings.warn(not_run, stacklevel=1)
                continue
            ran = run_command(command, entry, space)
            done.append(ran)
            problems += problems_of(ran, entry)
        left = sorted(set(space.git_status().splitlines()) - set(space.status.splitlines()))
        if left:
            where = f"{page.name}'s commands left files in the clone"
            problems.append(f"{where} (git status --porcelain): {left}")
        return problems, done
    finally:
        shutil.rmtree(space.scratch.parent / "venv", ignore_errors=True)
