"""Recorded verdicts of released framework code (``fixtures/verdicts/<release>.json``).

A verdict is what the invariant suites say about one subject of ``harness.subjects.frameworks``:
for every test that exercised (or skipped for lack of) one of its capabilities, ``pass``, ``fail``
with the counterexample in one line and its triage (the upstream issue/PR, or the finding
described from the release's source), or ``skip`` naming the missing capability. Tests that use no
capability of the subject check the harness itself and are left out.

``python -m harness.verdicts RELEASE`` (``harness.verdicts.command``) observes the installed
release's subjects and compares them with the recorded file: exit 0 when every verdict matches, 1
with a readable diff when one changed (a new release that fixes or breaks something), 2 when it
cannot run. ``--record`` writes the observation, keeping the triage of failures that stay failures;
a new failure is recorded ``UNTRIAGED`` and the env stays red until someone explains it from the
source.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import HarnessError

VERDICTS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "verdicts"
UNTRIAGED = "UNTRIAGED"
SELECT = "not slow and not gpu and not distributed"
"""The tests a verdict covers: the default CPU selection without multi-process groups."""
MEGATRON = "not slow and not gpu"
"""With the Megatron suite, whose default layouts spawn one and two gloo ranks."""

VERL_SUITES = ("test_splice.py", "test_layouts.py", "test_replay.py", "test_hf.py", "test_megatron.py")
"""Every verl release's suites: splice, placement, VeOmni replay on transformers, Megatron R2/R3."""
VERL_KEYWORD = "not (test_replay and megatron)"
"""verl's verdicts leave out the replay suite's Megatron kind (``test_replay.py[megatron…]``): verl's
patched ``RouterReplay`` keeps every router it saw in a class-level list, so each in-process one-rank
world's gloo groups stay alive (hundreds of spinning threads over a recording, measured here). verl's
Megatron R2/R3 is judged by ``test_megatron.py``, whose ranks are fresh processes."""


class VerdictError(HarnessError, ValueError):
    """A verdict file is missing or malformed."""


@dataclass(frozen=True)
class Release:
    """One release under test: its PyPI pin, the subjects that wrap it, the tox env that installs it."""

    name: str  # file stem and tox env: "verl-0.9.1"
    distribution: str
    version: str
    subjects: tuple[str, ...]  # module:attr specs
    suites: tuple[str, ...]  # suite files the subjects' capabilities are checked by
    select: str = SELECT
    keyword: str = ""  # a ``-k`` expression that leaves tests out (why: beside the release's entry)
    beside: tuple[tuple[str, str], ...] = ()  # other releases it runs on: (("megatron-core", "0.19.2"),)

    @property
    def pins(self) -> tuple[tuple[str, str], ...]:
        """Every ``(distribution, version)`` the verdicts describe: the release, then ``beside``."""
        return ((self.distribution, self.version), *self.beside)

    @property
    def title(self) -> str:
        """How the site names it: ``verl 0.9.1``, or ``verl 0.9.1 on megatron-core 0.19.2`` when it
        runs beside another release (the same subjects then get a column of their own)."""
        return " on ".join(f"{dist} {version}" for dist, version in self.pins)

    @property
    def pin(self) -> str:
        """The recorded files' ``release``: ``verl==0.9.1`` or ``verl==0.9.1, megatron-core==0.19.2``."""
        return ", ".join(f"{dist}=={version}" for dist, version in self.pins)

    def mismatch(self) -> str | None:
        """Why the installed distributions are not this release's pins (None when they are)."""
        from harness.subjects.frameworks import installed_version

        for dist, version in self.pins:
            found = installed_version(dist)
            if found != version:
                return f"{dist} is {found or 'not installed'}, expected {version} (tox -e {self.name})"
        return None


