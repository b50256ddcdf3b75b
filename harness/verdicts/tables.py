"""The recorded verdicts as the docs show them: the site's table (``docs/frameworks.md``) and the
README's one line per release, both generated from ``fixtures/verdicts/`` (the tests keep the pages
equal to them)."""

from __future__ import annotations

from pathlib import Path

from harness.verdicts.record import RELEASES, UNTRIAGED, VERDICTS_DIR, load


def table(directory: Path = VERDICTS_DIR) -> str:
    """The site's verdict table (``docs/frameworks.md``): one row per invariant, one column per
    subject of every recorded release, named with the releases it runs beside (``pass``, ``FAIL n``
    with failure ``n`` listed under the table, ``skip``, ``–`` not checked for that subject), then
    each failure's counterexample in one line."""
    columns: list[tuple[str, dict[str, dict[str, str]]]] = []
    for name in sorted(RELEASES):
        release = RELEASES[name]
        if (directory / f"{name}.json").exists():
            beside = "".join(f" on {dist} {version}" for dist, version in release.beside)
            for spec, entries in load(release, directory)["subjects"].items():
                columns.append((f"`{spec.rpartition(':')[2]}`{beside}", entries))
    tests = sorted({test for _, entries in columns for test in entries})
    lines = ["| invariant | " + " | ".join(c for c, _ in columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    failures: list[str] = []
    for test in tests:
        cells = []
        for column, entries in columns:
            entry = entries.get(test)
            if entry is None:
                cells.append("–")
            elif entry["verdict"] == "fail":
                failures.append(f"{len(failures) + 1}. {column}, `{test}`: {entry['detail']}")
                cells.append(f"FAIL {len(failures)}")
            else:
                cells.append(entry["verdict"])
        lines.append(f"| `{test}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(failures) + "\n"


SITE_PAGE = "docs/frameworks.md"
"""The site page with the verdict table and its triage: the README's summary links to it."""


def summary(directory: Path = VERDICTS_DIR, page: str = SITE_PAGE) -> str:
    """The README's verdict summary: one line per recorded release with its subjects, how many
    verdicts pass, fail and skip, and how many findings (distinct triages) the failures come to."""
    lines = []
    for name in sorted(RELEASES):
        release = RELEASES[name]
        if not (directory / f"{name}.json").exists():
            continue
        subjects = load(release, directory)["subjects"]
        entries = [entry for per_subject in subjects.values() for entry in per_subject.values()]
        counts = {kind: sum(e["verdict"] == kind for e in entries) for kind in ("pass", "fail", "skip")}
        findings = len({e.get("triage", UNTRIAGED) for e in entries if e["verdict"] == "fail"})
        names = ", ".join(f"`{spec.rpartition(':')[2]}`" for spec in subjects)
        failures = f"{counts['fail']} fail" + (
            f" ({findings} finding{'s' * (findings != 1)})" if counts["fail"] else ""
        )
        lines.append(
            f"- **{release.title}** ({names}): {counts['pass']} pass, "
            f"{failures}, {counts['skip']} skip — [verdicts and triage]({page})"
        )
    return "\n".join(lines) + "\n"
