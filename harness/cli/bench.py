"""``rrh bench``: the benchmarks (trace core, replay hooks, tap, audit), each printing its figures."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.cli.args import parse_size


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    from harness.bench.replay import bench_replay, format_bench_replay

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
    from harness.bench.trace import bench_trace, check_against, load_recorded, not_comparable, recorded_ratios

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
            runs = len(recorded["runs"])
            where = f"{runs} run(s) recorded on {', '.join(cpus)}, {recorded['repeats']} pairs a ratio"
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


def _cmd_bench_counts(args: argparse.Namespace) -> int:
    from harness.bench.counts import CountError, check_counts, count_kernels, load_record, recorded

    try:
        record = load_record(args.against) if args.against is not None else None
        before = load_record(args.record) if args.record is not None and args.record.exists() else None
        result = count_kernels(args.kernel or None, repeats=args.repeats, double=args.plant_slowdown)
    except CountError as err:
        print(f"rrh bench counts: {err}", file=sys.stderr)
        return 2
    if args.record is not None:
        args.record.write_text(json.dumps(recorded(result, before), indent=2) + "\n")
    checks, note = check_counts(result, record) if record is not None else ([], None)
    if args.json:
        result["against"] = (
            {"not_compared": note}
            if note
            else [{"kernel": n, "moved": m, "seen": seen} for n, m, seen in checks]
        )
        print(json.dumps(result, indent=2))
    else:
        calls, kind = result["repeats"], result["kind"]
        print(f"instructions per byte under callgrind, {calls} calls each, CPU kind {kind}")
        for name, figures in result["kernels"].items():
            print(f"  {name:<28} {figures['instructions_per_byte']:8.3f}  ({figures['bytes']} bytes a call)")
        if note:
            print(f"against {args.against}: not compared: {note}")
        elif record is not None:
            print(f"against {args.against}:")
            for name, moved, seen in checks:
                print(f"  {'MOVED' if moved else 'ok':<6} {name}: {seen}")
    return 1 if any(moved for _, moved, _ in checks) else 0


def _cmd_bench_tap(args: argparse.Namespace) -> int:
    from harness.bench.tap import bench_tap, format_bench_tap

    result = bench_tap(repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_bench_tap(result))
    return 0


def _cmd_bench_audit(args: argparse.Namespace) -> int:
    from harness.bench.audit import bench_audit, format_bench_audit

    if _dir_missing("audit", args.dir):
        return 2
    if args.repeats < 1:
        print(f"rrh bench audit: --repeats {args.repeats}; expected at least 1", file=sys.stderr)
        return 2
    result = bench_audit(size_bytes=args.size, directory=args.dir, repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else format_bench_audit(result))
    return 0


def _cmd_bench_follow(args: argparse.Namespace) -> int:
    from harness.bench.follow import bench_follow, format_bench_follow

    if len(args.steps) < 2 or min(args.steps) < 1:
        print(f"rrh bench follow: --steps {args.steps}; expected two or more run lengths of at least 1 step",
              file=sys.stderr)  # fmt: skip
        return 2
    result = bench_follow(tuple(sorted(args.steps)))
    print(json.dumps(result, indent=2) if args.json else format_bench_follow(result))
    return 0


def add_parser(commands: Any) -> None:
    """Register ``rrh bench`` on the ``rrh`` parser's sub-commands."""
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
    counts = benches.add_parser(
        "counts",
        help="instructions per byte of the trace and audit kernels under callgrind (a gate load cannot move)",
    )
    counts.add_argument("--json", action="store_true", help="print the figures as JSON")
    counts.add_argument("--repeats", type=int, default=3, help="counted calls of each kernel (default 3)")
    counts.add_argument(
        "--kernel", action="append", default=[], metavar="NAME", help="count only this kernel (repeatable)"
    )
    counts.add_argument(
        "--record", type=Path, default=None, metavar="JSON",
        help="write this run's counts into this file as its CPU kind's (created if missing)",
    )  # fmt: skip
    counts.add_argument(
        "--against", type=Path, default=None, metavar="JSON",
        help="compare each kernel's count with the recorded one; exit 1 when one moved by more than the "
        "file's bound (1.5×) either way",
    )  # fmt: skip
    counts.add_argument(
        "--plant-slowdown", action="append", default=[], metavar="NAME",
        help="run this kernel twice a call: a planted 2× slowdown, to see the gate fail",
    )  # fmt: skip
    counts.set_defaults(func=_cmd_bench_counts)
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
        "--size", type=parse_size, default=4 << 30, help="bytes of routes (default 4GiB)"
    )
    audit_bench.add_argument("--dir", type=Path, default=None, help="where the generated run goes")
    audit_bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds of every configuration; each figure is its best round",
    )
    audit_bench.set_defaults(func=_cmd_bench_audit)
    tap_bench = benches.add_parser(
        "tap",
        help="a tapped trainer forward against an untapped one (the bench replay model), ratio in one run",
    )
    tap_bench.add_argument("--repeats", type=int, default=20, help="timed forwards per arm (default 20)")
    tap_bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    tap_bench.set_defaults(func=_cmd_bench_tap)
    follow_bench = benches.add_parser(
        "follow", help="peak memory of rrh audit --follow over runs of different lengths, their ratio"
    )
    follow_bench.add_argument(
        "--steps", type=int, nargs="+", default=[10, 1000], help="run lengths in steps (default 10 1000)"
    )
    follow_bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    follow_bench.set_defaults(func=_cmd_bench_follow)
