"""``rrh mutants``: the suites against every known bug (each must be killed) and every benign variant
(each must pass), printed as it goes and as a table."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _cmd_mutants(args: argparse.Namespace) -> int:
    from harness.check.mutation import kill_args, reference_failures, run_benign, run_mutant
    from harness.mutants.benign import BENIGN
    from harness.mutants.registry import MUTANTS
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


def add_parser(commands: Any) -> None:
    """Register ``rrh mutants`` on the ``rrh`` parser's sub-commands."""
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
