"""The engine-adapter protocol the gate observes engines through, and the pieces adapters share.

An adapter answers four questions about one engine (DESIGN §4): which version is installed here
(``installed_version``), which payload convention that version declares (``convention``; None where
the engine declares none and its convention is only observed), how to start it on a model
(``start``), and what it does (``observe``: the convention observed from real rollouts, engine
facts compared exactly, metrics). It also names the invariant suites that judge it (``suites``);
the gate runs them, so adapters never import the suite runner above them.

No probe failure is swallowed: a probe that raises is an ``ObservationError`` naming the engine,
the metric or fact, and the cause (``observing``); a metric that is undefined on an observation is
a null value with its reason (``harness.baseline.metric(..., undefined=...)``), never a silent NaN.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from harness.errors import HarnessError
from harness.gate.baseline import metric
from reference_impl.config import axis_of_width

if TYPE_CHECKING:  # the registry is read by `rrh --help`: keep numpy and torch out of its import
    from harness.conventions import Convention

__all__ = [
    "EngineAdapter",
    "Observation",
    "ObservationError",
    "Suites",
    "lab_metrics",
    "layer_axis",
    "observing",
    "row_rule",
]


class ObservationError(HarnessError, RuntimeError):
    """A probe of an engine failed: the gate cannot vouch for what it did not see (exit status 2)."""

    def __init__(self, engine: str, what: str, cause: BaseException | str) -> None:
        reason = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{engine}: {what}: {reason}")
        self.engine, self.what = engine, what


@contextmanager
def observing(engine: str, what: str) -> Iterator[None]:
    """Run one probe of ``engine``; whatever it raises becomes an ``ObservationError`` naming ``what``.

    Starting an engine is no probe: adapters start it outside ``observing``, so that an engine that
    cannot start here stays an ``EngineUnavailable`` (the gate cannot run), not a failed probe.
    """
    try:
        yield
    except ObservationError:
        raise
    except Exception as err:
        raise ObservationError(engine, what, err) from err


@dataclass(frozen=True)
class Suites:
    """The invariant suites that judge an engine: a pytest marker expression over suite files.

    ``files``: paths relative to the project root (``("suites/test_hf.py",)``; an engine's conformance
    tests are ``conformance/test_engines.py``); empty: every suite.
    """

    select: str
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class Observation:
    """What an adapter saw of its engine: the gate adds the invariants and writes the baseline.

    ``convention``: the payload convention observed from real rollouts (``dtype``, ``row_rule``,
    ``layer_axis``, …); ``observations``: engine facts compared exactly; ``metrics``:
    ``harness.baseline.metric`` entries by name; ``figures``: ungated figures.
    """

    engine: str
    version: str
    convention: dict[str, Any]
    metrics: dict[str, dict[str, Any]]
    observations: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``harness.gate.baseline.figure`` entries: what the engine does but does not promise (notes)."""


@runtime_checkable
class EngineAdapter(Protocol):
    """One engine as the gate sees it; ``harness.gate.adapters.ADAPTERS`` holds one per engine."""

    name: str
    """The engine's name (``rrh gate --engine NAME``)."""
    suites: Suites
    """The invariant suites that judge the engine."""

    def installed_version(self) -> str | None:
        """The engine's version on this machine, or None when it is not installed."""
        ...

    def convention(self, version: str) -> Convention | None:
        """The payload convention ``version`` declares (``harness.conventions``); None: only observed."""
        ...

    def start(self, model: Any) -> Any:
        """The engine started on ``model`` (the caller stops it); ``EngineUnavailable`` if it cannot start."""
        ...

    def observe(self) -> Observation:
        """Observe the installed engine (``ObservationError`` naming the probe that failed)."""
        ...


def row_rule(rows: int, prompt_len: int, response_len: int, start: int = 0) -> str:
    """The observed row count in words, relative to ``prompt + generated``."""
    offset = rows - (prompt_len + response_len - start)
    rule = "prompt + generated" + (f" − {-offset}" if offset < 0 else f" + {offset}" if offset else "")
    return rule + (" − start" if start else "")


def layer_axis(width: int, num_layers: int, num_moe: int) -> str:
    """The observed layer axis of a payload ``width`` columns wide (DESIGN §2: decoder or MoE ordinal)."""
    axis = axis_of_width(width, num_layers, num_moe)
    if axis is None:
        return f"unknown (width {width}, decoder layers {num_layers}, MoE layers {num_moe})"
    return axis.value


NO_FLIP = "no response token's routing flipped without replay: nothing to measure on flipped tokens"
"""Why the flipped-token metrics of a mismatch lab are undefined when no route flipped."""


def lab_metrics(prefix: str, result: Any) -> dict[str, dict[str, Any]]:
    """A mismatch lab (``harness.mismatch.LabResult``) as gate metrics.

    Tolerances absorb CPU-kernel differences across machines. With no flipped token the
    flipped-token gaps and their ratio are undefined (null, with ``NO_FLIP`` as the reason).
    """
    without, r3 = result.without_replay, result.with_r3
    metrics = {
        f"{prefix}.no_replay.disagreement": metric(without.routing.disagreement, 0.02, "equal"),
        f"{prefix}.r3.disagreement": metric(r3.routing.disagreement, 0.0, "lower"),
        f"{prefix}.no_replay.mean_abs_gap": metric(
            without.gap.mean_abs_diff, 0.5 * without.gap.mean_abs_diff, "equal"
        ),
        f"{prefix}.r3.mean_abs_gap": metric(r3.gap.mean_abs_diff, 0.5 * r3.gap.mean_abs_diff, "lower"),
    }
    flipped_without = without.gap_on_flipped.mean_abs_diff
    flipped_r3 = r3.gap_on_flipped.mean_abs_diff
    if result.flipped_tokens == 0:
        gap_r3 = ratio = metric(math.nan, 0.0, "lower", undefined=NO_FLIP)
    else:
        gap_r3 = metric(flipped_r3, 0.5 * flipped_r3, "lower")
        ratio = (
            metric(flipped_r3 / flipped_without, 0.25, "lower")
            if flipped_without > 0
            else metric(math.nan, 0.0, "lower", undefined="the gap on flipped tokens without replay is 0")
        )
    metrics[f"{prefix}.r3.mean_abs_gap_flipped"] = gap_r3
    metrics[f"{prefix}.r3_over_no_replay.mean_abs_gap_flipped"] = ratio
    return metrics
