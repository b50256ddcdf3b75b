"""A small decoder-only MoE language model with routing record/replay.

Pre-norm decoder: token embedding → `num_layers` × (RMSNorm → causal attention with RoPE and an
optional KV cache → RMSNorm → dense SwiGLU MLP or `MoEBlock`) → RMSNorm → LM head.

Token order seen by routers: each MoE block flattens its input [B, T, H] row-major to [B*T, H], so
router row `b*T + t` is batch row b, position t of *this call*. Replay targets, recordings and
`last_dispatch` all use that order. (Megatron-core is seq-major, `s*B + b`; the layouts module
converts.) With a KV cache, each call routes only its new tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import MoEConfig
from .routers import Router, RoutingMode, SigmoidGrouped, pop_recording, set_replay_targets

ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back (as transformers does)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_tables(position_ids: Tensor, head_dim: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin tables [B, 1, T, head_dim] for rotary embeddings at `position_ids` [B, T]."""
    inv_freq = ROPE_THETA ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate query/key `x` [B, heads, T, D] by the position angles (rotate-half convention)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def attention_mask_4d(attention_mask: Tensor | None, batch: int, new: int, past: int) -> Tensor:
    """Boolean SDPA mask [B, 1, new, past+new]: True where a query may attend to a key.

    Causal, and keys where `attention_mask` [B, past+new] is 0 (padding) are hidden. A padding
    query would then see no key at all (a NaN softmax), so every query may always see itself;
    real tokens never see padding, and padding outputs are never used.
    """
    query_pos = torch.arange(past, past + new)[:, None]
    key_pos = torch.arange(past + new)[None, :]
    allowed = (key_pos <= query_pos).expand(batch, 1, new, past + new)
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, None, :]
        allowed = allowed | (key_pos == query_pos)
    return allowed


class KVCache:
    """Keys and values [B, heads, S, head_dim] of every decoder layer for the S tokens so far.

    Create with `MoELM.new_cache(batch)`; each forward call with the cache appends its tokens.
    """

    def __init__(self, batch: int, num_layers: int) -> None:
        self.batch = batch
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        """Number of tokens already cached."""
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' keys/values of `layer`; return all of that layer's so far."""
        past_keys, past_values = self.keys[layer], self.values[layer]
        if past_keys is not None and past_values is not None:
            keys = torch.cat([past_keys, keys], dim=2)
            values = torch.cat([past_values, values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (a speculative step drops its rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length}: expected 0 <= length <= {self.length} (cached tokens)")
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE, through `F.scaled_dot_product_attention`."""

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache | None) -> Tensor:
        batch, new, hidden = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, new, self.num_heads, self.head_dim).transpose(1, 2)

        q = apply_rope(heads(self.q_proj(x)), cos, sin)
        k = apply_rope(heads(self.k_proj(x)), cos, sin)
        v = heads(self.v_proj(x))
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, new, hidden))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP, each routed expert and the shared expert."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Dispatch(nn.Module):
    """The step where tokens reach their experts: out = Σ_k w_k · expert_{id_k}(x).

    A module of its own (no parameters) so that the point where routing takes effect can be watched
    from outside the router: a forward pre-hook sees `(tokens, ids, weights, experts)`, the ids and
    gate weights each token's hidden state is actually sent with (transformers' `mlp.experts`
    receives the same `(hidden, ids, weights)`).
    """

    def forward(self, tokens: Tensor, ids: Tensor, weights: Tensor, experts: nn.ModuleList) -> Tensor:
        out = torch.zeros_like(tokens)
        for expert_id, expert in enumerate(experts):
            rows, slots = torch.where(ids == expert_id)
            if rows.numel() == 0:
                continue
            # Weights may be fp32 (Mixtral rule): multiply in their precision, then cast back.
            contribution = expert(tokens[rows]) * weights[rows, slots, None]
            out = out.index_add(0, rows, contribution.to(out.dtype))
        return out


