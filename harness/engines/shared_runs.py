"""Two runs of one prompt compared only where both saw the same context: what an engine promises.

vLLM promises neither run-to-run determinism nor batch invariance on CPU (FACTS §6, "A busy or
different machine"): two greedy runs, a preempted and a roomy engine, an aborted and a whole
request may generate different tokens from some token on, every run on a CPU with other kernels
(AMX) or beside a busy neighbour. A test that asserts equal tokens tests the engine's numerics,
not its routing capture. What stays true is that up to the first token where the two runs part,
both computed the same positions from the same context, so their routes there are comparable;
after it, each run's routes are judged against its own tokens (coverage, and a recompute of those
tokens: ``harness.engines.checkpoint.trainer_recompute``).

``compare_shared`` compares two traces over those positions: rows ``[max(start), P + d)``, ``d``
the generated tokens both runs have in common (row ``P + d − 1`` is the forward of the last shared
token, whose context is still shared), capped at the rows both traces hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.errors import HarnessError
from harness.trace import RoutingTrace, compare

if TYPE_CHECKING:
    from harness.engines.checkpoint import EngineRollout

__all__ = ["SharedRuns", "compare_runs", "compare_shared"]


@dataclass(frozen=True)
class SharedRuns:
    """Two runs of one prompt where they share context: ``tokens`` generated tokens in common (the
    first divergence at generated token ``tokens``, or none when one run's tokens are the other's
    head), rows ``[lo, hi)`` compared, and the set disagreement of their MoE routes there."""

    tokens: int
    generated: tuple[int, int]
    lo: int
    hi: int
    disagreement: float

    @property
    def rows(self) -> int:
        return max(0, self.hi - self.lo)

    @property
    def diverged(self) -> bool:
        """Whether the runs generated different tokens (not one the head of the other)."""
        return self.tokens < min(self.generated)

    def describe(self) -> str:
        """One line for a test's output: where the runs parted and how alike they routed before."""
        parted = f"parted at generated token {self.tokens}" if self.diverged else "no divergence"
        return (
            f"{parted} (of {self.generated[0]} and {self.generated[1]}); rows [{self.lo}, {self.hi}) "
            f"compared: {self.disagreement:.2%} of routes differ"
        )


def _common_head(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _rows(trace: RoutingTrace, lo: int, hi: int) -> RoutingTrace:
    decoder = trace.to_decoder_axis()
    return RoutingTrace(
        decoder.experts[lo - trace.start : hi - trace.start],
        num_experts=trace.num_experts,
        moe_layers=trace.moe_layers,
        num_layers=trace.num_layers,
        start=lo,
    )


def compare_shared(
    prompt: Sequence[int],
    first: tuple[Sequence[int], RoutingTrace],
    second: tuple[Sequence[int], RoutingTrace],
) -> SharedRuns:
    """Compare two runs of ``prompt``, each ``(generated tokens, trace)``, over the rows both computed
    from the same context (see the module docstring). ``HarnessError`` when they share no row."""
    (tokens_a, trace_a), (tokens_b, trace_b) = first, second
    shared = _common_head(tokens_a, tokens_b)
    lo = max(trace_a.start, trace_b.start)
    hi = min(len(prompt) + shared, trace_a.stop, trace_b.stop)
    if hi <= lo:
        raise HarnessError(
            f"the two runs share no computed row: rows from {lo}, shared context up to {len(prompt) + shared}"
        )
    differs = compare(_rows(trace_a, lo, hi), _rows(trace_b, lo, hi)).disagreement
    return SharedRuns(shared, (len(tokens_a), len(tokens_b)), lo, hi, differs)


def compare_runs(a: EngineRollout, b: EngineRollout) -> SharedRuns:
    """``compare_shared`` of two engine calls given one prompt."""
    if a.prompt != b.prompt:
        raise HarnessError("the two runs were given different prompts; expected one prompt")
    return compare_shared(a.prompt, (a.tokens, a.trace), (b.tokens, b.trace))
