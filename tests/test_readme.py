"""The README and the documentation site tell the truth: the README's two commands are the ones CI
runs, every command either shows is parsed by the real argument parser (or run), its generated parts
equal their sources, and the README stays a front door (at most 250 lines)."""

from __future__ import annotations

import argparse
import configparser
import re
import shlex
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
SUMMARY_BLOCK = re.compile(r"<!-- verdict summary: [^\n]*-->\n(.*?)<!-- /verdict summary -->", re.S)


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", README.read_text())


def test_readme_has_two_commands_check_then_tests() -> None:
    commands = _readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("rrh check")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    """``.ci/run`` runs the README's test command, and the site's testing page shows the same one."""
    ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_script
    assert _readme_commands()[1] in _console_commands(ROOT / "docs" / "testing.md")


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"
    )


def test_readme_verdict_summary_is_generated_from_the_fixtures() -> None:
    from harness.verdicts.tables import summary

    block = SUMMARY_BLOCK.search(README.read_text())
    assert block is not None, (
        "README.md lost its <!-- verdict summary: … --> … <!-- /verdict summary --> block"
    )
    assert block.group(1) == summary(), (
        "README verdict summary is stale: paste `python -m harness.verdicts summary`"
    )


def test_readme_subject_splices_like_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's ten-line subject runs: its imports resolve, it builds a ``Subject`` with the
    ``splice`` capability, and with a correct merge behind it it splices as the reference does."""
    import torch

    from harness.subjects import Subject
    from reference_impl.splice import Attempt, splice

    def merge_routed_experts(merged, routes, new_tokens):  # a correct framework merge, for the test
        if merged is None:
            return routes
        return torch.cat([torch.as_tensor(merged), torch.as_tensor(routes)[len(merged) :]])

    rollout = types.ModuleType("my_framework.rollout")
    rollout.merge_routed_experts = merge_routed_experts  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_framework", types.ModuleType("my_framework"))
    monkeypatch.setitem(sys.modules, "my_framework.rollout", rollout)
    (code,) = re.findall(r"```python\n(.+?)```", README.read_text(), flags=re.S)
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    subject = namespace["SUBJECT"]
    assert isinstance(subject, Subject) and subject.splice is not None
    routes = torch.arange(8 * 2 * 2).reshape(8, 2, 2)
    attempts = [Attempt(3, routes[:6], "abort"), Attempt(2, routes[:8], "stop", kind="resume")]
    assert torch.equal(torch.as_tensor(subject.splice(4, attempts)), splice(4, attempts))


def _shown_commands(path: Path) -> list[str]:
    """Every command ``path`` shows in a block: ``bash`` blocks and the ``$ `` lines of ``console``
    blocks, ``&&`` chains split."""
    text = path.read_text()
    commands = [
        line
        for block in re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)
        for line in block.replace("\\\n", " ").splitlines()  # a continued line is one command
        if line.strip() and not line.lstrip().startswith("#")  # blank lines and comments are prose
    ]
    for block in re.findall(r"```console\n(.+?)\n```", text, flags=re.S):
        commands += [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    return [part.strip() for command in commands for part in command.split("&&")]


def _inline_commands(path: Path) -> list[str]:
    """Inline code naming an ``rrh`` command or a tox env in prose: ``rrh audit --steps 0-9``,
    ``rrh check --subject``, ``tox -e vllm-cpu`` (a name or a fragment, not always a whole command)."""
    return re.findall(r"(?<!`)`((?:rrh |python -m harness |tox -e )[^`]*)`", path.read_text())


def _inline_problem(span: str) -> str | None:
    """Whether the subcommand and every ``--option`` an inline span names exist (``rrh``), or its
    env does (``tox -e``); placeholders and missing values are prose, not errors."""
    from harness.cli import build_parser

    words = span.split()
    if words[0] == "tox":
        return _problem(" ".join(words[:3]))
    parser = build_parser()
    for word in words[1:] if words[0] == "rrh" else words[3:]:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    known = {o for action in parser._actions for o in action.option_strings}
    unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in known]
    return f"{parser.prog} has no option {unknown}" if unknown else None


def _tox_envs() -> set[str]:
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    return {"py"} | {s.split(":", 1)[1] for s in tox.sections() if s.startswith("testenv:")}


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _parses(parser_factory, args: list[str]) -> str | None:  # type: ignore[no-untyped-def]
    try:
        parser_factory().parse_args(args)
    except SystemExit as stop:
        return None if stop.code == 0 else f"its parser refuses {args} (exit {stop.code})"
    return None


def _problem(command: str) -> str | None:
    """Why ``command`` is wrong, or ``None``: parsed by its own parser, or checked against the
    project (extras, tox envs, paths); a program nothing here knows is a problem too."""
    from harness.cli import build_parser
    from harness.verdicts.command import build_parser as build_verdicts_parser

    words = shlex.split(command, comments=True)
    words = next((words[:i] for i, w in enumerate(words) if w in (">", "|", "2>&1")), words)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # an environment assignment
    if words and Path(words[0]).name == "python" and words[1:2] == ["-m"]:  # any venv's python
        words = words[2:]
    program, args = words[0], words[1:]
    if Path(program).name == "rrh":  # the entry point, from any venv
        program = "rrh"
    if program in ("rrh", "harness"):
        return _parses(build_parser, args)
    if program == "harness.verdicts":
        return _parses(build_verdicts_parser, args)
    if program == "pip":
        extras = {e for spec in args for e in re.findall(r"\.\[([^\]]*)\]", spec) for e in e.split(",")}
        unknown = extras - _extras()
        return f"no extra {sorted(unknown)} in pyproject.toml" if unknown else None
    if program == "tox":
        envs = {e for i, w in enumerate(args) if args[i - 1 : i] == ["-e"] for e in w.split(",")}
        unknown = envs - _tox_envs()
        return f"no tox env {sorted(unknown)} in tox.ini" if unknown or not envs else None
    if program == "pytest":
        paths = [w.split("::")[0] for w in args if not w.startswith("-") and ("/" in w or w.endswith(".py"))]
        missing = [p for p in paths if not (ROOT / p).exists()]
        return f"no such path {missing}" if missing else None
    if program in ("mkdocs", "duckdb"):
        return None  # run: tests/test_docs.py builds the site, the audit example runs the query
    if program == "bash":
        return None if (ROOT / args[0]).is_file() else f"no script {args[0]}"
    return f"nothing checks `{program}` commands (add a check in tests/test_readme.py)"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_every_command_shown_is_parsed(path: Path) -> None:
    problems = [f"{command}: {why}" for command in _shown_commands(path) if (why := _problem(command))]
    problems += [f"`{span}`: {why}" for span in _inline_commands(path) if (why := _inline_problem(span))]
    where = path.relative_to(ROOT)
    assert not problems, f"{where} shows commands that would not run:\n" + "\n".join(problems)


def _console_commands(page: Path) -> list[str]:
    blocks = re.findall(r"```console\n(.+?)\n```", page.read_text(), flags=re.S)
    return [line[2:] for block in blocks for line in block.splitlines() if line.startswith("$ ")]
