"""Recorded verdicts of released framework code (``harness.verdicts``).

``test_release_verdicts_match[<release>]`` runs the suites against the installed release's subjects
and compares with ``fixtures/verdicts/<release>.json``: it is ``slow`` (deselected by default) and
runs in that release's tox env (``tox -e verl-0.9.1``), skipping, naming the env, where the release
is not the installed one. The other tests check the
comparison itself and the recorded files, without any framework installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.verdicts.record import (
    RELEASES,
    UNTRIAGED,
    VERDICTS_DIR,
    VerdictError,
    diff,
    load,
    merged,
    observe,
    with_recorded_rest,
)
from harness.verdicts.tables import summary, table

SPEC = "pkg.mod:SUBJECT"


def _recorded(entries: dict[str, dict[str, str]]) -> dict[str, object]:
    return {"release": "verl==0.9.1", "subjects": {SPEC: entries}}


PASS = {"invariant": "rows", "verdict": "pass"}
FAIL = {"invariant": "rows", "verdict": "fail", "detail": "9 rows, expected 7", "triage": "verl #5430"}


def test_matching_verdicts_give_no_difference() -> None:
    assert (
        diff(
            _recorded({"t::a": PASS, "t::b": FAIL}),
            {SPEC: {"t::a": PASS, "t::b": dict(FAIL, detail="other words")}},
        )
        == []
    )


def test_a_verdict_that_changes_is_a_readable_difference() -> None:
    lines = diff(_recorded({"t::a": PASS}), {SPEC: {"t::a": {**FAIL, "detail": "8 rows, expected 7"}}})
    assert lines == [f"{SPEC} t::a: recorded PASS, now FAIL (8 rows, expected 7)"]
    fixed = diff(_recorded({"t::b": FAIL}), {SPEC: {"t::b": PASS}})
    assert fixed == [f"{SPEC} t::b: recorded FAIL (9 rows, expected 7), now PASS"]


def test_new_vanished_and_untriaged_invariants_are_differences() -> None:
    untriaged = dict(FAIL, triage=UNTRIAGED)
    lines = diff(_recorded({"t::gone": PASS, "t::u": untriaged}), {SPEC: {"t::new": PASS, "t::u": untriaged}})
    assert lines == [
        f"{SPEC} t::gone: recorded pass, no longer run",
        f"{SPEC} t::new: new invariant, now PASS",
        f"{SPEC} t::u: failure not triaged (9 rows, expected 7)",
    ]
    assert diff(_recorded({}), {}) == [f"{SPEC}: not observed"]


def test_recording_keeps_the_triage_of_failures_that_stay_failures() -> None:
    release = RELEASES["verl-0.9.1"]
    observed = {
        SPEC: {"t::b": {k: v for k, v in FAIL.items() if k != "triage"}, "t::c": dict(FAIL, triage="x")}
    }
    out = merged(release, observed, _recorded({"t::b": FAIL}))
    assert out["subjects"][SPEC]["t::b"]["triage"] == "verl #5430"
    assert out["subjects"][SPEC]["t::c"]["triage"] == UNTRIAGED  # a new failure is never pre-explained


def test_one_suite_reobserved_keeps_every_other_recorded_verdict() -> None:
    """``--suites test_megatron.py``: that suite's verdicts are the new observation (a new layout
    included), every other suite's are the recorded ones, and a test of it no longer run is gone."""
    recorded = _recorded(
        {"test_a.py::x": FAIL, "test_megatron.py::t[old]": PASS, "test_megatron.py::t[gone]": PASS}
    )
    observed = {SPEC: {"test_megatron.py::t[old]": PASS, "test_megatron.py::t[new]": PASS}}
    assert with_recorded_rest(observed, recorded, ["test_megatron.py"]) == {
        SPEC: {"test_a.py::x": FAIL, "test_megatron.py::t[old]": PASS, "test_megatron.py::t[new]": PASS}
    }


