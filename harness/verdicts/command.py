"""``python -m harness.verdicts``: observe a release and compare (or record) its verdicts, print the
verdict table or the README's summary, or run the release watch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.errors import HarnessError
from harness.verdicts.record import (
    RELEASES,
    VERDICTS_DIR,
    VerdictError,
    load,
    observe,
    settle,
    unrecorded,
    with_recorded_rest,
)
from harness.verdicts.tables import summary, table

DESCRIPTION = "Recorded verdicts of released framework code (``fixtures/verdicts/<release>.json``)."


def build_parser() -> argparse.ArgumentParser:
    """``python -m harness.verdicts``'s arguments (the CLI reference is generated from them)."""
    parser = argparse.ArgumentParser(prog="python -m harness.verdicts", description=DESCRIPTION)
    parser.add_argument(
        "release",
        choices=[*sorted(RELEASES), "table", "summary", "releases"],
        help="a release to observe and compare; 'table': print the verdict table; 'summary': print the "
        "README's one line per release; 'releases': the release watch",
    )
    parser.add_argument(
        "--record", action="store_true", help="write the observation as the recorded verdicts"
    )
    parser.add_argument(
        "--index-answer", type=Path, help="releases: replay this recorded answer of pip (no network)"
    )
    parser.add_argument("--save-answer", type=Path, help="releases: record pip's answer to this file")
    parser.add_argument(
        "--suites",
        nargs="+",
        default=(),
        metavar="FILE",
        help="a release: observe only these of its suites (e.g. test_megatron.py after that suite "
        "changed); every other verdict is taken from the recorded file",
    )
    parser.add_argument(
        "--new",
        action="store_true",
        help="a release: observe only the tests its recorded file holds no verdict for (the "
        "invariants a suite gained since; with --suites, in those suites); every recorded verdict is "
        "kept as it is, so re-record whole after changing an existing test",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.release in ("table", "summary"):
        print(table() if args.release == "table" else summary(), end="")
        return 0
    if args.release == "releases":
        from harness.verdicts import releases

        try:
            return releases.main(
                {r.name: r.pins for r in RELEASES.values()}, args.index_answer, args.save_answer
            )
        except HarnessError as err:
            print(f"releases: {err}", file=sys.stderr)
            return 2
    release = RELEASES[args.release]
    why = release.mismatch()
    if why is not None:
        print(f"{release.name}: {why}", file=sys.stderr)
        return 2
    try:
        if args.new:
            recorded = load(release)
            tests = unrecorded(release, recorded, args.suites)
            print(f"{release.name}: {sum(map(len, tests.values()))} test(s) without a recorded verdict")
            observed = with_recorded_rest(observe(release, tests=tests), recorded, suites=())
        else:
            observed = observe(release, args.suites)
            if args.suites:
                observed = with_recorded_rest(observed, load(release), args.suites)
    except VerdictError as err:
        print(f"{release.name}: {err}", file=sys.stderr)
        return 2
    return settle(release, observed, VERDICTS_DIR, record=args.record)
