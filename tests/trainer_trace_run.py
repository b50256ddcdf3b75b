"""A verl 0.9.1 R3 run on megatron-core 0.19.2 with megatron-core's router tracer on, for the join tests.

The engine side is a verl batch as the agent loop builds it (left-padded prompts, right-padded
responses, ``routed_experts [B, P_max+R_max, L, K]`` int16 with the engine's payload at
``P_max − P``), written with verl's own ``DataProto.save_to_disk`` where ``RolloutSkip`` puts it.
The trainer side runs on gloo ranks (``run_ranks``): each rank loads the dump with verl's own
``DataProto.load_from_disk`` and does what verl's trainer and Megatron engine do for the
old-log-prob forward (``_compute_old_log_prob`` → ``forward_backward_batch`` → ``forward_step``):
``_balance_batch``, ``left_right_2_no_padding``, ``prepare_micro_batches``, and per micro-batch
``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data`` under
REPLAY_FORWARD, ``preprocess_thd_engine`` and the model's forward; megatron-core's tracer is started
with ``harness.audit.trace.router_tracer`` and marked after each step. ``traced_r2_run`` drives verl's R2
instead: the old-log-prob forward records (RECORD, ``merge_router_topk_indices``, ``pp_gather``,
``restore_dynamic_batch``), and every forward of the update's mini-batches (``make_iterator``,
``prepare_micro_batches``) replays that recording (REPLAY_FORWARD, ``set_router_replay_data``), a
deterministic router-weight change standing for the optimizer step after each mini-batch.

``MUTANTS`` name the bugs a step may carry: the audit of the join must name each at its step,
sample, row and layer.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import torch

from harness.trainers.megatron.model import VOCAB

E, K, NUM_LAYERS, MOE = 8, 2, 4, (1, 2, 3)
"""Experts, top-k, decoder layers and MoE layers (layer 0 dense) of the tiny model."""
MUTANTS = ("native", "one_layer", "previous", "shift", "cp_contiguous", "update_recording")
"""``native``: replay data installed, REPLAY_FORWARD never set (routers route natively, verl #7340);
``one_layer``: the router of decoder layer ``UNREPLAYED`` left without an action; ``previous``: micro-
batches after the first keep the previous micro-batch's targets; ``shift``: MoE layer i replays MoE
layer i−1's routes (the first gets the last's; verl #5037's class); ``cp_contiguous``: under CP the replay
targets are sharded contiguously (``_contiguous_targets``) while the tokens are zig-zagged (verl #7297's
class); ``update_recording`` (an R2 run, ``traced_r2_run``): the R2 recording taken from the update pass:
the old-log-prob forward routes natively without recording, and each update forward records its own
routing (what it would replay), so it dispatches its own native routing, visible once the weights
changed after the first mini-batch."""
UNREPLAYED = 3


def write_dump(root: Path, step: int, lengths: list[tuple[int, int]], seed: int, routes: bool = True) -> Path:
    """One step of a RolloutSkip dump: ``root/{step}/gen_batch.dp`` + ``meta.json``; its file.
    ``routes=False``: no ``routed_experts``, as a verl R2 run dumps it (its rollout returns none)."""
    from verl import DataProto

    rng = np.random.default_rng(seed)
    size, p_max, r_max = len(lengths), max(p for p, _ in lengths), max(r for _, r in lengths)
    width = p_max + r_max
    prompts = np.zeros((size, p_max), dtype=np.int64)
    responses = np.zeros((size, r_max), dtype=np.int64)
    attention = np.zeros((size, width), dtype=np.int64)
    response_mask = np.zeros((size, r_max), dtype=np.int64)
    table = np.zeros((size, width, NUM_LAYERS, K), dtype=np.int16)
    for i, (p, r) in enumerate(lengths):
        prompts[i, p_max - p :] = rng.integers(1, VOCAB, size=p)
        responses[i, :r] = rng.integers(1, VOCAB, size=r)
        attention[i, p_max - p : p_max + r] = 1
        response_mask[i, :r] = 1
        for layer in MOE:  # rows of positions [0, P + R − 1): the last token's row was never computed
            rows = np.stack([rng.choice(E, size=K, replace=False) for _ in range(p + r - 1)])
            table[i, p_max - p : p_max - p + p + r - 1, layer] = rows
    proto = DataProto.from_dict(
        tensors={
            "prompts": torch.as_tensor(prompts),
            "responses": torch.as_tensor(responses),
            "input_ids": torch.as_tensor(np.concatenate([prompts, responses], axis=1)),
            "attention_mask": torch.as_tensor(attention),
            "response_mask": torch.as_tensor(response_mask),
            **({"routed_experts": torch.as_tensor(table)} if routes else {}),
        }
    )
    folder = root / str(step)
    folder.mkdir(parents=True)
    proto.save_to_disk(str(folder / "gen_batch.dp"))
    (folder / "meta.json").write_text(json.dumps({"global_steps": step}))
    return folder / "gen_batch.dp"


def _share(file: str, max_token_len: int) -> Any:
    """This DP rank's share of the dumped step as verl's engine gets it: the batch balanced over the DP
    ranks (``_balance_batch``), unpadded (``left_right_2_no_padding``), this rank's equal chunk, with
    verl's dynamic batching of ``max_token_len`` tokens set."""
    from megatron.core import parallel_state as ps
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import seqlen_balancing
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    dp = ps.get_data_parallel_world_size()
    seqlen_balancing.get_device_name = lambda: "cpu"  # "cuda" from 0.9.0 even on a CPU box (FACTS §6)

    batch = DataProto.load_from_disk(file)
    batch.batch["dump_row"] = torch.arange(len(batch))  # which dump row each sample is, observed
    batch.batch["position_ids"] = compute_position_id_with_mask(batch.batch["attention_mask"])
    trainer = SimpleNamespace(_get_dp_size=lambda _g, _r: dp, actor_rollout_wg=None, use_prefix_grouper=False)
    RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    data = left_right_2_no_padding(batch.to_tensordict())
    if dp > 1:
        data = tu.chunk_tensordict(data, dp)[ps.get_data_parallel_rank()]
    tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len, sp_size=1)
    return data


