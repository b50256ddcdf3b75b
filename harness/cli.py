"""The ``rrh`` command line: ``rrh check``, ``rrh bench trace``, ``rrh --version``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from harness import __version__
from harness.subjects import DEFAULT_SUBJECT, load_subject


def _cmd_check(args: argparse.Namespace) -> int:
    from harness.check import run_suites, suites_dir
    from harness.report import format_outcomes

    print(
        f"rrh check: subject {args.subject}, engine {args.engine}; running the invariant suites…", flush=True
    )
    if args.engine == "hf":
        outcomes, log = run_suites(
            args.subject, select=f"hf and ({args.select})", paths=[str(suites_dir() / "test_hf.py")]
        )
    else:
        outcomes, log = run_suites(args.subject, select=f"not hf and ({args.select})")
    if not outcomes:
        print(log, file=sys.stderr)
        print("rrh check: no check ran; nothing was verified", file=sys.stderr)
        return 2
    print(format_outcomes(outcomes))
    subject = load_subject(args.subject)
    from harness.lab import format_lab

    if args.engine == "hf" and subject.install_hf_replay is not None:
        from harness.engines.hf import run_hf_mismatch_lab

        print()
        print(format_lab(run_hf_mismatch_lab()))
    elif args.engine == "reference" and subject.install_replay is not None:
        from harness.lab import run_mismatch_lab

        print()
        print(format_lab(run_mismatch_lab(install_replay=subject.install_replay)))
    failed = [o for o in outcomes if o.outcome == "failed"]
    if failed:
        print(f"\n{len(failed)} invariant(s) violated; rerun one with: pytest {failed[0].nodeid}")
    return 1 if failed else 0


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
    print(
        f"  storage           {result['stored_bytes_per_position_layer']:.2f} B/(position, layer) in memory, "
        f"{result['file_bytes_per_position_layer']:.4f} on disk"
    )
    return 0


def _cmd_mutants(args: argparse.Namespace) -> int:
    from harness.mutants.registry import MUTANTS
    from harness.mutants.run import kill_args, reference_failures, run_mutant
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
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print()
        print(format_table(("mutant", "bug class", "verdict", "killed by", "time"), rows))
        print(
            f"\n{len(results) - len(survivors)} of {len(results)} mutants killed"
            f"{f' under {len(seeds)} hypothesis seeds' if args.seeds else ''}; "
            f"reference failures: {len(report['reference_failures'])}"
        )  # type: ignore[arg-type]
    return 1 if survivors or report["reference_failures"] else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rrh", description="Verify MoE routing replay (R2, R3).")
    parser.add_argument("--version", action="version", version=f"rrh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser("check", help="run the invariant suites against a subject")
    check.add_argument("--subject", default=DEFAULT_SUBJECT, metavar="MODULE:ATTR")
    check.add_argument(
        "--engine",
        choices=("reference", "hf"),
        default="reference",
        help="reference: the reference model and engine; hf: real transformers models (extra 'hf')",
    )
    check.add_argument("-m", dest="select", default="not slow and not gpu", help="pytest marker expression")
    check.set_defaults(func=_cmd_check)

    mutants = commands.add_parser("mutants", help="run the suites against every known bug; all must die")
    mutants.add_argument("--json", action="store_true", help="print the report as JSON")
    mutants.add_argument(
        "--seeds", type=int, default=0, help="repeat under N hypothesis seeds (default: derandomized)"
    )
    mutants.add_argument("--only", nargs="*", metavar="NAME", help="only these mutants")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
