"""The reference MoE LM on one rank of a parallel layout: what each rank computes and exchanges.

`ShardedMoELM` is built from the same `MoEConfig` as `MoELM` (so it has bit-identical weights) and
keeps only what its rank runs: the decoder layers of its pipeline stage's virtual chunks, the
embedding on the first stage, the final norm and LM head on the last, and its EP rank's experts.
It *is* a `MoELM` for routing replay: `routers()`, `set_replay_targets`, `pop_recording`,
`last_dispatch` and `set_routing_mode` act on this rank's routers only, in decoder order (as
Megatron-core's `RouterReplay` instances on a rank are only that rank's routers), so a replay
handle built for `MoELM` drives it unchanged.

What is sharded, and what is not (honestly):

* **Routers see exactly their rank's tokens.** A rank's input is its CP zig-zag shard of one
  sequence (chunks ``r`` and ``2·cp−1−r``); under TP the MoE block routes only the rank's
  contiguous ``S/tp`` sequence-parallel shard of those tokens, zero-padded to a multiple of tp
  (Megatron: MoE under TP needs SP). Router targets and recordings are therefore
  ``[local_tokens, top_k]`` per router; with one packed sequence per micro-batch (B = 1)
  Megatron's seq-major order ``s·B + b`` is just the position order.
* **Experts are sharded under EP** with a real dispatch: every (token, slot) pair is sent with
  ``all_to_all`` to the EP rank owning its expert (ownership and local ids from
  ``layouts.ep_local_ids``), computed there, sent back and combined with the gate weights on the
  routing rank. Ids stay global until the dispatch: recordings and targets are global ids.
* **Layers are sharded under PP/VPP**: a rank holds only its stages' layers; hidden states travel
  between stages with point-to-point send/recv (`reference_impl.distributed.pipeline`).
* **CP attention** computes queries for the rank's own tokens only and ``all_gather``s the keys and
  values of the whole sequence (the simple, exact form of ring attention).
* **Not sharded:** attention heads and MLP/expert weights are not split across TP ranks. Every TP
  rank computes attention and the dense MLPs on its whole (CP-local) sequence, replicated; after
  the MoE block the TP ranks ``all_gather`` their shards' outputs so each again holds the full
  sequence. This changes the cost, not what any router sees.

Only `ep_local_ids`/`ep_global_ids` come from the ``layouts`` argument (a subject under test may
supply its own); which tokens, positions and layers a rank holds is this module's own rule,
`reference_impl.layouts` — the trainer that replay targets have to match.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .. import layouts as reference_layouts
from ..config import MoEConfig
from ..model import Attention, DecoderLayer, MoEBlock, MoELM, RMSNorm, apply_rope, rope_tables
from ..routers import ReplayError, Router, set_replay_targets
from .collectives import all_gather_cat, all_to_all_rows, exchange_counts
from .topology import ParallelSpec, ProcessGroups, RankPlace


class ShardedMoEBlock(nn.Module):
    """An MoE block on one rank: its router on the rank's tokens, its EP rank's experts, real dispatch.

    Parameter names match `MoEBlock` (``router.…``, ``experts.<global id>.…``, ``shared_expert.…``),
    so gradients can be compared name by name with the single-process model.
    """

    def __init__(
        self, block: MoEBlock, spec: ParallelSpec, place: RankPlace, groups: ProcessGroups, layouts: Any
    ) -> None:
        super().__init__()
        self.router: Router = block.router
        self.num_experts, self.top_k = block.router.num_experts, block.router.top_k
        self.spec, self.place, self.groups, self.layouts = spec, place, groups, layouts
        per_rank = self.num_experts // spec.ep
        owned = layouts.ep_global_ids(torch.arange(per_rank), self.num_experts, spec.ep, place.ep)
        self.experts = nn.ModuleDict({str(int(g)): block.experts[int(g)] for g in owned})
        self.shared_expert = block.shared_expert
        self.last_dispatch: Tensor | None = None
        self.dispatch_log: list[Tensor] = []  # ids dispatched by every call, recompute included

    def forward(self, x: Tensor) -> Tensor:
        batch, length, hidden = x.shape
        tokens = x.reshape(batch * length, hidden)
        if self.spec.tp > 1:  # sequence parallel: this rank routes its contiguous shard only
            tokens = sp_shard_rows(tokens, self.spec.tp, self.place.tp)
        ids, weights, _ = self.router(tokens)
        self.last_dispatch = ids.detach().clone()
        self.dispatch_log.append(self.last_dispatch)
        out = self._dispatch_and_combine(tokens, ids, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        if self.spec.tp > 1:  # back to the full sequence, which the replicated attention needs
            out = all_gather_cat(out, self.groups.tp, replicated_downstream=True)[: batch * length]
        return out.view(batch, length, hidden)

    def _dispatch_and_combine(self, tokens: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Σ_k w_k · expert_{id_k}(token), each expert evaluated on the EP rank that owns it."""
        ep, group = self.spec.ep, self.groups.ep
        pair_token = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(self.top_k)
        pair_ids = ids.reshape(-1)  # pair p = (token p // k, slot p % k), global expert ids
        owner = torch.full_like(pair_ids, -1)
        local = torch.full_like(pair_ids, -1)
        for rank in range(ep):
            local_ids, owned = self.layouts.ep_local_ids(pair_ids, self.num_experts, ep, rank)
            owner = torch.where(owned, rank, owner)
            local = torch.where(owned, local_ids.to(local.device), local)
        if bool((owner < 0).any()):
            orphan = sorted(set(pair_ids[owner < 0].tolist()))
            raise ReplayError(
                f"{self.place.describe()}: expert ids {orphan} have no owner among the "
                f"{ep} EP ranks (ep_local_ids owns none of them)"
            )
        order = torch.argsort(owner, stable=True)  # pairs grouped by destination rank
        send_counts = torch.bincount(owner, minlength=ep)
        recv_counts = exchange_counts(send_counts, group)
        sends, recvs = send_counts.tolist(), recv_counts.tolist()
        rows = all_to_all_rows(tokens[pair_token[order]], sends, recvs, group)
        row_local = all_to_all_rows(local[order], sends, recvs, group)
        out_rows = torch.zeros_like(rows)
        for local_id, expert in enumerate(self.experts.values()):
            picked = (row_local == local_id).nonzero().squeeze(1)
            if picked.numel():
                out_rows = out_rows.index_add(0, picked, expert(rows[picked]))
        back = all_to_all_rows(out_rows, recvs, sends, group)
        pair_out = back[torch.argsort(order)]  # undo the grouping by destination
        # Weights may be fp32 (Mixtral rule): multiply in their precision, then cast back.
        weighted = (pair_out * weights.reshape(-1, 1)).to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, pair_token, weighted)


