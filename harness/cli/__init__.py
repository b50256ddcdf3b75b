"""The ``rrh`` command line: one module per command (``check``, ``mutants``, ``bench``, ``audit``,
``generate``, ``run``, ``gate``), each registering its own sub-parser; this package assembles them.

Layer: the top (DESIGN §4). A command module imports what it runs lazily, inside its command
function, so ``rrh --help`` and the CLI reference (``harness.cli.reference``) stay quick.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from harness import __version__
from harness.cli import audit, bench, check, gate, generate, mutants, run
from harness.errors import HarnessError

COMMANDS = (check, mutants, bench, audit, generate, run, gate)
"""The command modules in the order ``rrh --help`` lists them."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (exit status 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rrh", description="Verify MoE routing replay (R2, R3).")
    parser.add_argument("--version", action="version", version=f"rrh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    for command in COMMANDS:
        command.add_parser(commands)
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
