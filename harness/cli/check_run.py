"""Execute a ``CheckPlan``: its suite runs in-process, then its mismatch labs, against one subject.

Progress goes to a stream as it happens (``harness.report.Progress``: one line per suite run and
per lab, and with ``verbose`` one per test); what ran comes back as a ``CheckRun`` for the report.
A lab that raises is a finding about the subject's replay, recorded in ``CheckRun.errors``, not a
crash of ``rrh``; a lab the subject has no capability for is left out with a note.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from harness.check.plan import CheckPlan, LabStep, SuiteStep

if TYPE_CHECKING:
    from harness.check.suites import CheckOutcome
    from harness.lab.measure import LabResult
    from harness.report import LabRun, SuiteRun

__all__ = ["CheckRun", "run_lab", "run_plan"]


@dataclass
class CheckRun:
    """What a plan's execution produced: suite runs, labs, the labs' errors, and every note (the
    plan's, then the runner's)."""

    suites: list[SuiteRun] = field(default_factory=list)
    labs: list[LabRun] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def outcomes(self) -> list[CheckOutcome]:
        return [o for run in self.suites for o in run.outcomes]


def run_lab(step: LabStep, subject: Any) -> LabResult:
    """Run one mismatch lab (the reference lab replays through ``subject.install_replay``, the vLLM
    and SGLang labs through ``subject.install_hf_replay``). The reference and transformers labs' models are as
    tiny as the suites': one torch thread, as in the suites (``harness.check.one_torch_thread``);
    the engines set their own threads."""
    if step.kind in ("vllm", "sglang"):
        from harness.lab.engine import run_engine_lab

        return run_engine_lab(subject.install_hf_replay, step.config, engine=step.kind)
    from harness.check.suites import one_torch_thread

    with one_torch_thread():
        if step.kind == "hf":
            from harness.lab.hf import run_hf_mismatch_lab

            return run_hf_mismatch_lab(step.config)
        from harness.lab.reference import run_mismatch_lab

        return run_mismatch_lab(step.config, install_replay=subject.install_replay)


def _run_suite(plan: CheckPlan, step: SuiteStep, stream: TextIO, verbose: bool) -> SuiteRun:
    from harness.check.suites import run_suites
    from harness.outcomes import count_outcomes
    from harness.report import Progress, SuiteRun

    progress = Progress(stream, label=step.name, verbose=verbose)
    t0 = time.perf_counter()
    outcomes, log = run_suites(
        plan.subject,
        select=step.select,
        paths=list(step.paths) if step.paths else None,
        keyword=step.keyword,
        extra=list(plan.pytest_args),
        progress=progress,
    )
    seconds = time.perf_counter() - t0
    note = ""
    if outcomes:
        progress.finish(f"{step.name}: {count_outcomes(o.outcome for o in outcomes)} ({seconds:.1f}s)")
    else:
        note = "no test was selected or collected"
        tail = "\n".join(log.strip().splitlines()[-5:])
        progress.finish(f"rrh check: {step.name}: {note}\n{tail}")
    return SuiteRun(step.name, step.engine, step.selection(), outcomes, seconds, note)


def run_plan(plan: CheckPlan, subject: Any, stream: TextIO, *, verbose: bool = False) -> CheckRun:
    """Run ``plan`` against ``subject`` (its loaded object), reporting progress to ``stream``: one
    line per suite run and lab, and with ``verbose`` one per test."""
    from harness.report import LabRun, Progress
    from harness.report.verdict import percent

    run = CheckRun(notes=list(plan.notes))
    run.suites = [_run_suite(plan, step, stream, verbose) for step in plan.suites]
    for step in plan.labs:
        if getattr(subject, step.capability) is None:
            run.notes.append(
                f"The {step.kind} mismatch lab was not run: subject '{subject.name}' does not provide "
                f"{step.capability}."
            )
            continue
        progress = Progress(stream)
        rollouts = "real vLLM rollouts" if step.kind == "vllm" else "KV-cache rollouts"
        progress.transient(f"{step.title}: {rollouts} vs full-forward recompute, without and with R3…")
        t0 = time.perf_counter()
        try:
            result = run_lab(step, subject)
        except Exception as err:  # the subject's replay raised: a finding, not a crash of rrh
            run.errors.append(f"The {step.kind} mismatch lab raised {type(err).__name__}: {err}")
            progress.finish(f"{step.title}: raised {type(err).__name__}")
            continue
        seconds = time.perf_counter() - t0
        without, r3 = result.without_replay.routing, result.with_r3.routing
        progress.finish(
            f"{step.title}: {percent(without.disagreement)} of routes flipped without replay, "
            f"{percent(r3.disagreement)} with R3"
        )
        run.labs.append(LabRun(step.kind, result, seconds, note=step.note(subject.name)))
    return run
