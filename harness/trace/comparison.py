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
from harness.trace.routing_trace import MAX_EXPERTS, RoutingTrace


@dataclass(frozen=True)
class RoutingComparison:
    """Per-(position, MoE layer) comparison of two traces of the same sample.

    Two routes are equal when their expert *sets* are equal: kernels order top-k differently.
    ``overlap[r, l]`` is ``|A ∩ B|`` for row r and MoE layer l (0..top_k).
    """

    overlap: npt.NDArray[np.uint8]
    top_k: int
    moe_layers: tuple[int, ...] = field(default=())

    @property
    def differs(self) -> npt.NDArray[np.bool_]:
        """``[rows, num_moe_layers]``: True where the two expert sets differ."""
        return self.overlap < self.top_k

    @property
    def disagreement(self) -> float:
        """Mean over (position, MoE layer) of [sets differ]; nan when there is nothing to compare."""
        # A count, not ``differs.mean()``: the same float, without converting every flag to float64.
        return np.count_nonzero(self.differs) / self.overlap.size if self.overlap.size else float("nan")

    @property
    def per_layer(self) -> npt.NDArray[np.float64]:
        """Disagreement of each MoE layer (model order); nan for every layer when there are no rows."""
        if self.overlap.shape[0] == 0:
            return np.full(self.overlap.shape[1], np.nan)
        return self.differs.mean(axis=0)

    @property
    def token_disagreement(self) -> float:
        """Fraction of positions whose route differs in at least one MoE layer."""
        return float(self.differs.any(axis=1).mean()) if self.overlap.size else float("nan")

    @property
    def topk_overlap(self) -> float:
        """Mean of ``|A ∩ B| / top_k`` over (position, MoE layer)."""
        return float(self.overlap.mean() / self.top_k) if self.overlap.size else float("nan")


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
