"""verl 0.9.1's packing of one step's batch on Megatron, computed by verl's own functions.

A megatron-core router trace (``router_trace_rank{r}.jsonl``) holds each router call's top-k in the
rank's packed local order, with no sample id and no position. Which dump row each traced row is
depends on what verl did to the batch before Megatron saw it, so this module calls the installed
release's own code on the dumped batch, in the order verl's trainer and Megatron engine call it
(``verl/trainer/ppo/ray_trainer.py``, ``verl/workers/engine/megatron/transformer_impl.py``):

1. ``RayPPOTrainer._balance_batch`` (``trainer.balance_batch=True``, verl's default): the batch is
   reordered so that DP ranks get similar token counts;
2. ``left_right_2_no_padding``: the padded batch becomes jagged ``input_ids`` (``_compute_old_log_prob``);
3. ``tensordict_utils.chunk_tensordict``: DP rank ``d`` gets the ``d``-th equal chunk;
4. ``prepare_micro_batches`` (``workers/engine/utils.py``): ``rearrange_micro_batches`` under dynamic
   batch size (``max_token_len_per_gpu``), else a fixed split (``micro_batch_size_per_gpu``); across DP
   ranks the micro-batch count is the largest of any rank (verl all-reduces it with MAX; here the
   count of every rank is computed first and passed back as ``min_num_micro_batch``);
5. ``preprocess_thd_engine`` (``models/mcore/util.py``): each micro-batch packed into one THD
   sequence, each sample padded to ``tp`` (``cu_seqlens_q_padded``), to ``tp·cp·2`` under context
   parallelism (its zig-zag layout; the offsets are the same on every CP rank).

A row index rides along in the batch through every step (``rrh_row``), so the dump row of every
packed sample is observed, not inferred. Nothing here is re-implemented; what megatron-core then
does per rank (the TP rank's slice under sequence parallelism, the layers of a PP stage) is the
join's (``harness.audit.trace_join``), and so is which zig-zag chunks of each sample a CP rank holds.
VPP, FP8 padding and verl's ``contiguous`` CP layout (``dsv4_hybrid`` attention only) are not
modelled: ``VerlBatching`` has no setting for them, and ``--trainer-layout`` refuses one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt

from harness.audit.layout import LayoutError

RELEASE = "0.9.1"
"""The verl release whose functions this packing calls."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one DP rank as Megatron receives it: the dump rows of its samples in packed
    order, their token counts and the packed buffer's per-sample offsets (``cu_seqlens_q_padded``)."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]

    @property
    def packed_rows(self) -> int:
        """Rows of the packed buffer (all TP and CP ranks together)."""
        return self.cu_seqlens_padded[-1]


