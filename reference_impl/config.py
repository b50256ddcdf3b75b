"""Configuration of the reference MoE language model.

`MoEConfig` describes a small decoder-only model: which decoder layers are dense (the first
`first_k_dense`), which router family each MoE layer uses, and the family parameters. Every field is
checked when the config is built; a bad value raises `ConfigError` naming the field and what it
must be, so a test never runs on a silently impossible model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from .axes import LayerAxis


def layer_width(axis: LayerAxis | str, num_layers: int, moe_layers: Sequence[int]) -> int:
    """Slots on the layer axis `axis` of a model with `num_layers` decoder layers whose MoE layers
    are `moe_layers` (decoder indices): `num_layers` on the decoder axis, one per MoE layer else."""
    return num_layers if LayerAxis.parse(axis) is LayerAxis.DECODER else len(moe_layers)


def moe_slots(axis: LayerAxis | str, moe_layers: Sequence[int]) -> tuple[int, ...]:
    """Indices along the layer axis `axis` that hold MoE routes (the others are dense filler)."""
    if LayerAxis.parse(axis) is LayerAxis.DECODER:
        return tuple(moe_layers)
    return tuple(range(len(moe_layers)))


def check_moe_layers(
    moe_layers: Iterable[int],
    num_layers: int | None = None,
    *,
    error: type[Exception] = ValueError,
    field: str = "moe_layers",
) -> tuple[int, ...]:
    """`moe_layers` as a tuple, once it is known to hold strictly increasing decoder indices >= 0
    (and < `num_layers` when given); otherwise `error` naming `field` and the expected value."""
    moe = tuple(moe_layers)
    span = ">= 0" if num_layers is None else f"in [0, num_layers={num_layers})"
    if any(b <= a for a, b in pairwise(moe)) or (
        moe and (moe[0] < 0 or (num_layers is not None and moe[-1] >= num_layers))
    ):
        raise error(f"{field}: expected strictly increasing decoder indices {span}, got {list(moe)}")
    return moe


def axis_of_width(width: int, num_layers: int, num_moe_layers: int) -> LayerAxis | None:
    """The layer axis a payload `width` slots wide is on (None: neither). The decoder axis wins
    when every layer is a MoE layer (both widths agree)."""
    if width == num_layers:
        return LayerAxis.DECODER
    if width == num_moe_layers:
        return LayerAxis.MOE_ORDINAL
    return None


# The gate-weight rules the reference implements (see `reference_impl.routers` and FACTS §3).
ROUTER_FAMILIES: tuple[str, ...] = (
    "softmax_topk",  # Qwen2/3-MoE, OlMoE
    "softmax_topk_fp32",  # Mixtral, MiniMax
    "topk_softmax",  # GPT-OSS
    "sigmoid_grouped",  # DeepSeek-V3, GLM4-MoE
    "llama4",  # Llama 4
)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConfigError(ValueError):
    """An invalid `MoEConfig` field; the message names the field and the expected value."""


def _require(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ConfigError(f"MoEConfig.{field} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class MoEConfig:
    """A tiny decoder-only MoE LM.

    Decoder layers `0 .. first_k_dense-1` use a dense MLP and have no router (DeepSeek-V3's
    `first_k_dense_replace`); the others are MoE layers. `router_family` is one family for every
    MoE layer or a tuple with one entry per *decoder* layer (entries of dense layers are unused).
    `n_group`, `topk_group` and `routed_scaling_factor` only matter to `sigmoid_grouped`.
    """

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 32
    first_k_dense: int = 0
    router_family: str | tuple[str, ...] = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert: bool = False
    mtp_layers: int = 0
    max_positions: int = 512
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.router_family, list):  # keep the config hashable
            object.__setattr__(self, "router_family", tuple(self.router_family))
        self._validate()

    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_experts",
            "expert_hidden",
            "max_positions",
        ):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, name, value, "an int >= 1")
        _require(
            self.hidden_size % self.num_heads == 0,
            "hidden_size",
            self.hidden_size,
            f"a multiple of num_heads ({self.num_heads})",
        )
        head_dim = self.hidden_size // self.num_heads
        _require(
            head_dim % 2 == 0,
            "hidden_size",
            self.hidden_size,
            f"an even head dimension hidden_size/num_heads for RoPE (got {head_dim})",
        )
        _require(
            1 <= self.top_k <= self.num_experts,
            "top_k",
            self.top_k,
            f"an int in [1, num_experts={self.num_experts}]",
        )
        _require(
            0 <= self.first_k_dense <= self.num_layers,
            "first_k_dense",
            self.first_k_dense,
            f"an int in [0, num_layers={self.num_layers}]",
        )
        self._validate_families()
        _require(
            self.n_group >= 1 and self.num_experts % self.n_group == 0,
            "n_group",
            self.n_group,
            f"a divisor of num_experts={self.num_experts}",
        )
        _require(
            1 <= self.topk_group <= self.n_group,
            "topk_group",
            self.topk_group,
            f"an int in [1, n_group={self.n_group}]",
        )
        if any(self.family_of(layer) == "sigmoid_grouped" for layer in self.moe_layers):
            reachable = self.topk_group * (self.num_experts // self.n_group)
            _require(
                self.top_k <= reachable,
                "top_k",
                self.top_k,
                f"<= topk_group * num_experts / n_group = {reachable} (experts left after "
                "the group limit of sigmoid_grouped)",
            )
        _require(
            self.routed_scaling_factor > 0,
            "routed_scaling_factor",
            self.routed_scaling_factor,
            "a number > 0",
        )
        _require(
            isinstance(self.mtp_layers, int) and self.mtp_layers >= 0,
            "mtp_layers",
            self.mtp_layers,
            "an int >= 0",
        )
        _require(
            not self.mtp_layers or bool(self.moe_layers),
            "mtp_layers",
            self.mtp_layers,
            "0 for a model without MoE layers (an MTP block routes like the last MoE layer)",
        )
        for name in ("norm_topk_prob", "shared_expert"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {sorted(DTYPES)}")

    def _validate_families(self) -> None:
        known = f"one of {list(ROUTER_FAMILIES)}"
        if isinstance(self.router_family, str):
            _require(self.router_family in ROUTER_FAMILIES, "router_family", self.router_family, known)
            return
        _require(
            isinstance(self.router_family, tuple) and len(self.router_family) == self.num_layers,
            "router_family",
            self.router_family,
            f"a family name or a tuple of num_layers={self.num_layers} names",
        )
        for family in self.router_family:
            _require(family in ROUTER_FAMILIES, "router_family", family, known)

    @classmethod
    def tiny(cls, **overrides: object) -> MoEConfig:
        """The tests' tiny model: 64 tokens, width 32, 3 decoder layers of which the first is dense (so
        the decoder and MoE-ordinal layer axes differ), 8 experts, top-2; a forward takes milliseconds
        on CPU. ``overrides`` change any field (``MoEConfig.tiny(seed=5, router_family="llama4")``)."""
        fields: dict[str, object] = {
            "vocab_size": 64,
            "hidden_size": 32,
            "num_layers": 3,
            "first_k_dense": 1,
            "num_experts": 8,
            "top_k": 2,
        }
        return cls(**{**fields, **overrides})  # type: ignore[arg-type]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder indices of the MoE layers, in order (the MoE-ordinal axis maps onto these)."""
        return tuple(range(self.first_k_dense, self.num_layers))

    def family_of(self, layer: int) -> str:
        """Router family of decoder layer `layer` (dense layers have no router)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"decoder layer {layer} not in [0, num_layers={self.num_layers})")
        if isinstance(self.router_family, str):
            return self.router_family
        return self.router_family[layer]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of the model's parameters and activations."""
        return DTYPES[self.dtype]
