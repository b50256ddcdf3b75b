"""``layouts.pack`` / ``layouts.unplace`` (0.9.1 only): the trainer's no-padding layout,
``left_right_2_no_padding`` (``verl/workers/utils/padding.py``) and ``pad_input``
(``verl/utils/attention_utils.py``). 0.8.0 and 0.9.0 import them from ``flash_attn.bert_padding``,
a CUDA-only package, so on CPU they are absent (the suite's skip names them); 0.9.1 falls back to
pure torch. The other layout functions (micro-batches, SP/CP, PP/VPP, EP) are not wrapped.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.subjects.frameworks import require_release
from harness.subjects.frameworks.verl.placement import Layouts
from reference_impl.layouts import Placed


def _no_padding(
    tokens: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor | None = None
) -> Any:
    """``left_right_2_no_padding`` (``verl/workers/utils/padding.py``) on a padded batch: the
    trainer's conversion to jagged ``input_ids`` (and ``routed_experts``) with the flat ``indices``
    of the real tokens. The response mask it requires is only carried along (its width becomes
    ``max_response_len``), so the attention mask stands in for it."""
    from tensordict import TensorDict
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    mask = torch.as_tensor(attention_mask).long()
    fields = {
        "input_ids": torch.as_tensor(tokens),
        "attention_mask": mask,
        "response_mask": mask,
        "position_ids": compute_position_id_with_mask(mask),
    }
    if routes is not None:
        fields["routed_experts"] = torch.as_tensor(routes)
    return left_right_2_no_padding(TensorDict(fields, batch_size=mask.shape[0]))


class _Packing:
    """verl's no-padding layout of a ``[B, W]`` batch (``reference_impl.layouts.Packing``'s members).

    ``gather`` is ``left_right_2_no_padding``: a ``[B, W]`` tensor goes through it as
    ``input_ids``, a ``[B, W, layers, top_k]`` one as ``routed_experts``; ``scatter`` is the
    release's ``pad_input`` (``verl/utils/attention_utils.py``, which fills the padding with zeros)
    at the same ``indices``.
    """

    def __init__(self, attention_mask: torch.Tensor) -> None:
        from verl.utils import tensordict_utils as tu

        self.attention_mask = torch.as_tensor(attention_mask)
        self.batch_shape = tuple(self.attention_mask.shape)
        packed = _no_padding(torch.zeros(self.batch_shape, dtype=torch.long), self.attention_mask)
        self.indices = tu.get_non_tensor_data(data=packed, key="indices", default=None)
        self.cu_seqlens = packed["input_ids"].offsets()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return _no_padding(x, self.attention_mask)["input_ids"].values()
        zeros = torch.zeros(self.batch_shape, dtype=torch.long)
        return _no_padding(zeros, self.attention_mask, routes=x)["routed_experts"].values()

    def scatter(self, y: torch.Tensor, fill: float = 0) -> torch.Tensor:
        from verl.utils.attention_utils import pad_input

        if fill:
            raise ValueError(f"verl's pad_input fills the padding with zeros, not {fill!r}")
        return pad_input(y, self.indices, *self.batch_shape)


class NoPaddingLayouts(Layouts):
    """From 0.9.1, also the trainer's no-padding layout: ``left_right_2_no_padding`` runs on CPU
    (0.8.0 and 0.9.0 import ``flash_attn.bert_padding``, a CUDA-only package, for it)."""

    def pack(self, attention_mask: torch.Tensor) -> _Packing:
        require_release("verl", self.version, f"verl-{self.version}")
        return _Packing(attention_mask)

    def unplace(self, placed: Placed) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sample's tokens and rows as the trainer unpads them (jagged ``input_ids`` and
        ``routed_experts``); the row at a sample's last token is the placement's filler, not one of
        its ``len − 1`` rows, and is left out."""
        require_release("verl", self.version, f"verl-{self.version}")
        packed = _no_padding(placed.tokens, placed.attention_mask, routes=placed.routes)
        return [
            (tokens, routes[:-1])
            for tokens, routes in zip(
                packed["input_ids"].unbind(), packed["routed_experts"].unbind(), strict=True
            )
        ]
