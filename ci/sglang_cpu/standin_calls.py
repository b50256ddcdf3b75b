"""Fail when any ``sgl_kernel`` stand-in was used during a run (``$RRH_SGLANG_STANDIN_LOG``).

``tox -e sglang-cpu`` runs this after the suites: an empty (or absent) log means every SGLang
process took SGLang's own torch paths; otherwise it prints each recorded use and exits 1.

    python ci/sglang_cpu/standin_calls.py LOG
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: standin_calls.py LOG", file=sys.stderr)
        return 2
    log = Path(argv[0])
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    if lines:
        print(
            f"sgl_kernel stand-in used {len(lines)} time(s) ({log}): SGLang left its torch paths",
            file=sys.stderr,
        )
        for line in lines:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"sgl_kernel stand-in: never used ({log})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
