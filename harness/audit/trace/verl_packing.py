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

Under R2 the update pass is placed too (``update_packing``), again by verl's own code
(``RayPPOTrainer._update_actor`` → ``TrainingWorker.train_mini_batch`` →
``MegatronEngine.forward_backward_batch``): each DP rank's share of the balanced batch (the same as
the old-log-prob pass's: verl balances once per step) is split into mini-batches by
``tensordict_utils.make_iterator`` (``ppo_mini_batch_size × rollout.n / dp`` samples, ``ppo_epochs``,
``shuffle`` with ``data_loader_seed + dp_rank``), and each mini-batch goes through steps 4–5 with
the update's own settings (``ppo_max_token_len_per_gpu`` or ``ppo_micro_batch_size_per_gpu``).

A row index rides along in the batch through every step (``rrh_row``), so the dump row of every
packed sample is observed, not inferred. Nothing here is re-implemented; what megatron-core then
does per rank (the TP rank's slice under sequence parallelism, the layers of a PP stage) is the
join's (``harness.audit.trace.join``), and so is which zig-zag chunks of each sample a CP rank holds.
VPP, FP8 padding and verl's ``contiguous`` CP layout (``dsv4_hybrid`` attention only) are not
modelled: ``VerlBatching`` has no setting for them, and ``--trainer-layout`` refuses one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt

from harness.audit.layout.schema import LayoutError

RELEASE = "0.9.1"
"""The verl release whose functions this packing calls."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one DP rank as Megatron receives it: the dump rows of its samples in packed
    order, their token counts and the packed buffer's per-sample offsets (``cu_seqlens_q_padded``)."""

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    mini_batch: int | None = None
    """The update's mini-batch (its iteration over the epochs) this micro-batch belongs to; ``None``
    in the old-log-prob pass."""

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
        _at_least_one(self, ("dp", "tp", "cp"))
        _one_micro_batching(self, "max_token_len (use_dynamic_bsz)", "micro_batch (micro_batch_size_per_gpu)")


@dataclass(frozen=True)
class UpdateBatching:
    """The run's settings that decide the update's batching (``actor_rollout_ref.actor.*``): how
    ``update_actor`` splits each DP rank's share into mini-batches and those into micro-batches."""

    mini_batch_size: int
    """``ppo_mini_batch_size × rollout.n``: samples of one mini-batch over all DP ranks."""
    epochs: int = 1
    """``ppo_epochs``."""
    shuffle: bool = False
    """``actor.shuffle`` (verl's default: False)."""
    seed: int = 42
    """``actor.data_loader_seed`` (verl's default: 42; DP rank ``d`` shuffles with ``seed + d``)."""
    max_token_len_per_gpu: int | None = None
    """``ppo_max_token_len_per_gpu`` with ``use_dynamic_bsz``."""
    micro_batch_size_per_gpu: int | None = None
    """``ppo_micro_batch_size_per_gpu`` (fixed split)."""

    def __post_init__(self) -> None:
        _at_least_one(self, ("mini_batch_size", "epochs"))
        _one_micro_batching(self, "ppo_max_token_len", "ppo_micro_batch")


def _at_least_one(settings: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(settings, name) < 1:
            raise LayoutError(f"{name}={getattr(settings, name)}: expected an integer >= 1")


def _one_micro_batching(settings: Any, dynamic: str, fixed: str) -> None:
    """Exactly one of ``max_token_len_per_gpu`` and ``micro_batch_size_per_gpu``, each >= 1."""
    if (settings.max_token_len_per_gpu is None) == (settings.micro_batch_size_per_gpu is None):
        raise LayoutError(f"verl's micro-batching: expected exactly one of {dynamic} and {fixed}")
    _at_least_one(
        settings,
        tuple(
            n
            for n in ("max_token_len_per_gpu", "micro_batch_size_per_gpu")
            if getattr(settings, n) is not None
        ),
    )


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
    from harness.audit.importers.quiet import quiet_imports

    quiet_imports(VERL_MODULES)  # their import-time warnings are not about the run: never printed


VERL_MODULES = (
    "verl",
    "verl.models.mcore.util",
    "verl.trainer.ppo.ray_trainer",
    "verl.utils.tensordict_utils",
    "verl.utils.model",
    "verl.workers.utils.padding",
    "verl.workers.engine.utils",
)
"""The verl modules the packing calls, imported once by ``_require_verl`` without their noise."""


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
    return tu.chunk_tensordict(batch, batching.dp) if batching.dp > 1 else [batch]


def _micro_plans(
    parts: list[Any], batching: VerlBatching, max_token_len: int | None, micro_batch: int | None
) -> list[list[MicroBatch]]:
    """Steps 4–5 for what the DP ranks forward together (their shares, or their ``i``-th update
    mini-batches): each part's micro-batches, the count all-reduced (MAX) as verl's DP group does."""
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    for part in parts:
        tu.assign_non_tensor(
            part,
            use_dynamic_bsz=max_token_len is not None,
            max_token_len_per_gpu=max_token_len or 0,
            micro_batch_size_per_gpu=micro_batch or 0,
            sp_size=1,
        )
    try:
        counts = [len(prepare_micro_batches(data=p, dp_group=None)[0]) for p in parts]
        plans: list[list[MicroBatch]] = []
        for part in parts:
            micro, _ = prepare_micro_batches(data=part, dp_group=None, min_num_micro_batch=max(counts))
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


def step_packing(
    attention_mask: npt.NDArray[Any], response_mask: npt.NDArray[Any], batching: VerlBatching
) -> list[list[MicroBatch]]:
    """The micro-batches of every DP rank for one step's dumped batch (``attention_mask [B, W]`` and
    ``response_mask [B, R]`` as ``DataProto.save_to_disk`` wrote them), by verl's own functions."""
    _require_verl()
    chunks = _dp_chunks(attention_mask, response_mask, batching)
    return _micro_plans(chunks, batching, batching.max_token_len_per_gpu, batching.micro_batch_size_per_gpu)


def update_packing(
    attention_mask: npt.NDArray[Any],
    response_mask: npt.NDArray[Any],
    batching: VerlBatching,
    update: UpdateBatching,
) -> list[list[MicroBatch]]:
    """The update's forwards of every DP rank for one step's dumped batch, in call order (each
    ``MicroBatch`` with its ``mini_batch``), by verl's own functions: the DP shares of the old-log-prob
    pass (verl balances the batch once per step), each split by ``tensordict_utils.make_iterator`` as
    ``TrainingWorker.train_mini_batch`` calls it (``mini_batch_size // dp`` samples per DP rank, the
    epochs, ``seed + dp_rank``, ``shuffle``), each mini-batch micro-batched and THD-packed by
    ``prepare_micro_batches`` and ``preprocess_thd_engine`` with the update's settings."""
    _require_verl()
    from verl.utils import tensordict_utils as tu

    chunks = _dp_chunks(attention_mask, response_mask, batching)
    share = chunks[0].shape[0]
    per_rank = update.mini_batch_size // batching.dp
    if update.mini_batch_size % batching.dp or not per_rank or share % per_rank:
        raise LayoutError(
            f"ppo_mini_batch={update.mini_batch_size} with dp={batching.dp} and a batch of "
            f"{share * batching.dp} samples: expected a multiple of dp whose share per DP rank divides the "
            f"rank's {share} samples (verl's train_mini_batch and make_iterator assert it)"
        )
    iterators = [
        tu.make_iterator(
            chunk,
            mini_batch_size=per_rank,
            epochs=update.epochs,
            seed=update.seed + dp_rank,
            dataloader_kwargs={"shuffle": update.shuffle},
        )
        for dp_rank, chunk in enumerate(chunks)
    ]
    plans: list[list[MicroBatch]] = [[] for _ in chunks]
    for index, minis in enumerate(zip(*iterators, strict=True)):
        micro = _micro_plans(
            list(minis), batching, update.max_token_len_per_gpu, update.micro_batch_size_per_gpu
        )
        for plan, found in zip(plans, micro, strict=True):
            plan.extend(dataclasses.replace(mb, mini_batch=index) for mb in found)
    return plans
