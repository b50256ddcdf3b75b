"""The tap's per-rank manifests: which files each rank finished, and whether it closed.

A tapped run directory holds ``_tap/rank-<r>.json`` for every rank of the run, rewritten
atomically after each file the rank finishes (``harness.audit.tap.BackgroundWriter``):

    {"format": "rrh-tap-manifest", "version": 1, "rank": r, "world_size": n,
     "files": ["part-r00000-000000.parquet", ...], "last_step": s, "closed": false}

The audit reads them (``check_manifests``) to tell a run cut short (a rank whose manifest never
closed: the files it finished are whole and audited, what it was writing is lost) from a run
with data missing (a file a manifest lists is gone, a rank of ``world_size`` wrote no manifest):
the first is a note, the second an input error naming the rank and the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.atomic import atomic_write

DIRECTORY = "_tap"
FORMAT = "rrh-tap-manifest"
VERSION = 1


def manifest_path(run: str | os.PathLike[str], rank: int) -> Path:
    return Path(run) / DIRECTORY / f"rank-{rank:05d}.json"


def write_manifest(
    run: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    files: list[str],
    last_step: int | None,
    closed: bool,
) -> None:
    """Write rank ``rank``'s manifest (atomically: a reader sees the previous one or this one)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "world_size": world_size,
        "files": files,
        "last_step": last_step,
        "closed": closed,
    }
    path = manifest_path(run, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1)
    atomic_write(path, lambda handle: handle.write(text.encode()))


@dataclass
class ManifestCheck:
    """What the manifests of a run say: input errors (data missing) and notes (a run cut short)."""

    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable tap manifest ({type(err).__name__}: {err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{path}: format/version {doc.get('format')!r}/{doc.get('version')!r}; "
                         f"expected {FORMAT!r}/{VERSION}")  # fmt: skip
    for name, kind in (("rank", int), ("world_size", int), ("files", list), ("closed", bool)):
        if not isinstance(doc.get(name), kind):
            raise ValueError(f"{path}: {name} is {doc.get(name)!r}; expected a {kind.__name__}")
    return doc


def check_manifests(run: str | os.PathLike[str]) -> ManifestCheck:
    """Compare a run directory with its tap manifests (none: nothing to say, the run was not tapped)."""
    out = ManifestCheck()
    root = Path(run)
    folder = root / DIRECTORY
    if not root.is_dir() or not folder.is_dir():
        return out
    docs: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            doc = _load(path)
        except ValueError as err:
            out.errors.append(str(err))
            continue
        docs[doc["rank"]] = doc
    world = max((d["world_size"] for d in docs.values()), default=0)
    for rank in range(world):
        found = docs.get(rank)
        if found is None:
            out.errors.append(
                f"{folder}: rank {rank} of world_size {world} wrote no manifest (rank-{rank:05d}.json); "
                "expected every rank's files"
            )
            continue
        for name in found["files"]:
            if not (root / name).is_file():
                out.errors.append(
                    f"{root / name}: missing; rank {rank}'s manifest lists it (a file of the run)"
                )
        if not found["closed"]:
            last = found.get("last_step")
            out.notes.append(
                f"run cut short: rank {rank} never closed its tap (last step written: {last}); "
                f"its {len(found['files'])} finished files are audited, the file it was writing is lost"
            )
    return out