class MoEBlock(nn.Module):
    """Router + routed experts (+ optional shared expert): out = Σ_k w_k · expert_{id_k}(x).

    `last_dispatch` holds the ids [B*T, k] actually sent to the experts by the last call, the
    point where replay must have taken effect.
    """

    def __init__(
        self, cfg: MoEConfig, layer: int, *, where: str | None = None, family: str | None = None
    ) -> None:
        super().__init__()
        self.router = Router(cfg, layer, where=where, family=family)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden_size, cfg.expert_hidden) for _ in range(cfg.num_experts)
        )
        self.shared_expert = SwiGLU(cfg.hidden_size, cfg.expert_hidden) if cfg.shared_expert else None
        self.dispatch = Dispatch()
        self.last_dispatch: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        batch, new, hidden = x.shape
        tokens = x.reshape(batch * new, hidden)  # router row b*T + t
        ids, weights, _ = self.router(tokens)
        self.last_dispatch = ids.detach()
        out = self.dispatch(tokens, ids, weights, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(batch, new, hidden)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)); mlp is dense or `MoEBlock`."""

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.hidden_size)
        if layer in cfg.moe_layers:
            self.mlp: nn.Module = MoEBlock(cfg, layer)
        else:  # dense layer: as wide as the top_k experts a token would use
            self.mlp = SwiGLU(cfg.hidden_size, cfg.expert_hidden * cfg.top_k)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: KVCache | None = None
    ) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        return x + self.mlp(self.mlp_norm(x))


class MTPBlock(nn.Module):
    """One multi-token-prediction block (DeepSeek-V3's MTP module, without its attention): the last
    hidden state and the next token's embedding, each normalised, concatenated and projected, then an
    MoE layer of its own, routed like the model's last MoE layer.

    Its router is numbered as Megatron-core numbers MTP layers, 1-based within the MTP stack
    (``layer`` 1 for the first block), a number a decoder layer has too: a driver that keys routers
    by that bare number gives it a decoder layer's routes (FACTS §4 "MTP routers").
    """

    def __init__(self, cfg: MoEConfig, index: int) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size)
        self.embed_norm = RMSNorm(cfg.hidden_size)
        self.proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mlp = MoEBlock(
            cfg, index + 1, where=f"MTP block {index}", family=cfg.family_of(cfg.moe_layers[-1])
        )

    def forward(self, hidden: Tensor, next_embedding: Tensor) -> Tensor:
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embedding)], dim=-1))
        return x + self.mlp(x)


class MoELM(nn.Module):
    """The reference MoE LM, built deterministically from a `MoEConfig`.

    Same config → bit-identical weights: parameters are created on the meta device (no default
    init, global RNG untouched) and filled from a `torch.Generator` seeded with `cfg.seed`.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
            self.final_norm = RMSNorm(cfg.hidden_size)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.mtp = nn.ModuleList(MTPBlock(cfg, i) for i in range(cfg.mtp_layers))
        self.to_empty(device="cpu")
        self._init_weights(torch.Generator().manual_seed(cfg.seed))
        self.to(cfg.torch_dtype)

    @torch.no_grad()
    def _init_weights(self, gen: torch.Generator) -> None:
        """Fill every parameter/buffer in module order, in fp32.

        Linear weights ~ N(0, 1/fan_in) so router logits have unit scale and routing is far
        from ties; biases (GPT-OSS gate) and DeepSeek correction biases ~ N(0, 0.1²), small but
        large enough to change choices; embeddings ~ N(0, 1); norms = 1.
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, module.in_features**-0.5, generator=gen)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1, generator=gen)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=gen)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, SigmoidGrouped):
                module.e_score_correction_bias.normal_(0.0, 0.1, generator=gen)

    def new_cache(self, batch: int) -> KVCache:
        """An empty KV cache for `batch` sequences."""
        return KVCache(batch, self.cfg.num_layers)

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        use_checkpoint: bool = False,
    ) -> Tensor:
        """Logits [B, T, V] for `input_ids` [B, T].

        `attention_mask` [B, past+T]: 1 = real token, 0 = padding (left padding); it covers the
        cached tokens too. `position_ids` [B, T] default to the count of real tokens before each
        token, so a left-padded sample sees the positions of its unpadded self. With `cache`, the
        call appends its tokens to it. `use_checkpoint` recomputes each decoder layer in backward
        (`torch.utils.checkpoint`, non-reentrant); routers must then be in REPLAY_BACKWARD
        during backward to replay what the forward used.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {list(input_ids.shape)}")
        batch, new = input_ids.shape
        past = 0
        if cache is not None:
            if use_checkpoint:
                raise ValueError("use_checkpoint with a KV cache would append to it twice")
            if cache.batch != batch:
                raise ValueError(f"cache is for batch {cache.batch}, input has batch {batch}")
            past = cache.length
        if attention_mask is not None and attention_mask.shape != (batch, past + new):
            raise ValueError(
                f"attention_mask has shape {list(attention_mask.shape)}, expected "
                f"[{batch}, {past + new}] (cached + new tokens)"
            )
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                position_ids = torch.arange(past, past + new).expand(batch, new)
        if int(position_ids.max()) >= self.cfg.max_positions:
            raise ValueError(f"position {int(position_ids.max())} >= max_positions {self.cfg.max_positions}")

        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        cos, sin = rope_tables(position_ids, head_dim, self.cfg.torch_dtype)
        mask = attention_mask_4d(attention_mask, batch, new, past)
        x = self.embed(input_ids)
        for layer in self.layers:
            if use_checkpoint:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, cache)
        if cache is None:
            self._run_mtp(x, input_ids)
        return self.lm_head(self.final_norm(x))

    def _run_mtp(self, hidden: Tensor, input_ids: Tensor) -> None:
        """The MTP blocks on the decoder's output and each next token's embedding (the last position
        takes its own), as a training forward runs them for the MTP loss. Their predictions are not
        part of the returned logits; each block's ``mlp.last_dispatch`` keeps what its experts received."""
        if not len(self.mtp):
            return
        following = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
        embedding = self.embed(following)
        for block in self.mtp:
            hidden = block(hidden, embedding)

    # -- routing replay helpers (MoE-ordinal layer axis: one slot per router, decoder order) --

    def routers(self) -> list[Router]:
        """The routers of the MoE layers, in decoder order."""
        return [layer.mlp.router for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def set_routing_mode(self, mode: RoutingMode) -> None:
        """Put every router in `mode`."""
        for router in self.routers():
            router.replay.mode = mode

    def set_replay_targets(self, targets: Tensor, mask: Tensor | None = None) -> None:
        """Give every router its slice of `targets` [B*T, num_moe_layers, k] (MoE-ordinal).

        `mask` [B*T] bool: rows where it is False route natively. Every router receives a
        target, so a wrong number of layers is an error rather than a partial replay.
        """
        set_replay_targets([router.replay for router in self.routers()], targets, mask, self.cfg.moe_layers)

    def pop_recording(self) -> Tensor:
        """Recorded routing [N, num_moe_layers, k] (int64), then clear the recordings.

        Each router's RECORD calls are concatenated along tokens (in call order), then stacked
        over MoE layers.
        """
        return pop_recording([router.replay for router in self.routers()])

    def clear_replay(self) -> None:
        """Clear every router's targets, recompute FIFO and recordings."""
        for router in self.routers():
            router.replay.clear()

    @property
    def last_dispatch(self) -> list[Tensor | None]:
        """Per MoE layer, the ids [B*T, k] the last forward dispatched to the experts."""
        return [layer.mlp.last_dispatch for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def dispatched_routes(self) -> Tensor:
        """The ids [B*T, n_moe, k] the last forward (or recompute) dispatched, MoE layers in order: what
        the experts received, observed at the dispatch step (a sharded model: this rank's layers)."""
        ids = self.last_dispatch
        if not ids or any(i is None for i in ids):
            raise RuntimeError("dispatched_routes: no forward has run through every MoE layer")
        return torch.stack([i for i in ids if i is not None], dim=1)