def _split(data: Any) -> tuple[list[Any], Any]:
    """verl's dynamic micro-batches of ``data`` (``prepare_micro_batches``, the count all-reduced
    (MAX) over the DP group by ``rearrange_micro_batches``) and the indices that restore its order."""
    from megatron.core import parallel_state as ps
    from verl.workers.engine.utils import prepare_micro_batches

    dp = ps.get_data_parallel_world_size()
    return prepare_micro_batches(data=data, dp_group=ps.get_data_parallel_group() if dp > 1 else None)


def _micro_batches(file: str, max_token_len: int) -> list[Any]:
    """The micro-batches verl's engine forwards on this DP rank for the dumped step."""
    micro, _ = _split(_share(file, max_token_len))
    return micro


def _shift(routes: torch.Tensor) -> torch.Tensor:
    """MoE layer i gets MoE layer i−1's routes (the first MoE layer the last's)."""
    values = routes.values().clone()
    moe = list(MOE)
    values[:, moe] = routes.values()[:, moe[-1:] + moe[:-1]]
    return torch.nested.nested_tensor_from_jagged(values, offsets=routes.offsets())


@contextlib.contextmanager
def _contiguous_targets(utils: Any) -> Iterator[None]:
    """``set_router_replay_data`` packing the replay targets (and their mask) as the tokens, each sample
    padded to ``tp·cp·2``, but giving CP rank ``c`` the contiguous rows ``[c·T/cp, (c+1)·T/cp)`` of the
    packed buffer instead of its zig-zag chunks. (verl's own ``cp_layout="contiguous"`` cannot run on
    megatron-core 0.19.2: it needs ``PackedSeqParams.cp_partition_mode``, and it pads to ``tp·cp`` only.)"""
    from megatron.core import parallel_state as ps
    from verl.models.mcore import util

    original = utils.preprocess_thd_engine

    def contiguous(values: Any, **kwargs: Any) -> Any:
        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        align = ps.get_tensor_model_parallel_world_size() * cp * 2
        with (
            mock.patch.object(util.mpu, "get_context_parallel_world_size", lambda: 1),
            mock.patch.object(util.mpu, "get_context_parallel_rank", lambda: 0),
            mock.patch.object(util.mpu, "get_tensor_model_parallel_world_size", lambda: align),
        ):
            packed, params, positions = original(values, **kwargs)
        local = packed.shape[1] // cp  # [1, T, ...]
        return packed[:, rank * local : (rank + 1) * local], params, positions

    with mock.patch.object(utils, "preprocess_thd_engine", contiguous):
        yield


