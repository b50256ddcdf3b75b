"""Canonical traces → per-rank, per-router replay targets in Megatron-core's layout (FACTS §2).

Pure torch, no megatron import: the same functions run on a CPU box without megatron-core.

Megatron's data flow for one micro-batch, and what each step does to the routes:

1. Data parallel: DP rank ``d`` takes samples ``[d·B, (d+1)·B)`` of the global batch.
2. Embedding output is ``[S, B, H]``; routers flatten it **seq-major**: token ``s·B + b``.
3. Sequence parallel (required for MoE with TP > 1): TP rank ``t`` holds the contiguous shard
   ``[t·S/tp, (t+1)·S/tp)`` of the sequence axis (``reference_impl.layouts.sp_shard``).
4. Pipeline parallel: a (pp rank, vpp chunk) builds only its decoder layers; its routers are its MoE
   layers, in build order (``pp_layer_ranges``, ``stage_targets``: dense layers have no router).
5. Expert parallel: routing precedes dispatch, so targets hold **global logical** ids; the
   dispatcher sends each token to EP rank ``id // (E/ep)`` (``ep_local_ids``).

Every sample's trace must cover exactly the ``S`` input positions (row ``i`` is the routing of the
token at position ``i``). Megatron-core's ``RouterReplay`` has no per-token mask, so positions
without a row cannot be fed: ``S`` must be a multiple of ``tp`` and each trace must hold ``S`` rows
(DESIGN §3.6: no filler is ever replayed; a mismatch is an error here, never padding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from harness.errors import MegatronReplayError
from harness.trace import RoutingTrace
from reference_impl import layouts
from reference_impl.config import check_moe_layers


@dataclass(frozen=True)
class MegatronLayout:
    """The parallel layout and the batch shape of one training step (CP = 1).

    ``moe_layers`` are decoder indices (0-based); the other layers are dense. World size is
    ``tp · pp · dp``; the ``tp · dp`` ranks of a stage are regrouped for the experts as
    ``etp · ep · edp`` (expert-TP ``etp`` defaults to ``tp``, Megatron's default), so ``tp · dp`` must
    be a multiple of ``etp · ep``. ``etp = 1`` lets TP = 2, EP = 2 run on two ranks.

    ``lengths`` (one per micro-batch sample, each in ``[1, seq_len]``) makes the micro-batch packed
    (THD, ``harness.trainers.megatron.packed``): sample ``b`` holds ``lengths[b]`` tokens, padded to a
    multiple of ``align`` in one ``[1, T]`` sequence. ``None``: the padded ``[B, S]`` (bshd) input.
    ``align`` (a multiple of ``tp``; ``tp`` when not given, what verl and SkyRL choose at CP = 1) is
    the per-sample alignment of the packed buffer: ``tp·cp·2`` under context parallelism, larger
    under FP8. Above 1, ``cu_seqlens_padded`` and ``cu_seqlens`` differ after every sample whose
    length is not a multiple of it.
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    seq_len: int
    micro_batch: int
    tp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    etp: int | None = None
    lengths: tuple[int, ...] | None = None
    align: int | None = None
    moe_layer_freq: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        sizes = (
            "num_layers",
            "num_experts",
            "top_k",
            "seq_len",
            "micro_batch",
            "tp",
            "ep",
            "pp",
            "vpp",
            "dp",
        )
        for name in sizes:
            if getattr(self, name) < 1:
                raise MegatronReplayError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_moe_layers(self.moe_layers, self.num_layers, error=MegatronReplayError)
        if not self.moe_layers:
            raise MegatronReplayError("moe_layers is empty: nothing to replay")
        if self.top_k > self.num_experts:
            raise MegatronReplayError(f"top_k {self.top_k} > num_experts {self.num_experts}")
        if self.seq_len % self.tp:
            raise MegatronReplayError(
                f"seq_len {self.seq_len} is not a multiple of tp = {self.tp}: RouterReplay has no per-token "
                "mask, so sequence-parallel filler would be replayed (pad tokens and traces explicitly)"
            )
        if self.num_experts % self.ep:
            raise MegatronReplayError(f"num_experts {self.num_experts} is not divisible by ep = {self.ep}")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        assert self.etp is not None
        if self.etp < 1 or (self.tp * self.dp) % (self.etp * self.ep):
            raise MegatronReplayError(
                f"tp·dp = {self.tp * self.dp} is not a multiple of etp·ep = {self.etp}·{self.ep} "
                "(the experts regroup the tp·dp ranks of a stage)"
            )
        if self.align is None:
            object.__setattr__(self, "align", self.tp)
        assert self.align is not None
        if self.align < 1 or self.align % self.tp:
            raise MegatronReplayError(
                f"align = {self.align} is not a positive multiple of tp = {self.tp} (each TP rank holds "
                "T/tp rows of the packed buffer)"
            )
        if self.num_layers % (self.pp * self.vpp):
            raise MegatronReplayError(f"num_layers {self.num_layers} is not divisible by pp·vpp")
        if self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))
            if len(self.lengths) != self.micro_batch or not all(1 <= n <= self.seq_len for n in self.lengths):
                raise MegatronReplayError(
                    f"lengths {self.lengths}: expected {self.micro_batch} (micro_batch) values in "
                    f"[1, seq_len = {self.seq_len}]"
                )
        freq = [1 if i in self.moe_layers else 0 for i in range(self.num_layers)]
        object.__setattr__(self, "moe_layer_freq", freq)

    @property
    def packed(self) -> bool:
        """True for a packed (THD) micro-batch."""
        return self.lengths is not None

    @property
    def packed_rows(self) -> int:
        """Rows of one packed micro-batch, ``T``: each sample padded to a multiple of ``align``."""
        if self.lengths is None:
            raise MegatronReplayError("packed_rows: the layout is not packed (no lengths)")
        return sum(-(-n // self.packing_align) * self.packing_align for n in self.lengths)

    @property
    def packing_align(self) -> int:
        """The per-sample alignment of a packed micro-batch (``align``, resolved)."""
        assert self.align is not None
        return self.align

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch

    @property
    def local_tokens(self) -> int:
        """Tokens each router of one rank routes per micro-batch: ``S/tp · B`` (packed: ``T/tp``)."""
        if self.lengths is not None:
            return self.packed_rows // self.tp
        return self.seq_len // self.tp * self.micro_batch

    def stage_layers(self, pp_rank: int, vpp_chunk: int = 0) -> range:
        """Decoder layers built by ``(pp_rank, vpp_chunk)``."""
        return layouts.pp_layer_ranges(self.num_layers, self.pp, self.vpp)[pp_rank][vpp_chunk]

    def stage_moe_layers(self, pp_rank: int, vpp_chunk: int = 0) -> list[int]:
        """Decoder indices of the MoE layers (hence routers) of ``(pp_rank, vpp_chunk)``, in build order."""
        owned = self.stage_layers(pp_rank, vpp_chunk)
        return [layer for layer in self.moe_layers if layer in owned]

    def rank_moe_layers(self, pp_rank: int) -> list[int]:
        """Decoder indices of every router of PP rank ``pp_rank``, chunk after chunk (with VPP not
        contiguous: PP = 2, VPP = 2 puts layers 0 and 2 of four on rank 0)."""
        return [layer for chunk in range(self.vpp) for layer in self.stage_moe_layers(pp_rank, chunk)]


def batch_routes(traces: Sequence[RoutingTrace], layout: MegatronLayout) -> torch.Tensor:
    """Stack the global batch's canonical traces into decoder-axis routes ``[dp·B, S, layers, k]`` (int64).

    Each trace must start at position 0, cover exactly ``S`` rows (packed: its sample's length,
    ``lengths[i % B]``; the positions after it are 0), and agree with the layout on
    ``num_experts``, ``top_k``, the decoder layer count and which layers are MoE. MoE-ordinal
    traces are converted to the decoder axis first (dense slots are never read).
    """
    if len(traces) != layout.global_batch:
        raise MegatronReplayError(
            f"traces: expected {layout.global_batch} (dp {layout.dp} × micro_batch {layout.micro_batch}), "
            f"got {len(traces)}"
        )
    rows = []
    for i, trace in enumerate(traces):
        where = f"traces[{i}]"
        if trace.start != 0:
            raise MegatronReplayError(
                f"{where}: start = {trace.start}, expected 0 (every input position replayed)"
            )
        rows_wanted = layout.lengths[i % layout.micro_batch] if layout.lengths else layout.seq_len
        if trace.rows != rows_wanted:
            wanted = f"its packed length {rows_wanted}" if layout.lengths else f"seq_len = {rows_wanted}"
            raise MegatronReplayError(
                f"{where}: {trace.rows} rows, expected {wanted} (one per input position)"
            )
        checks = (
            ("num_experts", trace.num_experts, layout.num_experts),
            ("top_k", trace.top_k, layout.top_k),
            ("num_layers", trace.num_layers, layout.num_layers),
            ("moe_layers", trace.moe_layers, layout.moe_layers),
        )
        for name, got, want in checks:
            if got != want:
                raise MegatronReplayError(f"{where}: {name} = {got}, the model has {want}")
        experts = torch.from_numpy(trace.to_decoder_axis().experts.astype("int64"))
        rows.append(torch.nn.functional.pad(experts, (0, 0, 0, 0, 0, layout.seq_len - trace.rows)))
    return torch.stack(rows)


def rank_targets(
    routes: torch.Tensor,
    layout: MegatronLayout,
    *,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int,
    vpp_chunk: int = 0,
) -> list[torch.Tensor]:
    """The targets of every router of one rank, in build order: each ``[S/tp · B, k]`` int64.

    ``routes`` is the decoder-axis batch ``[dp·B, S, layers, k]`` of :func:`batch_routes`.
    """
    if routes.dim() != 4 or tuple(routes.shape) != (
        layout.global_batch,
        layout.seq_len,
        layout.num_layers,
        layout.top_k,
    ):
        raise MegatronReplayError(
            f"routes: expected [dp·B={layout.global_batch}, S={layout.seq_len}, layers={layout.num_layers}, "
            f"k={layout.top_k}], got {tuple(routes.shape)}"
        )
    _check_coordinate("dp_rank", dp_rank, layout.dp)
    _check_coordinate("pp_rank", pp_rank, layout.pp)
    _check_coordinate("vpp_chunk", vpp_chunk, layout.vpp)
    b = layout.micro_batch
    micro = routes[dp_rank * b : (dp_rank + 1) * b]  # [B, S, L, k]
    seq_major = micro.transpose(0, 1)  # [S, B, L, k]: token s·B + b after flattening
    shard = layouts.sp_shard(seq_major, layout.tp, tp_rank)  # [S/tp, B, L, k]
    tokens = shard.reshape(-1, layout.num_layers, layout.top_k)  # [S/tp·B, L, k]
    return stage_router_targets(tokens, layout, pp_rank, vpp_chunk)


def stage_router_targets(
    tokens: torch.Tensor, layout: MegatronLayout, pp_rank: int, vpp_chunk: int = 0
) -> list[torch.Tensor]:
    """One rank's token rows ``[N, L, k]`` → the targets of its stage's routers, in build order."""
    stage = layouts.stage_targets(tokens, layout.moe_layers, layout.stage_layers(pp_rank, vpp_chunk))
    return [stage[:, j].contiguous() for j in range(stage.shape[1])]


def merge_recordings(
    recordings: Mapping[tuple[int, int, int], Sequence[torch.Tensor]], layout: MegatronLayout
) -> torch.Tensor:
    """Inverse of :func:`rank_targets` over all ranks and chunks: MoE-ordinal routes ``[dp·B, S, n_moe, k]``.

    ``recordings[(dp_rank, tp_rank, pp_rank)]`` is the list of one rank's per-router recordings in
    build order (``RouterReplay.get_recorded_data()``: chunk after chunk with VPP), each
    ``[S/tp · B, k]``.
    """
    expected = {(d, t, p) for d in range(layout.dp) for t in range(layout.tp) for p in range(layout.pp)}
    if set(recordings) != expected:
        raise MegatronReplayError(
            f"recordings: missing {sorted(expected - set(recordings))}, "
            f"unexpected {sorted(set(recordings) - expected)}"
        )
    ranges = [[layout.stage_layers(p, c) for c in range(layout.vpp)] for p in range(layout.pp)]
    samples = []
    for d in range(layout.dp):
        per_stage = {}
        for p in range(layout.pp):
            shards = [_rank_recording(recordings, (d, t, p), layout) for t in range(layout.tp)]
            # SP shards are contiguous in s and s is the major index, so concatenating the shards
            # restores [S·B, n_rank, k] in seq-major order; the rank's routers are its chunks' in turn.
            rows = layouts.sp_gather(shards, pad_len=0)
            first = 0
            for c in range(layout.vpp):
                count = len(layout.stage_moe_layers(p, c))
                per_stage[(p, c)] = rows[:, first : first + count]
                first += count
        merged = layouts.merge_stage_recordings(per_stage, ranges, layout.moe_layers)  # [S·B, n_moe, k]
        merged = merged.reshape(layout.seq_len, layout.micro_batch, -1, layout.top_k)
        samples.append(merged.transpose(0, 1))  # [B, S, n_moe, k]
    return torch.cat(samples, dim=0)


def _rank_recording(
    recordings: Mapping[tuple[int, int, int], Sequence[torch.Tensor]],
    key: tuple[int, int, int],
    layout: MegatronLayout,
) -> torch.Tensor:
    """One rank's recordings stacked ``[S/tp·B, n_rank, k]`` (rows ``s·B + b`` of its shard), checked."""
    per_router = list(recordings[key])
    routers = len(layout.rank_moe_layers(key[2]))
    if len(per_router) != routers:
        raise MegatronReplayError(f"recordings[{key}]: {len(per_router)} routers, expected {routers}")
    for j, rec in enumerate(per_router):
        if tuple(rec.shape) != (layout.local_tokens, layout.top_k):
            raise MegatronReplayError(
                f"recordings[{key}][{j}]: shape {tuple(rec.shape)}, "
                f"expected [{layout.local_tokens}, {layout.top_k}]"
            )
    if not per_router:
        return torch.zeros(layout.local_tokens, 0, layout.top_k, dtype=torch.long)
    return torch.stack([r.long() for r in per_router], dim=1)


def expected_local_map(gathered_targets: torch.Tensor, layout: MegatronLayout, ep_rank: int) -> torch.Tensor:
    """Which tokens each local expert of EP rank ``ep_rank`` must receive: bool ``[N, E/ep]``.

    ``gathered_targets [N, k]`` are the global targets of every token the dispatcher gathers (for
    the all-gather dispatcher: the ``tp·ep`` group's tokens in group-rank order).
    """
    local, owned = layouts.ep_local_ids(gathered_targets, layout.num_experts, layout.ep, ep_rank)
    out = torch.zeros(gathered_targets.shape[0], layout.num_experts // layout.ep + 1, dtype=torch.bool)
    out.scatter_(1, torch.where(owned, local, torch.full_like(local, out.shape[1] - 1)), True)
    return out[:, :-1]


def ids_to_map(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes ``[N, k]`` → bool membership ``[N, E]`` (sets: the order of the k ids does not matter)."""
    out = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    return out.scatter_(1, ids.long(), True)


def _check_coordinate(name: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise MegatronReplayError(f"{name} must be in [0, {size}), got {value}")


def random_traces(layout: MegatronLayout, seed: int) -> list[RoutingTrace]:
    """Canonical decoder-axis traces of random distinct routes (dense slots 0), one per sample
    (``S`` rows, or the sample's length in a packed layout)."""
    gen = torch.Generator().manual_seed(seed)
    traces = []
    for i in range(layout.global_batch):
        rows = layout.lengths[i % layout.micro_batch] if layout.lengths else layout.seq_len
        ids = torch.zeros(rows, layout.num_layers, layout.top_k, dtype=torch.long)
        scores = torch.rand(rows, len(layout.moe_layers), layout.num_experts, generator=gen)
        ids[:, list(layout.moe_layers)] = scores.topk(layout.top_k, dim=-1).indices
        traces.append(RoutingTrace(ids.numpy(), num_experts=layout.num_experts, moe_layers=layout.moe_layers))
    return traces
