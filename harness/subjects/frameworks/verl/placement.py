"""``layouts.place_left_padded``: the agent loop's placement,
``AgentLoopWorker._agent_loop_postprocess`` per sample (prompt left-padded to
``rollout.prompt_length``, response right-padded to ``rollout.response_length``, the rows written
from the prompt's first column) and ``_postprocess`` into one batch, driven without Ray on a
worker holding only what they read (a real transformers tokenizer for ``pad``, no processor, no
reward workers, no teacher). Each sample's ``len − 1`` rows arrive in the subject's payload type.
The replay mask is the one the release's Megatron engine applies to that batch: from 0.9.0
``build_r3_replay_mask`` (every row of a sample with a response but its last); 0.8.0 has none
(``set_router_replay_data(…, None, …)`` replays every position, the attention mask).
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Sequence
from typing import Any

import torch

from harness.subjects.frameworks import check_placement_arguments, require_release
from harness.subjects.frameworks.verl.payload import Payload, as_payload, jagged
from reference_impl.layouts import Placed


def _tokenizer() -> Any:
    """A real transformers tokenizer whose pad id is 0: the agent loop pads token ids with its
    ``pad`` (a word-level vocabulary of the pad token alone; ids are never decoded)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")


def _agent_loop_worker(version: str, prompt_width: int, response_width: int) -> Any:
    """The release's ``AgentLoopWorker`` with only what its postprocess reads: a text-only model (no
    processor), no reward workers, no distillation teacher, the rollout's prompt/response widths."""
    require_release("verl", version, f"verl-{version}")
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker: Any = object.__new__(AgentLoopWorker)
    worker.tokenizer = _tokenizer()
    worker.processor = None
    worker.mm_processor_kwargs = None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.rollout_config = types.SimpleNamespace(prompt_length=prompt_width, response_length=response_width)
    return worker


def _r3_replay_mask(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """verl's R3 replay mask (``build_r3_replay_mask``, 0.9.0+) of a padded batch, at its columns.

    The release builds it from the packed (jagged) ``input_ids`` the trainer holds after
    ``left_right_2_no_padding``, reading only each sample's length, and the padded response mask;
    here the jagged tensor holds each sample's attended tokens in order, and the mask's values go
    back to the attended columns they belong to.
    """
    from verl.utils.megatron.router_replay_utils import build_r3_replay_mask

    attended = attention_mask.bool()
    values = build_r3_replay_mask(jagged(input_ids, attended), response_mask).values()
    mask = torch.zeros_like(attended)
    mask[attended] = values
    return mask


def place_left_padded(
    version: str,
    payload: Payload,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """The agent loop's placement of the samples (``_agent_loop_postprocess`` per sample, then
    ``_postprocess`` into one batch), as a ``Placed`` batch of ``width`` columns.

    verl pads the prompt on the left to ``rollout.prompt_length`` and the response on the right to
    ``rollout.response_length``; the widths are the longest prompt and the rest of ``width``.
    Without ``prompt_lens`` each sample's first token is its prompt. Each sample's rows arrive as
    the engine hands them over (``len(tokens) − 1`` rows, the subject's payload type). The replay
    mask is what the release's trainer replays: from 0.9.0 its R3 mask; in 0.8.0, which has no
    mask, every position it is given (the attention mask).
    """
    check_placement_arguments(samples, width, prompt_lens)
    lens = [int(t.shape[0]) for t, _ in samples]
    if prompt_lens is not None and len(prompt_lens) != len(samples):
        raise ValueError(
            f"prompt_lens has {len(prompt_lens)} entries, expected one per sample ({len(samples)})"
        )
    splits = list(prompt_lens) if prompt_lens is not None else [min(1, n) for n in lens]
    prompt_width = max(splits)
    worker = _agent_loop_worker(version, prompt_width, width - prompt_width)
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    padded = []
    for (tokens, routes), split in zip(samples, splits, strict=True):
        output = AgentLoopOutput(
            prompt_ids=tokens[:split].tolist(),
            response_ids=tokens[split:].tolist(),
            response_mask=[1] * (len(tokens) - split),
            routed_experts=as_payload(routes, payload),
            metrics=AgentLoopMetrics(),
        )
        padded.append(asyncio.run(worker._agent_loop_postprocess(output, False, raw_prompt=None)))
    batch = worker._postprocess(padded).batch
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"].bool()
    if version == "0.8.0":
        replay_mask = attention_mask.clone()
    else:
        replay_mask = _r3_replay_mask(input_ids, attention_mask, batch["response_mask"])
    response_mask = None
    if prompt_lens is not None:
        response_mask = torch.zeros_like(attention_mask)
        response_mask[:, prompt_width:] = batch["response_mask"].bool()
    return Placed(input_ids, attention_mask, batch["routed_experts"], replay_mask, response_mask)


class Layouts:
    """verl's layout functions (only its own; the rest are a skip naming each)."""

    def __init__(self, version: str, payload: Payload) -> None:
        self.version, self.payload = version, payload

    def place_left_padded(self, samples: Any, width: int, prompt_lens: Any = None) -> Placed:
        return place_left_padded(self.version, self.payload, samples, width, prompt_lens)
