"""Which rank holds what: the parallel layout of a job and its process groups.

A job is a grid of ``tp × cp × dp × pp`` ranks (Megatron's order, tensor-parallel fastest):

    rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))

* **TP** ranks share one sequence; with sequence parallelism (which MoE needs under TP>1) each TP
  rank routes its own contiguous ``S/tp`` shard of the tokens.
* **CP** ranks hold the zig-zag chunks ``r`` and ``2·cp − 1 − r`` of one sequence.
* **DP** ranks hold different sequences.
* **PP** ranks hold different layers: rank ``p`` runs virtual chunks ``c = 0..vpp-1``, i.e. model
  chunks ``c·pp + p`` (Megatron's interleaved order, `layouts.pp_layer_ranges`).
* **EP** cuts the experts, not the tokens: within one pipeline stage the ``tp·cp·dp`` ranks form
  expert groups of ``ep`` consecutive ranks (Megatron's expert grid with expert-TP 1), and EP rank
  ``e`` of a group owns experts ``[e·E/ep, (e+1)·E/ep)``. Every rank routes its own tokens; the
  dispatch sends each (token, expert) pair to the rank owning the expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


class TopologyError(ValueError):
    """A parallel layout that cannot be built; the message names the field and what it must be."""


@dataclass(frozen=True)
class ParallelSpec:
    """Sizes of each parallel dimension (1 = not parallel)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "vpp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"ParallelSpec.{name} = {value!r}: expected an int >= 1")
        if self.stage_size % self.ep:
            raise TopologyError(
                f"ParallelSpec.ep = {self.ep}: expected a divisor of tp·cp·dp = {self.stage_size} "
                "(expert groups are cut from the ranks of one pipeline stage)"
            )

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage: ``tp · cp · dp``."""
        return self.tp * self.cp * self.dp

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def name(self) -> str:
        """``"tp2-ep2"``-style name listing the dimensions larger than 1 (``"single"`` if none)."""
        dims = ("tp", "cp", "dp", "ep", "pp", "vpp")
        return "-".join(f"{dim}{getattr(self, dim)}" for dim in dims if getattr(self, dim) > 1) or "single"

    def place(self, rank: int) -> RankPlace:
        """Where global rank ``rank`` sits in the grid."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank = {rank}: expected an int in [0, world_size={self.world_size})")
        tp_rank = rank % self.tp
        cp_rank = rank // self.tp % self.cp
        dp_rank = rank // (self.tp * self.cp) % self.dp
        pp_rank = rank // self.stage_size
        return RankPlace(rank, tp_rank, cp_rank, dp_rank, pp_rank, rank % self.stage_size % self.ep)

    def rank_of(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given grid coordinates."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def model_chunk_owner(self, model_chunk: int) -> tuple[int, int]:
        """``(pp_rank, virtual_chunk)`` running model chunk ``model_chunk`` (of ``pp·vpp``)."""
        return model_chunk % self.pp, model_chunk // self.pp


@dataclass(frozen=True)
class RankPlace:
    """Coordinates of one rank: its index in each parallel dimension."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int
    ep: int

    def describe(self) -> str:
        return f"rank {self.rank} (tp={self.tp}, cp={self.cp}, dp={self.dp}, pp={self.pp}, ep={self.ep})"


@dataclass
class ProcessGroups:
    """This rank's groups (None where the dimension has size 1) and their member ranks."""

    tp: dist.ProcessGroup | None
    cp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    tp_ranks: list[int]
    cp_ranks: list[int]
    ep_ranks: list[int]


def new_groups(spec: ParallelSpec, rank: int) -> ProcessGroups:
    """Create every TP, CP and EP group of the grid and keep this rank's.

    Collective: every rank must call it, in the same order (``new_group`` is collective over the
    default group). Pipeline neighbours talk point-to-point on the default group.
    """
    if dist.get_world_size() != spec.world_size:
        raise TopologyError(
            f"world_size = {dist.get_world_size()}: expected tp·cp·dp·pp = {spec.world_size} for {spec}"
        )
    mine: dict[str, tuple[dist.ProcessGroup | None, list[int]]] = {}
    for dim, size in (("tp", spec.tp), ("cp", spec.cp), ("ep", spec.ep)):
        for members in _groups_of(spec, dim):
            group = dist.new_group(members) if size > 1 else None
            if rank in members:
                mine[dim] = (group, members)
    return ProcessGroups(
        mine["tp"][0], mine["cp"][0], mine["ep"][0], mine["tp"][1], mine["cp"][1], mine["ep"][1]
    )


def _groups_of(spec: ParallelSpec, dim: str) -> list[list[int]]:
    """Member ranks of every group of dimension ``dim``, each in that dimension's rank order."""
    groups: list[list[int]] = []
    for pp in range(spec.pp):
        if dim == "ep":
            base = pp * spec.stage_size
            groups += [list(range(base + g, base + g + spec.ep)) for g in range(0, spec.stage_size, spec.ep)]
            continue
        for dp in range(spec.dp):
            if dim == "tp":
                groups += [
                    [spec.rank_of(tp=t, cp=c, dp=dp, pp=pp) for t in range(spec.tp)] for c in range(spec.cp)
                ]
            else:  # cp
                groups += [
                    [spec.rank_of(tp=t, cp=c, dp=dp, pp=pp) for c in range(spec.cp)] for t in range(spec.tp)
                ]
    return groups
