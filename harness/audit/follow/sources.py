"""What a followed run has finished writing: the run-layout files ready to audit, and the last step
known complete, decided from what the writer guarantees, never by reading a half-written file.

- ``LayoutSource``, the run layout (``rrh run``'s tap, ``RunWriter``): a file under its final name
  is whole (the writer renames it when complete); a step is complete once every rank's manifest
  (``_tap/rank-<r>.json``) has moved past it or closed, and without manifests once a later step has
  been seen;
- ``DumpSource``, a framework's dump (FACTS §7): a step's files are ready once a later step's file
  has appeared (frameworks write step N + 1 after step N) or when none of them changed for
  ``settle`` seconds (the quiet period, for the last step); each ready step is imported once into
  the run layout through the framework's importer, so a file that stays broken is one input error.

``poll(final=True)`` takes everything present as complete: the run is over.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.atomic import TMP_MARK
from harness.audit.layout.inputs import glob
from harness.audit.layout.reader import run_files
from harness.audit.layout.schema import LayoutError


@dataclass
class Poll:
    """One look at a run: the layout files not audited before, and the input errors met."""

    files: list[Path] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class LayoutSource:
    """A run-layout directory being written (see the module docstring)."""

    def __init__(self, run: str | os.PathLike[str]) -> None:
        self.run = Path(run)
        self._seen: set[Path] = set()
        self._errors: list[str] = []

    def poll(self, final: bool = False) -> Poll:
        """The files that appeared since the last poll (``final``: the same; a file is whole or absent)."""
        out = Poll(errors=self._errors)
        self._errors = []
        try:
            files = run_files(self.run, out.errors)
        except LayoutError:  # nothing written yet (no folder, or no layout file in it)
            files = []
        out.files = [f for f in files if f not in self._seen]
        self._seen.update(out.files)
        return out

    def complete(self, latest: int | None, final: bool = False) -> int | None:
        """The last step complete, ``latest`` the highest step audited (``None``: none yet)."""
        if final or latest is None:
            return latest
        manifests = self._manifest_through(self._errors)
        return latest - 1 if manifests is None else min(manifests, latest)

    def _manifest_through(self, errors: list[str]) -> int | None:
        """The last step every rank of the tap's manifests has finished (``None``: no manifest yet)."""
        from harness.audit.tap.manifest import DIRECTORY, load_manifest

        folder = self.run / DIRECTORY
        if not folder.is_dir():
            return None
        docs = []
        for path in sorted(folder.glob("rank-*.json")):
            if TMP_MARK in path.name:
                continue
            try:
                docs.append(load_manifest(path))
            except ValueError as err:  # a damaged manifest: an input error, and no step known complete
                errors.append(str(err))
                return -1
        if not docs:
            return None
        world = max(int(d["world_size"]) for d in docs)
        if len({int(d["rank"]) for d in docs}) < world:
            return -1  # a rank has not written its first manifest: no step is complete yet
        open_steps = [d["last_step"] for d in docs if not d["closed"]]
        if not open_steps:
            return 2**62  # every rank closed: every step it wrote is complete
        return min(s if isinstance(s, int) and not isinstance(s, bool) else -1 for s in open_steps)


_NEMO_STEP = re.compile(r"train_data_step(\d+)\.jsonl")
_NUMBERED = re.compile(r"(\d+)\.pt")


@dataclass(frozen=True)
class DumpStep:
    """One step of a framework's dump: the file its importer is given (read alone, its name is the one
    offenders name, as in a one-shot audit), every file the step consists of (watched for changes) and
    the importer's options for it (slime's train dump)."""

    entry: Path
    files: tuple[Path, ...]
    options: tuple[tuple[str, Any], ...] = ()


