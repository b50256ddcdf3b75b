"""The ``rrh`` command line: ``rrh check``, ``rrh bench trace``, ``rrh --version``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from harness import __version__
from harness.subjects import DEFAULT_SUBJECT, load_subject


def _cmd_check(args: argparse.Namespace) -> int:
    from harness.check import run_suites
    from harness.report import format_outcomes

    print(f"rrh check: subject {args.subject}; running the invariant suites…", flush=True)
    outcomes, log = run_suites(args.subject, select=args.select)
    if not outcomes:
        print(log, file=sys.stderr)
        print("rrh check: no check ran; nothing was verified", file=sys.stderr)
        return 2
    print(format_outcomes(outcomes))
    subject = load_subject(args.subject)
    if subject.install_replay is not None:
        from harness.lab import format_lab, run_mismatch_lab

        print()
        print(format_lab(run_mismatch_lab(install_replay=subject.install_replay)))
    failed = [o for o in outcomes if o.outcome == "failed"]
    if failed:
        print(f"\n{len(failed)} invariant(s) violated; rerun one with: pytest {failed[0].nodeid}")
    return 1 if failed else 0


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
        ("save_load", "save + load"),
    ):
        print(f"  {label:<17} {result[key + '_gbps']:6.2f} GB/s  ({result[key + '_vs_copy']:.2f}× copy)")
    print(
        f"  storage           {result['stored_bytes_per_position_layer']:.2f} B/(position, layer) in memory, "
        f"{result['file_bytes_per_position_layer']:.4f} on disk"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rrh", description="Verify MoE routing replay (R2, R3).")
    parser.add_argument("--version", action="version", version=f"rrh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser("check", help="run the invariant suites against a subject")
    check.add_argument("--subject", default=DEFAULT_SUBJECT, metavar="MODULE:ATTR")
    check.add_argument("-m", dest="select", default="not slow and not gpu", help="pytest marker expression")
    check.set_defaults(func=_cmd_check)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
