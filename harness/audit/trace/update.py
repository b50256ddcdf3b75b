"""R2's update pass in megatron-core's router trace: every update forward placed at its (sample,
position, layer), and the pass each sample is judged by.

Under R2 verl records the routing of the old-log-prob forward (``RouterReplay`` RECORD,
``merge_router_topk_indices``) and replays that recording in every forward of the update
(REPLAY_FORWARD, ``set_router_replay_data`` of the mini-batch's ``routed_experts``). The update's
forwards come in the order ``harness.audit.trace.verl_packing.update_packing`` computes with verl's own
functions (mini-batches over the epochs, each micro-batched); a sample is forwarded once per epoch.
``UpdatePasses`` holds, for each sample, the routes its routers dispatched in each of those
forwards (its *passes*, in call order), filled by every TP, CP and PP rank of its DP rank; the
pass shown for a sample is its first that differs from the recording anywhere (compared as sets),
or its first pass when none does, so that the audit's ``replay_fidelity`` names a sample whose
replay failed in any update forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from harness.audit.importers import megatron_calls
from harness.audit.layout.schema import LayoutError
from harness.audit.trace.layout import TrainerLayout, placed
from harness.audit.trace.verl_packing import MicroBatch


class UpdatePasses:
    """One step's update forwards of every sample, placed from the ranks' calls (``place``)."""

    def __init__(
        self,
        plans: Sequence[Sequence[MicroBatch]],
        samples: int,
        offsets: npt.NDArray[np.int64],
        shape: tuple[int, int],
    ) -> None:
        """``plans``: each DP rank's update micro-batches in call order; ``offsets``: each sample's
        first row in the step's samples laid end to end; ``shape``: ``(decoder layers, top_k)``."""
        self.plans, self.offsets = plans, offsets
        self.passes = np.zeros(samples, dtype=np.int64)
        """How many update forwards each sample had (its epochs)."""
        self.occurrence: list[list[npt.NDArray[np.int64]]] = []
        """Per DP rank and micro-batch: which pass of each of its samples that forward is."""
        for plan in plans:
            seen: Counter[int] = Counter()
            found = []
            for mb in plan:
                found.append(np.array([seen[r] for r in mb.rows], dtype=np.int64))
                seen.update(mb.rows)
            self.occurrence.append(found)
            for row, count in seen.items():
                self.passes[row] = count
        total = int(offsets[-1])
        most = max(1, int(self.passes.max(initial=0)))
        self.routes = np.zeros((most, total, *shape), dtype=np.int32)
        self.filled = np.zeros((most, total, shape[0]), dtype=bool)

    def place(
        self,
        calls: Sequence[megatron_calls.RouterCall],
        layer: int,
        layout: TrainerLayout,
        ranks: tuple[int, int, int],
    ) -> None:
        """One layer's update calls of one rank (``ranks``: its DP, TP and CP rank), in call order."""
        dp_rank, tp_rank, cp_rank = ranks
        plan, occurrence = self.plans[dp_rank], self.occurrence[dp_rank]
        for call, mb, occ in zip(calls, plan, occurrence, strict=True):
            flat, index, ids = placed(call, mb, layout, tp_rank, cp_rank, self.offsets)
            which = occ[index]
            self.routes[which, flat, layer] = ids
            self.filled[which, flat, layer] = True

    def hole(self, sample: int, moe: list[int]) -> tuple[int, int, int] | None:
        """``(pass, position, MoE slot)`` of the first cell of ``sample`` that no rank routed, if any."""
        lo, hi = int(self.offsets[sample]), int(self.offsets[sample + 1])
        for which in range(int(self.passes[sample])):
            holes = ~self.filled[which, lo:hi][:, moe]
            if holes.any():
                pos, slot = (int(x) for x in np.argwhere(holes)[0])
                return which, pos, slot
        return None

    def judged(self, sample: int, recorded: npt.NDArray[np.int32], moe: list[int]) -> npt.NDArray[np.int32]:
        """The routes of ``sample``'s update pass to judge against ``recorded`` (its route rows, the
        old-log-prob forward's): the first pass that differs anywhere on the MoE layers, else the first."""
        lo, rows = int(self.offsets[sample]), recorded.shape[0]
        if not self.passes[sample]:
            raise LayoutError(f"sample {sample}: verl's update packing forwards it in no mini-batch")
        want = np.sort(recorded[:, moe], axis=-1)
        for which in range(int(self.passes[sample])):
            got = self.routes[which, lo : lo + rows]
            if not np.array_equal(np.sort(got[:, moe], axis=-1), want):
                return got
        return self.routes[0, lo : lo + rows]