def step_files(name: str, dump: Path) -> dict[int, DumpStep]:
    """Each step of framework ``name``'s dump at the folder ``dump``, as the framework names its files
    (FACTS §7); ``LayoutError`` for a dump that cannot be followed."""
    out: dict[int, DumpStep] = {}
    if name not in ("skyrl", "verl", "nemo_rl", "slime"):
        raise LayoutError(
            f"--follow: a {name} dump cannot be followed; expected the run layout or a skyrl, verl, slime "
            "or nemo_rl dump folder"
        )
    if not dump.is_dir():  # not written yet
        return out
    if name == "skyrl":
        from harness.audit.importers import skyrl

        out = {step: DumpStep(file, (file,)) for step, file in skyrl.dump_files(dump)}
    elif name == "verl":
        from harness.audit.importers import verl

        for file in verl.dump_files(dump):
            if file.parent.name.isdigit():  # RolloutSkip's {step}/ folder: gen_batch.dp and meta.json
                files = tuple(p for p in sorted(file.parent.iterdir()) if p.is_file())
                out[int(file.parent.name)] = DumpStep(file, files)
    elif name == "nemo_rl":
        for file in glob(dump, "train_data_step*.jsonl"):
            if m := _NEMO_STEP.fullmatch(file.name):
                out[int(m.group(1))] = DumpStep(file, (file,))
    else:  # slime
        rollouts, train = dump / "rollout_data", dump / "train_data"
        folder = rollouts if rollouts.is_dir() else dump
        for file in glob(folder, "*.pt") if folder.is_dir() else []:
            if m := _NUMBERED.fullmatch(file.name):
                paired = train / file.name
                files = (file, paired) if paired.exists() else (file,)
                options = (("train", train),) if train.is_dir() else ()
                out[int(m.group(1))] = DumpStep(file, files, options)
    return out


def _signature(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    """What says a file changed: its name, size and modification time."""
    out = []
    for f in files:
        try:
            info = f.stat()
        except OSError:
            out.append((str(f), -1, -1))
            continue
        out.append((str(f), info.st_size, info.st_mtime_ns))
    return tuple(out)


class DumpSource:
    """A framework's dump folder being written (see the module docstring). Each ready step is imported
    into ``target``/``step-<N>`` with ``import_step(step, into, errors)``; ``ready(step, final)``, when
    given, must also hold (``harness.audit.follow.trace_tail``: the trainer trace's records of it)."""

    def __init__(
        self,
        name: str,
        dump: Path,
        target: Path,
        import_step: Callable[[DumpStep, Path, list[str]], Any],
        settle: float,
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[int, bool], bool] | None = None,
    ) -> None:
        if dump.exists() and not dump.is_dir():
            raise LayoutError(
                f"--follow: {dump} is a file; expected the folder the framework writes its dump into"
            )
        step_files(name, dump)  # a dump that cannot be followed is refused now
        self.name, self.dump, self.target = name, dump, target
        self.import_step, self.settle, self.clock = import_step, settle, clock
        self.ready = ready
        self._changed: dict[int, tuple[Any, float]] = {}
        self._imported: set[int] = set()
        self._complete: int | None = None
        self.files_read = 0

    def poll(self, final: bool = False) -> Poll:
        """Import the steps ready (``final``: every step present) and return their layout files."""
        out = Poll()
        steps = step_files(self.name, self.dump)
        now = self.clock()
        newest = max(steps, default=None)
        for step in sorted(s for s in steps if s not in self._imported):
            signature = _signature(list(steps[step].files))
            held = self._changed.get(step)
            if held is None or held[0] != signature:
                self._changed[step] = held = (signature, now)
            quiet = now - held[1] >= self.settle
            if not (final or quiet or (newest is not None and step < newest)):
                break  # steps are imported in order: a later one waits for this one
            if self.ready is not None and not self.ready(step, final):
                break  # what else the step needs (the trainer trace's records of it) is not complete
            out.files.extend(self._import(step, steps[step], out.errors))
        pending = [s for s in steps if s not in self._imported]
        done = [s for s in self._imported if not pending or s < min(pending)]
        self._complete = max(done, default=None)
        return out

    def complete(self, latest: int | None, final: bool = False) -> int | None:
        """The last step imported with every step before it (``final``: ``latest``)."""
        return latest if final else self._complete

    def _import(self, step: int, files: DumpStep, errors: list[str]) -> list[Path]:
        """Import one step; what cannot be imported is an input error, and the step is not read again."""
        into = self.target / f"step-{step}"
        written: list[Path] = []
        try:
            written = list(self.import_step(files, into, errors))
        except LayoutError as err:
            errors.append(str(err))
        self._imported.add(step)
        self._changed.pop(step, None)
        self.files_read += len(files.files)
        return written
