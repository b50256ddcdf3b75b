"""Set-based comparison of two traces of one sample (DESIGN §3.3).

Two routes are equal when their expert *sets* are equal: kernels order top-k differently, and
nothing guarantees that an engine and a trainer list a route's ids in the same order.
``compare`` gives, for every (position, MoE layer), ``|A ∩ B|`` and the metrics built on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.errors import TraceError
from harness.trace import kernels
from harness.trace.routing_trace import RoutingTrace
from harness.trace.validation import MAX_EXPERTS


@dataclass
class AgreementCounts:
    """Set agreement of two routings as mergeable counts (DESIGN §7: every figure an accumulator).

    ``differs_per_layer[l]`` counts the positions whose MoE layer ``l`` routes differ,
    ``tokens_differ`` the positions that differ in at least one MoE layer, ``overlap_sum`` the
    sum of ``|A ∩ B|`` over (position, layer). ``merge`` adds the counts of another part of the
    same run, so the figures are the same for any split of the positions and any order.
    """

    top_k: int
    positions: int = 0
    differs_per_layer: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    tokens_differ: int = 0
    overlap_sum: int = 0

    @classmethod
    def of(cls, overlap: npt.NDArray[np.uint8], top_k: int) -> AgreementCounts:
        """The counts of one overlap array ``[positions, moe_layers]`` (``|A ∩ B|`` per cell).

        One compiled pass over the array (``kernels.agreement``): the figures of every
        comparison come from here, so this pass costs no more than a read of the overlap.
        """
        differs_per_layer, tokens_differ, overlap_sum = kernels.agreement(overlap, top_k)
        return cls(
            top_k=top_k,
            positions=int(overlap.shape[0]),
            differs_per_layer=differs_per_layer,
            tokens_differ=tokens_differ,
            overlap_sum=overlap_sum,
        )

    def merge(self, other: AgreementCounts) -> None:
        """Add the counts of ``other`` (same ``top_k`` and number of MoE layers)."""
        if other.positions == 0:
            return
        if self.positions == 0:
            self.top_k, self.differs_per_layer = other.top_k, other.differs_per_layer.copy()
        elif other.top_k != self.top_k or other.differs_per_layer.shape != self.differs_per_layer.shape:
            raise TraceError(
                f"top_k, moe layers: counts differ ({self.top_k}, {self.differs_per_layer.size} vs "
                f"{other.top_k}, {other.differs_per_layer.size}); expected equal"
            )
        else:
            self.differs_per_layer = self.differs_per_layer + other.differs_per_layer
        self.positions += other.positions
        self.tokens_differ += other.tokens_differ
        self.overlap_sum += other.overlap_sum

    @property
    def cells(self) -> int:
        """(position, MoE layer) pairs compared."""
        return self.positions * int(self.differs_per_layer.size)

    @property
    def disagreement(self) -> float:
        """Mean over (position, MoE layer) of [sets differ]; nan when there is nothing to compare."""
        return int(self.differs_per_layer.sum()) / self.cells if self.cells else float("nan")

    @property
    def per_layer(self) -> npt.NDArray[np.float64]:
        """Disagreement of each MoE layer (model order); nan for every layer when there are no rows."""
        if self.positions == 0:
            return np.full(self.differs_per_layer.shape, np.nan)
        return self.differs_per_layer / self.positions

    @property
    def token_disagreement(self) -> float:
        """Fraction of positions whose route differs in at least one MoE layer."""
        return self.tokens_differ / self.positions if self.cells else float("nan")

    @property
    def topk_overlap(self) -> float:
        """Mean of ``|A ∩ B| / top_k`` over (position, MoE layer)."""
        return self.overlap_sum / self.cells / self.top_k if self.cells else float("nan")


@dataclass(frozen=True)
class RoutingComparison:
    """Per-(position, MoE layer) comparison of two traces of the same sample.

    Two routes are equal when their expert *sets* are equal: kernels order top-k differently.
    ``overlap[r, l]`` is ``|A ∩ B|`` for row r and MoE layer l (0..top_k). The figures are those
    of its :class:`AgreementCounts`, the form the audit merges across a run.
    """

    overlap: npt.NDArray[np.uint8]
    top_k: int
    moe_layers: tuple[int, ...] = field(default=())

    @property
    def differs(self) -> npt.NDArray[np.bool_]:
        """``[rows, num_moe_layers]``: True where the two expert sets differ."""
        return self.overlap < self.top_k

    def counts(self) -> AgreementCounts:
        """This comparison as mergeable counts."""
        if self.overlap.shape[0] == 0:
            return AgreementCounts(self.top_k, 0, np.zeros(self.overlap.shape[1], np.int64))
        return AgreementCounts.of(self.overlap, self.top_k)

    @property
    def disagreement(self) -> float:
        """Mean over (position, MoE layer) of [sets differ]; nan when there is nothing to compare."""
        return self.counts().disagreement

    @property
    def per_layer(self) -> npt.NDArray[np.float64]:
        """Disagreement of each MoE layer (model order); nan for every layer when there are no rows."""
        return self.counts().per_layer

    @property
    def token_disagreement(self) -> float:
        """Fraction of positions whose route differs in at least one MoE layer."""
        return self.counts().token_disagreement

    @property
    def topk_overlap(self) -> float:
        """Mean of ``|A ∩ B| / top_k`` over (position, MoE layer)."""
        return self.counts().topk_overlap


def route_overlap(
    a: npt.NDArray[np.integer[Any]], b: npt.NDArray[np.integer[Any]], num_experts: int | None = None
) -> npt.NDArray[np.uint8]:
    """``|A ∩ B|`` for each (row, layer) of two valid route arrays ``[rows, layers, top_k]``.

    Both arrays must hold distinct ids in ``[0, num_experts)`` in every route (as every
    ``RoutingTrace`` MoE slot does), in any integer dtypes; without ``num_experts`` the largest
    id sets the bound (one more pass over each array).
    """
    if a.shape != b.shape or a.ndim != 3:
        raise TraceError(
            f"routes: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}; expected equal shapes "
            "[rows, layers, top_k]"
        )
    if num_experts is None:
        num_experts = 1 + max((int(x.max()) for x in (a, b) if x.size), default=0)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise TraceError(f"routes: ids below {num_experts}; expected ids in [0, MAX_EXPERTS={MAX_EXPERTS})")
    return kernels.overlap(a, b, num_experts)


def compare(a: RoutingTrace, b: RoutingTrace) -> RoutingComparison:
    """Compare the MoE routes of two traces of the same sample, position by position.

    The traces may use different layer axes; they must cover the same positions, with the same
    ``top_k``, ``num_experts`` and MoE layers, otherwise ``TraceError`` says which field differs.
    """
    for name in ("start", "rows", "top_k", "num_experts", "moe_layers"):
        if getattr(a, name) != getattr(b, name):
            raise TraceError(
                f"{name}: traces differ ({getattr(a, name)} vs {getattr(b, name)}); expected equal"
            )
    return RoutingComparison(
        route_overlap(a.moe_routes(), b.moe_routes(), a.num_experts), a.top_k, a.moe_layers
    )
