"""How routes reach verl: the payload type an engine hands ``routed_experts`` over in, and the
jagged (no-padding) form verl's trainer holds a batch in. Shared by the splice, the placement and
the Megatron data movement."""

from __future__ import annotations

from typing import Any, Literal

import torch

Payload = Literal["numpy", "tensor"]
"""How the engine hands ``routed_experts`` to verl: ``numpy`` (vLLM; SGLang from 0.9.0), ``tensor``
(verl 0.8.0's SGLang path with ``skip_tokenizer_init``)."""


def as_payload(routes: torch.Tensor | None, payload: Payload) -> Any:
    """``routes`` in the type the engine hands them to verl (``None`` stays ``None``: no routes)."""
    if routes is None:
        return None
    return routes.numpy().copy() if payload == "numpy" else routes.clone()


def jagged(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each sample's attended positions of ``x [B, W, ...]``, in order, as a jagged tensor: the
    form ``left_right_2_no_padding`` gives the trainer's ``input_ids`` and ``routed_experts``."""
    attended = torch.as_tensor(attention_mask).bool()
    return torch.nested.as_nested_tensor(
        [row[keep] for row, keep in zip(torch.as_tensor(x), attended, strict=True)], layout=torch.jagged
    )