RELEASES: dict[str, Release] = {
    r.name: r
    for r in (
        Release(
            "verl-0.8.0",
            "verl",
            "0.8.0",
            (
                "harness.subjects.frameworks.verl:VERL_0_8_0",
                "harness.subjects.frameworks.verl:VERL_0_8_0_SGLANG",
            ),
            VERL_SUITES,
            select=MEGATRON,
            keyword=VERL_KEYWORD,
        ),
        Release(
            "verl-0.9.0",
            "verl",
            "0.9.0",
            ("harness.subjects.frameworks.verl:VERL_0_9_0",),
            VERL_SUITES,
            select=MEGATRON,
            keyword=VERL_KEYWORD,
        ),
        Release(
            "verl-0.9.1",
            "verl",
            "0.9.1",
            ("harness.subjects.frameworks.verl:VERL_0_9_1",),
            VERL_SUITES,
            select=MEGATRON,
            keyword=VERL_KEYWORD,
        ),
        Release(
            "verl-0.9.1-mcore-0.19.2",
            "verl",
            "0.9.1",
            ("harness.subjects.frameworks.verl:VERL_0_9_1",),
            VERL_SUITES,
            select=MEGATRON,
            keyword=VERL_KEYWORD,
            beside=(("megatron-core", "0.19.2"),),
        ),
        Release(
            "skyrl-0.2.0",
            "skyrl",
            "0.2.0",
            ("harness.subjects.frameworks.skyrl:SKYRL_0_2_0",),
            ("test_layouts.py", "test_megatron.py"),
            select=MEGATRON,
        ),
        Release(
            "skyrl-0.3.0",
            "skyrl",
            "0.3.0",
            ("harness.subjects.frameworks.skyrl:SKYRL_0_3_0",),
            ("test_layouts.py", "test_megatron.py"),
            select=MEGATRON,
        ),
        Release(
            "skyrl-0.4.0",
            "skyrl",
            "0.4.0",
            ("harness.subjects.frameworks.skyrl:SKYRL_0_4_0",),
            ("test_layouts.py", "test_megatron.py"),
            select=MEGATRON,
            beside=(("megatron-core", "0.19.2"),),  # 0.4.0 imports megatron.core.models.hybrid (0.17+)
        ),
        Release(
            "mcore-0.19.2",
            "megatron-core",
            "0.19.2",
            (
                "harness.subjects.frameworks.mcore:MCORE_0_19_2",
                "harness.subjects.frameworks.mcore:MCORE_0_19_2_STATIC",
            ),
            ("test_megatron.py",),
            select=MEGATRON,
        ),
        Release(
            "mcore-0.16.1",
            "megatron-core",
            "0.16.1",
            ("harness.subjects.frameworks.mcore:MCORE_0_16_1",),
            ("test_megatron.py",),
            select=MEGATRON,
        ),
    )
}


def verdict_of(outcome: Any) -> dict[str, str] | None:
    """One ``CheckOutcome`` as a verdict entry, or ``None`` when it used no capability of the subject."""
    if not outcome.capabilities:
        return None
    if outcome.outcome == "passed":
        return {"invariant": outcome.invariant, "verdict": "pass"}
    if outcome.outcome == "skipped":
        reason = outcome.detail.strip().splitlines()[0] if outcome.detail.strip() else "skipped"
        return {"invariant": outcome.invariant, "verdict": "skip", "detail": reason}
    detail = outcome.detail + (f" [{outcome.example}]" if outcome.example else "")
    return {"invariant": outcome.invariant, "verdict": "fail", "detail": detail}


def observe(
    release: Release, suites: Sequence[str] = (), tests: Mapping[str, Sequence[str]] | None = None
) -> dict[str, dict[str, dict[str, str]]]:
    """Run the release's suites (or only ``suites``, some of them) against each of its subjects:
    ``{spec: {test id: entry}}``. With ``tests`` (``{spec: [test id]}``, what :func:`unrecorded`
    found), only those tests run, and a subject without one runs nothing."""
    from harness.check.suites import run_suites, suites_dir

    observed: dict[str, dict[str, dict[str, str]]] = {}
    for spec in release.subjects:
        if tests is not None and not tests.get(spec):
            observed[spec] = {}
            continue
        chosen = tests[spec] if tests is not None else _suites(release, suites)
        paths = [str(suites_dir() / t) for t in chosen]
        outcomes, log = run_suites(spec, select=release.select, paths=paths, extra=_extra(release))
        if not outcomes:
            raise VerdictError(f"{spec}: no test ran\n" + "\n".join(log.strip().splitlines()[-8:]))
        entries = {}
        for outcome in outcomes:
            entry = verdict_of(outcome)
            if entry is not None:
                entries[_test_id(outcome.nodeid)] = entry
        observed[spec] = entries
    return observed


def unrecorded(
    release: Release, recorded: dict[str, Any], suites: Sequence[str] = ()
) -> dict[str, list[str]]:
    """Per subject, the tests of the release's suites (or of ``suites``) that ``recorded`` holds no
    verdict for: the invariants added since it was recorded (``--new``). A test that uses none of
    the subject's capabilities is never recorded, so it is among them each time (it runs, and is
    left out again)."""
    from harness.check.suites import collect_suites, suites_dir

    paths = [str(suites_dir() / s) for s in _suites(release, suites)]
    found: dict[str, list[str]] = {}
    for spec in release.subjects:
        known = recorded["subjects"].get(spec, {})
        ids = collect_suites(spec, select=release.select, paths=paths, extra=_extra(release))
        found[spec] = [t for t in map(_test_id, ids) if t not in known]
    return found


def _suites(release: Release, suites: Sequence[str]) -> Sequence[str]:
    """``suites`` (some of the release's, refused otherwise), or all of them."""
    unknown = sorted(set(suites) - set(release.suites))
    if unknown:
        raise VerdictError(
            f"--suites: {unknown} are not suites of {release.name}; expected some of {release.suites}"
        )
    return suites or release.suites


