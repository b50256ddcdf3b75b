"""Per-module mutation scores from a finished ``mutmut run`` (the ``mutants/`` folder it leaves).

``python ci/mutation_scores.py [MODULE ...]`` prints, for each mutated module of ``reference_impl/``,
the mutants killed, survived, never reached by a suite ("no tests"), timed out and not checked,
the score over reached mutants (killed / (killed + survived)) and over all generated mutants, and
the surviving mutants' names (``mutmut show NAME`` prints one's diff). Exit status 0.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

STATUS = {
    1: "killed",
    3: "killed",
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    36: "timeout",
}


def scores(root: Path = Path("mutants")) -> dict[str, tuple[Counter[str], list[str]]]:
    """``{module: (counts by status, surviving mutant names)}`` from mutmut's ``.meta`` files."""
    out = {}
    for meta in sorted(root.glob("reference_impl/**/*.py.meta")):
        exit_codes = json.loads(meta.read_text())["exit_code_by_key"]
        counts: Counter[str] = Counter()
        survivors = []
        for key, code in exit_codes.items():
            status = (
                "not checked"
                if code is None
                else STATUS.get(code, "timeout" if code in (24, -24, 152, 255) else "suspicious")
            )
            counts[status] += 1
            if status == "survived":
                survivors.append(key)
        out[str(meta.relative_to(root)).removesuffix(".meta")] = (counts, survivors)
    return out


def main(modules: list[str]) -> int:
    for module, (counts, survivors) in scores().items():
        if modules and not any(module.endswith(m) for m in modules):
            continue
        reached = counts["killed"] + counts["survived"]
        total = sum(counts.values())
        score = f"{100 * counts['killed'] / reached:.0f}% of reached" if reached else "n/a"
        print(f"{module}: {score}, {100 * counts['killed'] / total:.0f}% of all {total}; {dict(counts)}")
        for name in survivors:
            print(f"    survived: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