def _forward(model: Any, link: Any, mb: Any, tp: int) -> None:
    """One micro-batch through this rank's stage as verl's ``model_forward`` feeds it (THD, no grad):
    ``preprocess_thd_engine``'s packed ids, positions and ``PackedSeqParams``; activations to and from
    the neighbouring pipeline stages."""
    from megatron.core import parallel_state as ps
    from verl.models.mcore.util import preprocess_thd_engine

    from harness.trainers.megatron.model import HIDDEN
    from suites.megatron_pipeline import stage_input

    ids, params, positions = preprocess_thd_engine(mb["input_ids"], pre_process=True)
    with torch.no_grad():
        if not link.first_stage:
            rows = params.cu_seqlens_q_padded[-1].item() // (tp * ps.get_context_parallel_world_size())
            stage_input(link, model, (rows, 1, HIDDEN), torch.device("cpu"))
        out = model(
            input_ids=ids.view(1, -1), position_ids=positions.view(1, -1), attention_mask=None,
            packed_seq_params=params,
        )  # fmt: skip
        if not link.last_stage:
            link.send(out)


def _traced_model(cfg: dict[str, Any]) -> tuple[Any, Any, Any]:
    """This rank's tiny GPT with verl's router-replay patch and megatron-core's tracer on: the model,
    its config and the link to the neighbouring pipeline stages."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, apply_router_replay_patch

    from harness.audit.trace.router_tracer import start_router_trace
    from harness.trainers.megatron.layout import MegatronLayout
    from harness.trainers.megatron.model import build_gpt, tiny_config
    from suites.megatron_pipeline import StageLink

    tp, pp, cp = cfg["tp"], cfg["pp"], cfg.get("cp", 1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    model_parallel_cuda_manual_seed(7)
    utils.device_name = "cpu"
    apply_router_replay_patch()
    RouterReplay.router_instances.clear()
    layout = MegatronLayout(NUM_LAYERS, MOE, E, K, seq_len=64, micro_batch=1, tp=tp, pp=pp)
    config = tiny_config(layout, recompute=False, moe_enable_routing_replay=True)
    model = build_gpt(config, layout)
    model.eval()
    link = StageLink()
    start_router_trace(model, cfg["trace"])
    return model, config, link


def traced_run(rank: int, world_size: int, cfg: dict[str, Any]) -> list[list[list[int]]]:
    """Every dumped step through verl's R3 old-log-prob forward on this rank, traced (with
    ``cfg["reference"]``, then a reference log-prob pass: its own micro-batching, native routing, as
    verl runs it after the old log-probs); the dump rows of each old-log-prob micro-batch of each step."""
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    from harness.audit.trace.router_tracer import mark_step

    model, config, link = _traced_model(cfg)
    tp = cfg["tp"]
    rows = []
    for step, file, mutant in cfg["steps"]:
        micro = _micro_batches(file, cfg["max_token_len"])
        rows.append([mb["dump_row"].tolist() for mb in micro])
        for index, mb in enumerate(micro):
            routes = mb["routed_experts"] if mutant != "shift" else _shift(mb["routed_experts"])
            targets = utils.align_r3_router_replay_data(routes, mb["input_ids"])
            mask = utils.build_r3_replay_mask(mb["input_ids"], mb["response_mask"])
            if mutant != "previous" or index == 0:
                with _contiguous_targets(utils) if mutant == "cp_contiguous" else contextlib.nullcontext():
                    utils.set_router_replay_data(targets, None, config, 0, replay_mask=mask, model=[model])
            if mutant != "native":
                RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if mutant == "one_layer":
                for number, router in utils.iter_model_routers([model]):
                    if number - 1 == UNREPLAYED:
                        router.clear_router_replay_action()
            _forward(model, link, mb, tp)
            RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        if cfg.get("reference"):
            for mb in _micro_batches(file, cfg["max_token_len"] // 2):
                _forward(model, link, mb, tp)
        mark_step(step)
    return rows


def _record(model: Any, config: Any, link: Any, data: Any, tp: int, record: bool) -> Any:
    """verl's R2 old-log-prob forward of this rank's share (``forward_backward_batch`` with
    ``record_r2_routes``): RECORD on every router, ``merge_router_topk_indices`` after each micro-batch,
    then ``merge_nested_router_maps``, ``pp_gather`` and ``restore_dynamic_batch`` into the share's
    order, the ``routed_experts`` ``_compute_old_log_prob`` hands to the update. ``record=False`` (the
    ``update_recording`` mutant): the forward routes natively and records nothing (``None``)."""
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction
    from verl.utils.seqlen_balancing import restore_dynamic_batch

    micro, indices = _split(data)
    recorded: list[Any] = []
    if record:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    for mb in micro:
        _forward(model, link, mb, tp)
        if record:
            utils.merge_router_topk_indices(
                mb.get("attention_mask", None), mb["input_ids"], recorded, config, 0, model=model
            )
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()
    if not record:
        return None
    return restore_dynamic_batch(utils.pp_gather(utils.merge_nested_router_maps(recorded), config), indices)


def _optimizer_step(model: Any) -> None:
    """What stands for the optimizer step after each update mini-batch: every router's weight rows
    rolled by one expert (expert ``e`` gets ``e − 1``'s row), so every token's native top-k moves to the
    next experts and no route is what the old-log-prob forward saw. Deterministic on every rank."""
    from megatron.core.transformer.moe.router import TopKRouter

    with torch.no_grad():
        for router in (m for m in model.modules() if isinstance(m, TopKRouter)):
            router.weight.copy_(router.weight.roll(1, dims=0))


def traced_r2_run(rank: int, world_size: int, cfg: dict[str, Any]) -> list[list[list[int]]]:
    """Every dumped step through verl's R2 on this rank, traced: the old-log-prob forward records its
    routing (``_record``), ``update_actor``'s mini-batches (``tensordict_utils.make_iterator`` as
    ``TrainingWorker.train_mini_batch`` calls it: ``cfg["mini_batch"] // dp`` samples, ``cfg["epochs"]``,
    ``shuffle`` with ``data_loader_seed + dp_rank``) are each micro-batched by ``prepare_micro_batches``
    with the update's ``cfg["update_max_token_len"]`` and forwarded under REPLAY_FORWARD with the
    micro-batch's recorded ``routed_experts`` (``set_router_replay_data``, as ``forward_step`` does),
    and ``_optimizer_step`` follows each mini-batch. The ``update_recording`` mutant records in the
    update instead (RECORD: it dispatches its own native routing). Returns, per step, the dump rows of
    each update mini-batch of this rank."""
    from megatron.core import parallel_state as ps
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron import router_replay_utils as utils
    from verl.utils.megatron.router_replay_patch import RouterReplay, RouterReplayAction

    from harness.audit.trace.router_tracer import mark_step

    model, config, link = _traced_model(cfg)
    tp, dp = cfg["tp"], ps.get_data_parallel_world_size()
    rows = []
    for step, file, mutant in cfg["steps"]:
        data = _share(file, cfg["max_token_len"])
        recorded = _record(model, config, link, data, tp, record=mutant != "update_recording")
        if recorded is not None:
            data["routed_experts"] = recorded
        minis = tu.make_iterator(
            data, mini_batch_size=cfg["mini_batch"] // dp, epochs=cfg["epochs"],
            seed=42 + ps.get_data_parallel_rank(), dataloader_kwargs={"shuffle": cfg["shuffle"]},
        )  # fmt: skip
        rows.append([])
        for mini in minis:
            rows[-1].append(mini["dump_row"].tolist())
            tu.assign_non_tensor(mini, max_token_len_per_gpu=cfg["update_max_token_len"])
            for mb in _split(mini)[0]:
                if mutant == "update_recording":
                    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
                else:
                    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                    utils.set_router_replay_data(mb["routed_experts"], None, config, 0, model=model)
                _forward(model, link, mb, tp)
                RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()
            _optimizer_step(model)
        mark_step(step)
    return rows
