"""How a traced Megatron run was laid out (``rrh audit --trainer-layout``), and which rows each rank routes.

``TrainerLayout`` names megatron-core's parallel sizes, verl's batching of the old-log-prob pass
(``harness.audit.trace.verl_packing.VerlBatching``), the replay mode the run used and, under R2, verl's
batching of the update (``UpdateBatching``). ``slots`` maps one micro-batch of one rank to the
(sample, position) of every row that rank's routers saw, and ``placed`` one traced call's rows to
their sample and position; ``trace_join`` and ``trace_update`` place the traced calls with them.
``trace_ranks`` finds the trace file of every rank of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import megatron_calls, megatron_lm
from harness.audit.layout.schema import LayoutError
from harness.audit.trace.verl_packing import MicroBatch, UpdateBatching, VerlBatching
from harness.errors import MegatronReplayError
from harness.trainers.megatron.packed import check_cu_seqlens, packed_slots
from reference_impl.layouts import cp_zigzag_indices, sp_shard

REPLAYS = ("R3", "R2")
"""The replay modes the join judges: R3 (the old-log-prob forward against the engine's routes) and
R2 (every update forward against the old-log-prob forward's recording)."""


@dataclass(frozen=True)
class TrainerLayout:
    """How the traced run was parallelised and batched: megatron-core's sizes and verl's batching."""

    batching: VerlBatching
    pp: int = 1
    replay: str = "R3"
    """verl's ``router_replay.mode``: ``R3`` or ``R2`` (then ``update`` is needed)."""
    update: UpdateBatching | None = None
    """verl's update batching (R2 only: the update pass is placed)."""

    def __post_init__(self) -> None:
        if self.replay not in REPLAYS:
            raise LayoutError(f"replay={self.replay}: expected one of {list(REPLAYS)}")
        if (self.replay == "R2") != (self.update is not None):
            raise LayoutError(
                "replay=R2 places the update pass: expected its batching (ppo_mini_batch=N and "
                "ppo_max_token_len=N or ppo_micro_batch=N) with R2, and only with R2"
            )

    @property
    def tp(self) -> int:
        return self.batching.tp

    @property
    def dp(self) -> int:
        return self.batching.dp

    @property
    def cp(self) -> int:
        return self.batching.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates (megatron-core's default order ``tp-cp-ep-dp-pp``)."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))


MAX_PARALLEL = 1 << 16
"""The largest ``tp``, ``cp``, ``pp`` or ``dp`` ``--trainer-layout`` takes: more ranks in one parallel
dimension than any real run has (a size is also checked against the trace files there are)."""
MAX_EPOCHS = 1 << 10
"""The largest ``ppo_epochs``: the update pass is placed once per epoch."""
MAX_SETTING = 2**31 - 1
"""The largest value of any other setting (token lengths, batch sizes, the seed)."""
_LIMITS = {"tp": MAX_PARALLEL, "cp": MAX_PARALLEL, "pp": MAX_PARALLEL, "dp": MAX_PARALLEL,
           "ppo_epochs": MAX_EPOCHS}  # fmt: skip

_BATCHING = {"max_token_len": "max_token_len_per_gpu", "micro_batch": "micro_batch_size_per_gpu"}
_UPDATE = {
    "ppo_mini_batch": "mini_batch_size",
    "ppo_epochs": "epochs",
    "shuffle": "shuffle",
    "seed": "seed",
    "ppo_max_token_len": "max_token_len_per_gpu",
    "ppo_micro_batch": "micro_batch_size_per_gpu",
}


def parse_layout(text: str) -> TrainerLayout:
    """``tp=2,cp=2,pp=2,dp=1,max_token_len=512`` (or ``micro_batch=2``), ``balance_batch=0`` to turn
    verl's balancing off: the ``--trainer-layout`` of ``rrh audit``. ``replay=R2`` with the update's
    batching (``ppo_mini_batch=N``, ``ppo_epochs=N``, ``shuffle=1``, ``seed=N``, ``ppo_max_token_len=N``
    or ``ppo_micro_batch=N``) places the update pass too."""
    known = {"tp", "cp", "pp", "dp", "balance_batch", *_BATCHING, *_UPDATE}
    values: dict[str, int] = {}
    replay = "R3"
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if name == "replay" and sep:
            replay = value.strip()
            continue
        digits = value.strip()
        # ASCII digits only: str.isdigit also takes '²' and other digits int() refuses.
        if not sep or name not in known or not (digits.isascii() and digits.isdigit()):
            raise LayoutError(
                f"--trainer-layout {text!r}: {part!r}; expected NAME=INTEGER with NAME one of "
                f"{sorted(known)}, or replay=R2|R3"
            )
        values[name] = _bounded(name, digits, text)
    batching = VerlBatching(
        dp=values.get("dp", 1),
        tp=values.get("tp", 1),
        cp=values.get("cp", 1),
        balance_batch=bool(values.get("balance_batch", 1)),
        **{field: values.get(key) for key, field in _BATCHING.items()},  # type: ignore[arg-type]
    )
    update = None
    if any(key in values for key in _UPDATE) or replay == "R2":
        if replay != "R2":
            raise LayoutError(
                f"--trainer-layout {text!r}: the update's batching "
                f"({', '.join(k for k in _UPDATE if k in values)}) without replay=R2; expected it only "
                "with R2 (R3 judges the old-log-prob forward alone)"
            )
        if "ppo_mini_batch" not in values:
            raise LayoutError(
                f"--trainer-layout {text!r}: replay=R2 without ppo_mini_batch=N; expected the update's "
                "mini-batch (ppo_mini_batch_size × rollout.n samples over all DP ranks)"
            )
        found = {field: values[key] for key, field in _UPDATE.items() if key in values}
        found["shuffle"] = bool(found.get("shuffle", False))
        update = UpdateBatching(**found)  # type: ignore[arg-type]
    pp = values.get("pp", 1)
    if pp < 1:
        raise LayoutError(f"--trainer-layout {text!r}: pp={pp}; expected an integer >= 1")
    return TrainerLayout(batching, pp, replay, update)


def _bounded(name: str, digits: str, text: str) -> int:
    """Setting ``name`` of ``--trainer-layout`` (its ASCII ``digits``), refused past its maximum: a size
    no run has would only make the join allocate or loop for it."""
    limit = _LIMITS.get(name, MAX_SETTING)
    if len(digits.lstrip("0")) > len(str(limit)) or int(digits) > limit:
        raise LayoutError(
            f"--trainer-layout {text!r}: {name}={digits[:20]}{'…' * (len(digits) > 20)}; expected at most "
            f"{limit}"
        )
    return int(digits)


def slots(
    mb: MicroBatch, layout: TrainerLayout, tp_rank: int, cp_rank: int, where: str
) -> npt.NDArray[np.int64]:
    """``(sample index in mb, position)`` of each row that TP rank ``tp_rank`` of CP rank ``cp_rank``
    routes (``-1`` on filler): each sample's zig-zag chunks of the CP rank, then its SP slice."""
    import torch

    tp, cp = layout.tp, layout.cp
    try:
        align = check_cu_seqlens(
            mb.lengths, torch.tensor([0, *np.cumsum(mb.lengths)]), torch.tensor(mb.cu_seqlens_padded), tp
        )
    except MegatronReplayError as err:
        raise LayoutError(f"{where}: {err}") from None
    found = packed_slots(mb.lengths, align)
    if cp > 1:
        if align % (2 * tp * cp):
            raise LayoutError(
                f"{where}: cu_seqlens_q_padded {list(mb.cu_seqlens_padded)}; expected each sample padded "
                f"to a multiple of tp·cp·2 = {2 * tp * cp} (verl's zig-zag CP layout)"
            )
        starts, ends = mb.cu_seqlens_padded[:-1], mb.cu_seqlens_padded[1:]
        held = [
            start + cp_zigzag_indices(end - start, cp, cp_rank)
            for start, end in zip(starts, ends, strict=True)
        ]
        found = found[torch.cat(held)]
    return (sp_shard(found, tp, tp_rank) if tp > 1 else found).numpy()


def placed(
    call: megatron_calls.RouterCall,
    mb: MicroBatch,
    layout: TrainerLayout,
    tp_rank: int,
    cp_rank: int,
    offsets: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.integer[Any]]]:
    """One call's real rows (filler dropped): their flat index into the step's samples laid end to end
    (``offsets``: each dump row's first), their sample's index in ``mb`` and their traced ids
    ``[rows, top_k]``."""
    found = slots(mb, layout, tp_rank, cp_rank, call.where)
    real = found[:, 0] >= 0
    index = found[real, 0]
    rows = np.asarray(mb.rows, dtype=np.int64)[index]
    return offsets[rows] + found[real, 1], index, megatron_calls.call_ids(call)[real]


def trace_ranks(trace: Path, layout: TrainerLayout) -> dict[int, Path]:
    """Each rank's trace file at ``trace``: one per rank ``0 … tp·cp·dp·pp − 1``, else a ``LayoutError``
    naming the rank that differs."""
    ranks = dict(megatron_lm.rank_files(trace))
    if len(ranks) != layout.world_size or max(ranks) >= layout.world_size:
        # the rank that differs, found among the files (never in a set of world_size ranks)
        odd = [r for r in sorted(ranks) if r >= layout.world_size] or [
            next(r for r in range(len(ranks) + 1) if r not in ranks)
        ]
        raise LayoutError(
            f"{trace}: trace files of ranks {sorted(ranks)}; expected router_trace_rank{{r}}.jsonl for r "
            f"in 0..{layout.world_size - 1} (tp·cp·dp·pp = {layout.tp}·{layout.cp}·{layout.dp}·{layout.pp}), "
            f"rank {odd[0]} differs"
        )
    return ranks
