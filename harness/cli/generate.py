"""``rrh generate``: write a synthetic run in the run layout, with faults planted at known places."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness.cli.args import parse_size


def _cmd_generate(args: argparse.Namespace) -> int:
    from harness.audit.synthetic.generate import FAULTS, SHARED_FAULTS, RunShape, generate_run

    faults = FAULTS if args.faults == ["all"] else tuple(args.faults)
    unknown = [f for f in faults if f not in (*FAULTS, *SHARED_FAULTS)]
    if unknown:
        print(
            f"rrh generate: --faults {unknown[0]!r}: expected 'all' or some of {[*FAULTS, *SHARED_FAULTS]}",
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


def add_parser(commands: Any) -> None:
    """Register ``rrh generate`` on the ``rrh`` parser's sub-commands."""
    generate = commands.add_parser(
        "generate",
        help="write a seeded run of realistic shape (Qwen3-30B-A3B routing), faults planted on request",
    )
    generate.add_argument("directory", metavar="DIR", help="where the run is written (the run layout)")
    generate.add_argument("--steps", type=int, default=2, help="RL steps (default: 2)")
    generate.add_argument(
        "--size", type=parse_size, default=None, help="grow the run to this many bytes of routes"
    )
    generate.add_argument(
        "--seed", type=int, default=0, help="seed of the generated routes and of where faults are planted"
    )
    generate.add_argument(
        "--faults", nargs="*", default=[], metavar="FAULT", help="'all' or some of the fault kinds"
    )
    generate.set_defaults(func=_cmd_generate)
