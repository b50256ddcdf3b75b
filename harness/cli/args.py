"""Argument types the commands share (argparse ``type=`` callables): sizes, step sets, fractions and
``--fail-on`` thresholds, each a one-line usage error on bad text."""

from __future__ import annotations

import argparse


def parse_size(text: str) -> int:
    """``4GiB``, ``512MiB``, ``100000`` → bytes (argparse type)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    low = text.strip().lower()
    number, factor = low, 1
    for unit, unit_factor in units.items():
        if low.endswith(unit):
            number, factor = low[: -len(unit)], unit_factor
            break
    try:
        value = float(number) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size such as 1GiB, 512MiB or 1000000"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive size")
    return int(value)


def parse_steps(text: str) -> frozenset[int]:
    """``3``, ``0-9``, ``1,4,7-8`` → a set of steps (argparse type)."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            lo, sep, hi = part.strip().partition("-")
            steps.update(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected steps such as 3, 0-9 or 1,4,7-8") from None
    return frozenset(steps)


def parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1]")
    return value


def parse_threshold(text: str) -> tuple[str, float]:
    """``mean_abs_diff=0.01`` → (figure, threshold) for ``--fail-on`` (argparse type)."""
    from harness.audit.result.audit_result import THRESHOLD_FIGURES

    name, sep, value = text.partition("=")
    if not sep or name not in THRESHOLD_FIGURES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected FIGURE=VALUE with FIGURE one of {list(THRESHOLD_FIGURES)}"
        )
    try:
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number") from None