def test_new_finds_the_tests_a_recording_holds_no_verdict_for() -> None:
    """``--new``: the suites' collection against the recording, per subject, without running a test."""
    from harness.check.suites import collect_suites, suites_dir
    from harness.verdicts.record import Release, unrecorded

    spec = "harness.subjects.reference:REFERENCE"
    release = Release("ref-0", "routing-replay-harness", "0", (spec,), ("test_splice.py",))
    ids = [i.split("/")[-1] for i in collect_suites(spec, paths=[str(suites_dir() / "test_splice.py")])]
    assert len(ids) > 1 and all(i.startswith("test_splice.py::") for i in ids), ids
    recorded = {"subjects": {spec: {i: PASS for i in ids[1:]}}}
    assert unrecorded(release, recorded) == {spec: ids[:1]}
    assert unrecorded(release, {"subjects": {}}) == {spec: ids}
    assert with_recorded_rest({spec: {ids[0]: FAIL}}, recorded, suites=()) == {
        spec: {ids[0]: FAIL, **recorded["subjects"][spec]}
    }


def test_a_suite_that_is_not_the_releases_is_refused() -> None:
    with pytest.raises(VerdictError, match=r"--suites: \['test_vllm.py'\] are not suites of mcore-0.19.2"):
        observe(RELEASES["mcore-0.19.2"], ["test_vllm.py"])


def test_a_release_beside_another_gets_its_own_column_and_line(tmp_path: Path) -> None:
    """verl 0.9.1 alone and on megatron-core 0.19.2 wrap the same subject: the table and the summary
    tell the two recordings apart by the release each runs beside."""
    for name in ("verl-0.9.1", "verl-0.9.1-mcore-0.19.2"):
        release = RELEASES[name]
        document = {"release": release.pin, "subjects": {"m:VERL_0_9_1": {"t::a": PASS}}}
        (tmp_path / f"{name}.json").write_text(json.dumps(document))
    header = table(tmp_path).splitlines()[0]
    assert header == "| invariant | `VERL_0_9_1` | `VERL_0_9_1` on megatron-core 0.19.2 |"
    assert [line.split(" (")[0] for line in summary(tmp_path, page="p.md").splitlines()] == [
        "- **verl 0.9.1**",
        "- **verl 0.9.1 on megatron-core 0.19.2**",
    ]


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_recorded_failures_are_triaged(name: str) -> None:
    """Every recorded failure says why: an upstream issue/PR or the finding, from the release's source."""
    if not (VERDICTS_DIR / f"{name}.json").exists():
        pytest.skip(f"{name}: no recorded verdicts yet")
    recorded = load(RELEASES[name])
    for spec, entries in recorded["subjects"].items():
        assert entries, f"{name} {spec}: no verdict recorded"
        for test, entry in entries.items():
            assert entry["verdict"] in ("pass", "fail", "skip"), f"{name} {spec} {test}: {entry['verdict']!r}"
            if entry["verdict"] == "fail":
                assert entry.get("detail"), f"{name} {spec} {test}: a failure without its counterexample"
                assert entry.get("triage", UNTRIAGED) != UNTRIAGED, (
                    f"{name} {spec} {test}: failure not triaged"
                )
    json.dumps(recorded)


@pytest.mark.slow  # it runs whole suites; the release's env selects it (tox -e NAME, .ci/run)
@pytest.mark.parametrize("name", sorted(RELEASES))
def test_release_verdicts_match(name: str) -> None:
    """The installed release's verdicts are the recorded ones (run in its tox env)."""
    release = RELEASES[name]
    why = release.mismatch()
    if why is not None:
        pytest.skip(f"{release.pin} is not installed: {why}")
    from harness.verdicts.record import observe

    changes = diff(load(release), observe(release))
    assert not changes, f"{name}: {len(changes)} verdict(s) changed:\n" + "\n".join(changes)