def sp_shard_rows(x: Tensor, tp: int, rank: int) -> Tensor:
    """Rank ``rank``'s contiguous shard of ``x`` [T, ...] zero-padded to a multiple of ``tp``
    (the rule of `layouts.sp_shard`; written with ``F.pad`` so it runs on any device)."""
    size = -(-x.shape[0] // tp)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, size * tp - x.shape[0]))
    return padded[rank * size : (rank + 1) * size]


class ShardedMoELM(MoELM):
    """`MoELM` on one rank of ``spec`` (see the module docstring for what is sharded).

    Build it on every rank after `new_groups`; drive it with `reference_impl.distributed.pipeline`
    (or `forward` when ``pp == 1``). ``layouts`` supplies ``ep_local_ids``/``ep_global_ids``.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        spec: ParallelSpec,
        rank: int,
        groups: ProcessGroups,
        *,
        layouts: Any | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        nn.Module.__init__(self)  # MoELM's own __init__, without its meta-device detour (below)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # Same modules in the same order, filled by MoELM's own seeded init: bit-identical weights.
        # (Built on the CPU rather than the meta device: meta-device init imports torch._dynamo,
        # ~1.4 s of CPU per spawned rank for nothing.)
        self._init_weights(torch.Generator().manual_seed(cfg.seed))
        self.to(cfg.torch_dtype)
        self.spec, self.place, self.groups = spec, spec.place(rank), groups
        self.layouts: Any = layouts if layouts is not None else reference_layouts
        self.device = torch.device(device)
        self.chunk_layers: list[range] = reference_layouts.pp_layer_ranges(cfg.num_layers, spec.pp, spec.vpp)[
            self.place.pp
        ]
        kept = nn.ModuleDict()
        for chunk in self.chunk_layers:
            for index in chunk:
                layer: DecoderLayer = self.layers[index]
                if isinstance(layer.mlp, MoEBlock):
                    layer.mlp = ShardedMoEBlock(layer.mlp, spec, self.place, groups, self.layouts)
                kept[str(index)] = layer
        self.layers = kept  # type: ignore[assignment]  # names stay "layers.<decoder index>.…"
        self.is_first_stage = self.place.pp == 0  # runs model chunk 0: the embedding
        self.is_last_stage = self.place.pp == spec.pp - 1  # runs the last model chunk: the head
        if not self.is_first_stage:
            self.embed = None  # type: ignore[assignment]
        if not self.is_last_stage:
            self.final_norm = None  # type: ignore[assignment]
            self.lm_head = None  # type: ignore[assignment]
        self.to(self.device)

    # -- routing replay: this rank's routers only --------------------------------------------

    def _moe_blocks(self) -> list[ShardedMoEBlock]:
        return [layer.mlp for layer in self.layers.values() if isinstance(layer.mlp, ShardedMoEBlock)]

    @property
    def moe_layers_here(self) -> list[int]:
        """Decoder indices of this rank's MoE layers, in decoder order (its routers' order)."""
        return [block.router.layer for block in self._moe_blocks()]

    def routers(self) -> list[Router]:
        return [block.router for block in self._moe_blocks()]

    @property
    def last_dispatch(self) -> list[Tensor | None]:  # type: ignore[override]
        return [block.last_dispatch for block in self._moe_blocks()]

    def dispatch_log(self) -> list[list[Tensor]]:
        """Per router of this rank, the ids dispatched by each call so far (recompute included)."""
        return [list(block.dispatch_log) for block in self._moe_blocks()]

    def clear_dispatch_log(self) -> None:
        for block in self._moe_blocks():
            block.dispatch_log.clear()

    def set_replay_targets(self, targets: Tensor, mask: Tensor | None = None) -> None:
        """Give each of this rank's routers its slice of ``targets`` [local_tokens, n_here, k]."""
        try:
            set_replay_targets(
                [router.replay for router in self.routers()], targets, mask, self.moe_layers_here
            )
        except ReplayError as err:
            raise ReplayError(f"{self.place.describe()}: {err}") from None

    # -- the forward, in pieces the pipeline schedule calls ------------------------------------

    def positions(self, local_len: int) -> Tensor:
        """Sequence positions of this rank's ``local_len`` tokens (its CP zig-zag chunks)."""
        if self.spec.cp == 1:
            return torch.arange(local_len, device=self.device)
        indices = reference_layouts.cp_zigzag_indices(local_len * self.spec.cp, self.spec.cp, self.place.cp)
        return indices.to(self.device)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Hidden states [1, T, H] of this rank's tokens [T] (first stage only)."""
        if self.embed is None:
            raise RuntimeError(f"{self.place.describe()} is not the first pipeline stage: no embedding")
        return self.embed(tokens.to(self.device)[None])

    def run_chunk(
        self, chunk: int, hidden: Tensor, positions: Tensor, *, use_checkpoint: bool = False
    ) -> Tensor:
        """Run virtual chunk ``chunk`` of this rank's layers on ``hidden`` [1, T, H].

        ``use_checkpoint`` recomputes each layer in backward (non-reentrant `checkpoint`); the
        routers must then be in REPLAY_BACKWARD during backward to replay what the forward used.
        """
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        cos, sin = rope_tables(positions[None], head_dim, self.cfg.torch_dtype)
        for index in self.chunk_layers[chunk]:
            layer = self.layers[str(index)]
            if use_checkpoint:
                hidden = checkpoint(self._layer, layer, hidden, cos, sin, positions, use_reentrant=False)
            else:
                hidden = self._layer(layer, hidden, cos, sin, positions)
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        """Logits [T, V] (last stage only)."""
        if self.lm_head is None or self.final_norm is None:
            raise RuntimeError(f"{self.place.describe()} is not the last pipeline stage: no LM head")
        return self.lm_head(self.final_norm(hidden))[0]

    def forward(self, tokens: Tensor, *, use_checkpoint: bool = False, **_: Any) -> Tensor:  # type: ignore[override]
        """Logits [T, V] of this rank's tokens [T], when one rank holds every layer (``pp == 1``)."""
        if self.spec.pp != 1:
            raise RuntimeError("pp > 1: run the stages with reference_impl.distributed.pipeline")
        hidden = self.embed_tokens(tokens)
        positions = self.positions(tokens.shape[0])
        for chunk in range(len(self.chunk_layers)):
            hidden = self.run_chunk(chunk, hidden, positions, use_checkpoint=use_checkpoint)
        return self.head(hidden)

    def _layer(self, layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        x = x + self._attention(layer.attn, layer.attn_norm(x), cos, sin, positions)
        return x + layer.mlp(layer.mlp_norm(x))

    def _attention(self, attn: Attention, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor) -> Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys (CP: all_gather)."""
        batch, length, hidden = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, length, attn.num_heads, attn.head_dim).transpose(1, 2)

        q = apply_rope(heads(attn.q_proj(x)), cos, sin)
        k = apply_rope(heads(attn.k_proj(x)), cos, sin)
        v = heads(attn.v_proj(x))
        key_positions = positions
        if self.spec.cp > 1:
            k = all_gather_cat(k, self.groups.cp, dim=2, replicated_downstream=False)
            v = all_gather_cat(v, self.groups.cp, dim=2, replicated_downstream=False)
            cp, padded = self.spec.cp, length * self.spec.cp
            key_positions = torch.cat([reference_layouts.cp_zigzag_indices(padded, cp, r) for r in range(cp)])
            in_order = torch.argsort(key_positions).to(self.device)  # keys in sequence order
            k, v, key_positions = (
                k[:, :, in_order],
                v[:, :, in_order],
                key_positions.to(self.device)[in_order],
            )
        mask = key_positions[None, :] <= positions[:, None]  # causal, on sequence positions
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        return attn.o_proj(out.transpose(1, 2).reshape(batch, length, hidden))


__all__ = ["ShardedMoEBlock", "ShardedMoELM", "sp_shard_rows"]