@dataclass(frozen=True)
class VerlBatching:
    """The run's settings that decide verl's packing (``actor_rollout_ref.actor.*``, ``trainer.*``)."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    """Context-parallel size (verl's zig-zag layout: each sample padded to ``tp·cp·2``)."""
    balance_batch: bool = True
    """``trainer.balance_batch`` (verl's default: True)."""
    max_token_len_per_gpu: int | None = None
    """``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu`` with ``use_dynamic_bsz``."""
    micro_batch_size_per_gpu: int | None = None
    """``log_prob_micro_batch_size_per_gpu`` (fixed split, ``use_dynamic_bsz=False``)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}: expected an integer >= 1")
        if (self.max_token_len_per_gpu is None) == (self.micro_batch_size_per_gpu is None):
            raise LayoutError(
                "verl's micro-batching: expected exactly one of max_token_len (use_dynamic_bsz) and "
                "micro_batch (micro_batch_size_per_gpu)"
            )
        for name in ("max_token_len_per_gpu", "micro_batch_size_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LayoutError(f"{name}={value}: expected an integer >= 1")


def _require_verl() -> None:
    """verl ``RELEASE`` installed, or one ``LayoutError`` saying what the join needs."""
    try:
        from importlib.metadata import version

        found = version("verl")
    except Exception:  # not installed: PackageNotFoundError
        found = None
    if found != RELEASE:
        raise LayoutError(
            f"--trainer-trace with a verl dump: the packing is computed by verl {RELEASE}'s own functions, "
            f"found {'no verl' if found is None else f'verl {found}'} installed "
            "(tox env verl-0.9.1-mcore-0.19.2)"
        )


@contextlib.contextmanager
def _parallel_sizes(tp: int, cp: int) -> Iterator[None]:
    """Megatron's parallel-state getters that ``preprocess_thd_engine`` reads, answering the run's
    sizes (TP ``tp``, CP ``cp``, as CP rank 0: the padded offsets do not depend on the rank) in a
    process that holds no model-parallel groups."""
    from verl.models.mcore import util

    with contextlib.ExitStack() as stack:
        for name, value in (
            ("get_tensor_model_parallel_world_size", tp),
            ("get_context_parallel_world_size", cp),
            ("get_context_parallel_rank", 0),
        ):
            stack.enter_context(mock.patch.object(util.mpu, name, lambda v=value: v))
        yield


def _dp_chunks(
    attention_mask: npt.NDArray[Any], response_mask: npt.NDArray[Any], batching: VerlBatching
) -> list[Any]:
    """Steps 1–3: the batch balanced, unpadded and split by DP rank (TensorDicts with ``rrh_row``)."""
    import torch
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    mask = torch.as_tensor(np.asarray(attention_mask) != 0).long()
    size = mask.shape[0]
    if size % batching.dp:
        raise LayoutError(
            f"a batch of {size} samples: expected a multiple of dp={batching.dp} (verl splits it evenly)"
        )
    proto = DataProto.from_dict(
        tensors={
            "input_ids": torch.zeros_like(mask),
            "attention_mask": mask,
            "response_mask": torch.as_tensor(np.asarray(response_mask) != 0).long(),
            "position_ids": compute_position_id_with_mask(mask),
            "rrh_row": torch.arange(size),
        }
    )
    if batching.balance_batch:
        trainer = SimpleNamespace(
            _get_dp_size=lambda _group, _role: batching.dp, actor_rollout_wg=None, use_prefix_grouper=False
        )
        RayPPOTrainer._balance_batch(trainer, proto, metrics={})
    batch = left_right_2_no_padding(proto.to_tensordict())
    dynamic = batching.max_token_len_per_gpu is not None
    tu.assign_non_tensor(
        batch,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=batching.max_token_len_per_gpu or 0,
        micro_batch_size_per_gpu=batching.micro_batch_size_per_gpu or 0,
        sp_size=1,
    )
    return tu.chunk_tensordict(batch, batching.dp) if batching.dp > 1 else [batch]


def step_packing(
    attention_mask: npt.NDArray[Any], response_mask: npt.NDArray[Any], batching: VerlBatching
) -> list[list[MicroBatch]]:
    """The micro-batches of every DP rank for one step's dumped batch (``attention_mask [B, W]`` and
    ``response_mask [B, R]`` as ``DataProto.save_to_disk`` wrote them), by verl's own functions."""
    _require_verl()
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.workers.engine.utils import prepare_micro_batches

    chunks = _dp_chunks(attention_mask, response_mask, batching)
    try:
        counts = [len(prepare_micro_batches(data=c, dp_group=None)[0]) for c in chunks]
        plans: list[list[MicroBatch]] = []
        for chunk in chunks:
            micro, _ = prepare_micro_batches(data=chunk, dp_group=None, min_num_micro_batch=max(counts))
            plan = []
            for mb in micro:
                with _parallel_sizes(batching.tp, batching.cp):
                    _, params, _ = preprocess_thd_engine(mb["input_ids"], pre_process=False)
                plan.append(
                    MicroBatch(
                        rows=tuple(int(r) for r in mb["rrh_row"].tolist()),
                        lengths=tuple(int(n) for n in mb["input_ids"].offsets().diff().tolist()),
                        cu_seqlens_padded=tuple(int(c) for c in params.cu_seqlens_q_padded.tolist()),
                    )
                )
            plans.append(plan)
    except (AssertionError, RuntimeError, ValueError) as err:
        raise LayoutError(
            f"verl's micro-batching refused the batch ({err}); expected settings the run used"
        ) from None
    return plans
