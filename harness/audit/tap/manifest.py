"""The tap's per-rank manifests: which files each rank finished, and whether it closed.

A tapped run directory holds ``_tap/rank-<r>.json`` for every rank of the run, rewritten
atomically after each file the rank finishes (``harness.audit.tap.trainer.BackgroundWriter``):

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
from harness.audit.layout.inputs import brief, glob, read_json
from harness.audit.layout.schema import LayoutError

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


def load_manifest(path: Path) -> dict[str, Any]:
    """A manifest read from a regular file and checked field by field (``ValueError`` naming it)."""
    try:
        doc = read_json(path)
    except LayoutError as err:
        raise ValueError(f"not a readable tap manifest: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a JSON {type(doc).__name__}; expected a tap manifest object")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{path}: format/version {brief(doc.get('format'))}/{brief(doc.get('version'))}; "
                         f"expected {FORMAT!r}/{VERSION}")  # fmt: skip
    for name, kind in (("rank", int), ("world_size", int), ("files", list), ("closed", bool)):
        value = doc.get(name)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{path}: {name} is {brief(value)}; expected a {kind.__name__}")
    if not 0 <= doc["rank"] < doc["world_size"]:
        raise ValueError(f"{path}: rank {brief(doc['rank'])} of world_size {brief(doc['world_size'])}; "
                         "expected 0 <= rank < world_size")  # fmt: skip
    bad = [f for f in doc["files"] if not isinstance(f, str) or not _inside(f)]
    if bad:  # a list: a null entry is as bad as any other (``next(…, None)`` would pass it)
        raise ValueError(f"{path}: files lists {brief(bad[0])}; expected file names inside the run directory")
    return doc


def _inside(name: str) -> bool:
    """A file name relative to the run directory, never out of it."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts and "\0" not in name


def check_manifests(run: str | os.PathLike[str]) -> ManifestCheck:
    """Compare a run directory with its tap manifests (none: nothing to say, the run was not tapped)."""
    out = ManifestCheck()
    root = Path(run)
    folder = root / DIRECTORY
    if not root.is_dir() or not folder.is_dir():
        return out
    docs: dict[int, dict[str, Any]] = {}
    try:
        paths = glob(folder, "rank-*.json")
    except LayoutError as err:
        out.errors.append(str(err))
        return out
    for path in paths:
        try:
            doc = load_manifest(path)
        except ValueError as err:
            out.errors.append(str(err))
            continue
        docs[doc["rank"]] = doc
    world = max((d["world_size"] for d in docs.values()), default=0)
    sizes = sorted({d["world_size"] for d in docs.values()})
    if len(sizes) > 1:
        out.errors.append(f"{folder}: the manifests disagree on world_size ({sizes[:4]}); expected one")
    missing = world - len(docs)  # ranks are checked to be in [0, world_size): no rank is counted twice
    if missing:
        # Named without walking world_size (a manifest may claim 10**7 ranks): the first few missing.
        first = [r for r in range(min(world, len(docs) + 3)) if r not in docs][:3]
        out.errors.append(
            f"{folder}: {missing} of world_size {world} ranks wrote no manifest (rank "
            f"{', '.join(str(r) for r in first)}{', …' if missing > len(first) else ''}: "
            f"rank-{first[0]:05d}.json); expected every rank's files"
        )
    for rank, found in sorted(docs.items()):
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
