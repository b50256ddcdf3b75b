"""The documentation site (``docs/``, ``mkdocs.yml``) builds strictly and its generated parts equal
their sources: the CLI reference (the argument parsers), the verdict table (``fixtures/verdicts/``),
the layer table (``tests/test_layering.py``'s layer map) and the module table (the files on disk)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAYERS_BLOCK = re.compile(r"(<!-- layers: [^\n]*-->\n)(.*?)(<!-- /layers -->)", re.S)


def test_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a missing page or one left out of the nav
    fails. Skipped only outside CI when MkDocs is not installed (the ``docs`` extra)."""
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("MkDocs is not installed: the CI install must include the 'docs' extra (via 'dev')")
        pytest.skip("MkDocs is not installed (pip install -e '.[docs]')")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner, not a build fault
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_cli_reference_is_generated_from_the_parsers() -> None:
    from harness.cli_reference import PAGE, REGENERATE, render

    assert (ROOT / PAGE).read_text() == render(), f"{PAGE} is stale: run `{REGENERATE}`"


def test_verdict_table_is_generated_from_the_fixtures() -> None:
    """The site's verdict table and summary come from ``fixtures/verdicts/``, never edited by hand."""
    from harness.verdicts import SITE_PAGE, summary, table

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