def _extra(release: Release) -> tuple[str, ...]:
    # The ci profile (derandomized), whatever the environment: without it the profile follows
    # $CI, and a recording made outside CI could miss a counterexample that CI then finds.
    return ("--hypothesis-profile", "ci", *(("-k", release.keyword) if release.keyword else ()))


def _test_id(nodeid: str) -> str:
    """A test's id in a verdict file: its node id from the suite file on (``test_splice.py::…``)."""
    return nodeid.split("/")[-1]


def with_recorded_rest(
    observed: dict[str, dict[str, dict[str, str]]], recorded: dict[str, Any], suites: Sequence[str]
) -> dict[str, dict[str, dict[str, str]]]:
    """``observed`` (the tests of ``suites`` only) completed with the recorded verdicts of every other
    suite: what re-observing one changed suite gives, the rest of the release's verdicts unchanged.
    With no ``suites``, every recorded verdict is kept under the observed ones (``--new``)."""
    return {
        spec: {
            **{
                test: entry
                for test, entry in recorded["subjects"].get(spec, {}).items()
                if test.split("::")[0] not in suites
            },
            **entries,
        }
        for spec, entries in observed.items()
    }


def load(release: Release, directory: Path = VERDICTS_DIR) -> dict[str, Any]:
    """The recorded verdicts of ``release``."""
    path = directory / f"{release.name}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerdictError(
            f"no recorded verdicts for {release.name}: {path} (record with --record)"
        ) from None
    except json.JSONDecodeError as err:
        raise VerdictError(f"{path}: not JSON ({err})") from None
    if data.get("release") != release.pin or "subjects" not in data:
        raise VerdictError(f"{path}: expected release {release.pin!r} and 'subjects'")
    return data


def diff(recorded: dict[str, Any], observed: dict[str, dict[str, dict[str, str]]]) -> list[str]:
    """Every verdict that differs, one readable line each ([] when all match).

    Verdicts are compared, not the wording of a failure: a counterexample that reads differently
    is not a change. A recorded failure without triage is a difference too.
    """
    lines: list[str] = []
    subjects = recorded["subjects"]
    for spec in sorted(set(subjects) | set(observed)):
        old, new = subjects.get(spec), observed.get(spec)
        if old is None or new is None:
            lines.append(f"{spec}: {'not recorded' if old is None else 'not observed'}")
            continue
        for test in sorted(set(old) | set(new)):
            before, after = old.get(test), new.get(test)
            if before is None:
                lines.append(f"{spec} {test}: new invariant, now {_words(after)}")
            elif after is None:
                lines.append(f"{spec} {test}: recorded {before['verdict']}, no longer run")
            elif before["verdict"] != after["verdict"]:
                lines.append(f"{spec} {test}: recorded {_words(before)}, now {_words(after)}")
            elif before["verdict"] == "fail" and before.get("triage", UNTRIAGED) == UNTRIAGED:
                lines.append(f"{spec} {test}: failure not triaged ({before.get('detail', '')})")
    return lines


def _words(entry: dict[str, str] | None) -> str:
    if entry is None:
        return "absent"
    detail = entry.get("detail")
    return entry["verdict"].upper() + (f" ({detail})" if detail else "")


def merged(
    release: Release, observed: dict[str, dict[str, dict[str, str]]], recorded: dict[str, Any] | None
) -> dict[str, Any]:
    """The file to record: the observation, with the triage of failures that are still failures."""
    old = recorded["subjects"] if recorded else {}
    subjects: dict[str, Any] = {}
    for spec, entries in observed.items():
        subjects[spec] = {}
        for test, entry in sorted(entries.items()):
            entry = dict(entry)
            if entry["verdict"] == "fail":
                before = old.get(spec, {}).get(test, {})
                entry["triage"] = (
                    before.get("triage", UNTRIAGED) if before.get("verdict") == "fail" else UNTRIAGED
                )
            subjects[spec][test] = entry
    return {"release": release.pin, "subjects": subjects}


def settle(
    release: Release,
    observed: dict[str, dict[str, dict[str, str]]],
    directory: Path,
    *,
    record: bool,
    label: str = "",
) -> int:
    """Record ``observed`` into ``directory`` (``record``; exit status 0), or compare it with the
    recorded verdicts there and print each change (1 when one changed, 0 when all match)."""
    if record:
        try:
            recorded = load(release, directory)
        except VerdictError:
            recorded = None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{release.name}.json"
        path.write_text(json.dumps(merged(release, observed, recorded), indent=1, ensure_ascii=False) + "\n")
        print(f"recorded {path}")
        return 0
    changes = diff(load(release, directory), observed)
    for line in changes:
        print(line)
    print(
        f"{release.name}{label}: "
        + (f"{len(changes)} verdict(s) changed" if changes else "every verdict matches")
    )
    return 1 if changes else 0
