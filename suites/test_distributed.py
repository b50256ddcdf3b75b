"""Parallel parity on real process groups (DESIGN §3.5, §3.7; FACTS §2 Megatron layouts).

Each layout runs the reference MoE model sharded over spawned ranks of a real ``torch.distributed``
process group (gloo on CPU, NCCL on GPU; `reference_impl.distributed`): SP/TP token shards, EP
expert shards behind an all-to-all dispatch, PP stages and VPP chunks joined by send/recv, CP
zig-zag shards with all-gathered keys and values. The *subject* supplies the trainer's side: its
``layouts`` slice each sequence's tokens and global traces for every rank and merge the ranks'
recordings back (``cp_zigzag_shard``/``cp_pad``/``cp_zigzag_merge``, ``sp_shard``/``sp_pad``/
``sp_gather``, ``pp_layer_ranges``, ``stage_targets``/``stage_targets_moe_ordinal``,
``merge_stage_recordings``; ``ep_local_ids``/``ep_global_ids`` drive the EP dispatch), and its
``install_replay`` handle records and replays each rank's routers (a `ShardedMoELM` is a `MoELM`
whose routers are that rank's). Which tokens, positions and layers a rank actually computes is the
sharded model's own rule, so slicing that disagrees with it is caught.
Against the single-process model (fp32):

* routes recorded in the layout and gathered back equal the single-process recording exactly;
* a global trace (random routes, decoder axis with dense slots 0, and MoE-ordinal), sliced for the
  layout and replayed, dispatches the single-process routes exactly, and the log-probs agree within
  fp32 tolerance;
* with activation recompute under pp2 (1F1B, two micro-batches in flight on stage 0), every
  backward recompute dispatches what its own forward did, and the gradients equal single-process
  replay without recompute (REPLAY_FORWARD left on through backward fails here).

Bug classes (FACTS §4): CP layout (verl #7297), PP/VPP offsets (verl #5452), dense-layer shift
(verl #5037), SP/FP8 padding (verl #5989), local/physical ids in traces, recompute drift (Megatron).
Each test is one spawn of at most 4 ranks (DESIGN §6).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness.subjects import Subject, load_subject
from harness.subjects.capabilities import OneForwardInFlight
from harness.subjects.replay import install, prepare
from harness.testing.asserts import assert_close_logprobs, assert_same_routes
from harness.testing.ranks import run_ranks
from harness.testing.suite import require, subject_spec
from reference_impl import MoEConfig, MoELM, RoutingMode
from reference_impl.distributed import (
    ParallelSpec,
    ShardedMoELM,
    gather_recordings,
    gather_token_values,
    new_groups,
    next_token_labels,
    pipeline_forward,
    pipeline_train_step,
    rank_targets,
    rank_tokens,
    token_logprobs,
)

pytestmark = pytest.mark.distributed

TIMEOUT_S = 60.0
LOGPROB_ATOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

CFG = MoEConfig.tiny(
    num_layers=4,
    expert_hidden=16,
    first_k_dense=1,  # a dense first layer: PP offsets must count MoE layers (verl #5037/#5452)
    router_family=("softmax_topk", "softmax_topk", "sigmoid_grouped", "topk_softmax"),
    n_group=2,
    topk_group=1,
    shared_expert=True,
    max_positions=64,
    seed=3,
)

LAYOUTS: dict[str, ParallelSpec] = {
    "tp2": ParallelSpec(tp=2),
    "ep2": ParallelSpec(dp=2, ep=2),
    "tp2ep2": ParallelSpec(tp=2, dp=2, ep=2),
    "pp2": ParallelSpec(pp=2),
    "pp2vpp2": ParallelSpec(pp=2, vpp=2),
    "cp2": ParallelSpec(cp=2),
    "tp2cp2": ParallelSpec(tp=2, cp=2),
}
"""Every layout the default suite runs, at most 4 ranks each."""

LENGTHS = ((13, 10), (11, 9))
"""Sequence lengths ``[dp rank][micro-batch]``: odd and even, so SP and CP pad (13 → 16 under cp2)."""

RECOMPUTE_LENGTHS = ((12, 12),)
"""Equal lengths, so replaying one micro-batch's targets in another's recompute is silent drift."""


# --------------------------------------------------------------------------------------------------
# The data: sequences and global replay traces, built alike in the test process and every rank
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: tokens [S], random distinct routes [S, n_moe, k] (MoE-ordinal) to replay,
    the same as a decoder-axis trace [S, num_layers, k] (dense slots 0), and the replay mask
    [S] (False at the last position: it has no row and routes natively)."""

    tokens: torch.Tensor
    routes: torch.Tensor
    decoder_routes: torch.Tensor
    mask: torch.Tensor


def make_sequence(seed: int, length: int) -> MicroBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, CFG.vocab_size, (length,), generator=gen)
    n_moe = len(CFG.moe_layers)
    scores = torch.rand(length, n_moe, CFG.num_experts, generator=gen)
    routes = scores.argsort(dim=-1)[..., : CFG.top_k]  # distinct ids, mostly not the live top-k
    decoder = torch.zeros(length, CFG.num_layers, CFG.top_k, dtype=torch.long)
    decoder[:, list(CFG.moe_layers)] = routes
    mask = torch.ones(length, dtype=torch.bool)
    mask[-1] = False
    return MicroBatch(tokens, routes, decoder, mask)


def make_batch(lengths: tuple[tuple[int, ...], ...]) -> list[list[MicroBatch]]:
    """``batch[dp][i]``: micro-batch ``i`` of DP rank ``dp``."""
    return [[make_sequence(100 * dp + i, n) for i, n in enumerate(row)] for dp, row in enumerate(lengths)]


def lengths_for(spec: ParallelSpec, lengths: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    return lengths[: spec.dp]


# --------------------------------------------------------------------------------------------------
# Rank side (runs in the spawned processes; module-level so that spawn can import it)
# --------------------------------------------------------------------------------------------------


def _rank_setup(rank: int, spec: ParallelSpec, subject_spec: str) -> tuple[Any, Any, ShardedMoELM, Any]:
    subject = load_subject(subject_spec)
    layouts = subject.layouts
    groups = new_groups(spec, rank)
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    driver = prepare(subject.install_replay)  # patch first: the protocol promises models built after it
    model = ShardedMoELM(CFG, spec, rank, groups, layouts=layouts, device=device)
    return subject, layouts, model, install(driver, model)


def layout_worker(rank: int, world_size: int, layout: str, subject_spec: str) -> dict[str, Any] | None:
    """Record, then replay a decoder-axis and an MoE-ordinal global trace, in ``layout``.

    Returns (on rank 0) the gathered recordings, dispatched ids and log-probs, ``[dp][i]``.
    """
    spec = LAYOUTS[layout]
    place = spec.place(rank)
    _, layouts, model, handle = _rank_setup(rank, spec, subject_spec)
    lengths = lengths_for(spec, LENGTHS)
    batch = make_batch(lengths)
    mine = batch[place.dp]
    tokens = [rank_tokens(s.tokens, spec, place, layouts) for s in mine]
    labels = [rank_tokens(next_token_labels(s.tokens)[0], spec, place, layouts) for s in mine]
    result: dict[str, Any] = {}

    with during("recording"), torch.no_grad():
        handle.record()
        pipeline_forward(model, tokens)
        recording = handle.recording()
        result["recording"] = gather_recordings(recording, lengths, CFG, spec, place, layouts)

    for axis in ("decoder", "moe_ordinal"):
        with during(f"replay of the {axis}-axis trace"):
            result[axis] = _replay(model, handle, layouts, mine, tokens, labels, lengths, axis)
    return result if rank == 0 else None


def _replay(
    model: ShardedMoELM,
    handle: Any,
    layouts: Any,
    mine: list[MicroBatch],
    tokens: list[torch.Tensor],
    labels: list[torch.Tensor],
    lengths: tuple[tuple[int, ...], ...],
    axis: str,
) -> dict[str, Any]:
    """Replay each micro-batch's global trace (on ``axis``) sliced for this rank; gather what was
    dispatched and the log-probs back."""
    spec, place = model.spec, model.place
    targets = [
        rank_targets(
            s.decoder_routes if axis == "decoder" else s.routes,
            s.mask,
            CFG,
            spec,
            place,
            layouts,
            layer_axis=axis,
        )
        for s in mine
    ]
    dispatched: list[torch.Tensor] = []
    with torch.no_grad():
        logits = pipeline_forward(
            model,
            tokens,
            before_forward=lambda i, targets=targets: handle.replay(*targets[i]),
            after_forward=lambda i, dispatched=dispatched: dispatched.append(model.dispatched_routes()),
        )
    handle.disarm()
    logprobs = None
    if model.is_last_stage:
        logprobs = [token_logprobs(out, lab) for out, lab in zip(logits, labels, strict=True)]
    return {
        "dispatched": gather_recordings(torch.cat(dispatched), lengths, CFG, spec, place, layouts),
        "logprobs": gather_token_values(logprobs, lengths, spec, place, layouts),
    }


@contextmanager
def during(phase: str) -> Iterator[None]:
    """Prefix an error raised on a rank with the phase it was raised in."""
    try:
        yield
    except Exception as err:
        raise RuntimeError(f"during {phase}: {type(err).__name__}: {err}") from err


def recompute_worker(rank: int, world_size: int, subject_spec: str) -> dict[str, Any]:
    """pp2, 1F1B with activation recompute, replaying a global trace; every rank returns its
    parameters' gradients and, per router, the ids dispatched by each forward and each recompute."""
    spec = LAYOUTS["pp2"]
    place = spec.place(rank)
    _, layouts, model, handle = _rank_setup(rank, spec, subject_spec)
    if isinstance(handle, OneForwardInFlight) and handle.forwards_in_flight == 1:
        return {"pp_rank": place.pp, "one_forward_in_flight": True}  # outside its contract: 1F1B keeps two
    mine = make_batch(RECOMPUTE_LENGTHS)[place.dp]
    tokens = [rank_tokens(s.tokens, spec, place, layouts) for s in mine]
    targets = [rank_targets(s.decoder_routes, s.mask, CFG, spec, place, layouts) for s in mine]

    def loss_fn(index: int, logits: torch.Tensor) -> torch.Tensor:
        labels, valid = next_token_labels(mine[index].tokens)
        return -(token_logprobs(logits, labels) * valid).sum()

    phases: list[tuple[str, int]] = []  # one router call per phase: a forward, or a backward's recompute

    def before_forward(index: int) -> None:
        phases.append(("forward", index))
        handle.replay(*targets[index])

    def before_backward(index: int) -> None:
        phases.append(("recompute", index))
        handle.prepare_backward()

    model.clear_dispatch_log()
    error = None
    try:
        pipeline_train_step(
            model,
            tokens,
            loss_fn,
            use_checkpoint=True,
            before_forward=before_forward,
            before_backward=before_backward,
        )
    except Exception as err:
        error = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    handle.disarm()
    return {
        "error": error,
        "pp_rank": place.pp,
        "phases": phases,
        "moe_layers": model.moe_layers_here,
        "dispatch_log": model.dispatch_log(),
        "grads": {name: p.grad for name, p in model.named_parameters() if p.grad is not None},
        "params": [name for name, _ in model.named_parameters()],
    }


# --------------------------------------------------------------------------------------------------
# Test side: single-process expectations, one spawn per layout, comparisons in words
# --------------------------------------------------------------------------------------------------


def _require_capabilities(subject: Subject) -> None:
    require(subject, "layouts")
    require(subject, "install_replay")


def single_process(sequence: MicroBatch) -> dict[str, torch.Tensor]:
    """The reference model in one process: its recording, and its replay of the sequence's routes."""
    model = MoELM(CFG)
    with torch.no_grad():
        model.set_routing_mode(RoutingMode.RECORD)
        model(sequence.tokens[None])
        recording = model.pop_recording()
        model.set_replay_targets(sequence.routes, sequence.mask)
        model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
        logits = model(sequence.tokens[None])[0]
        dispatched = model.dispatched_routes()
    labels, _ = next_token_labels(sequence.tokens)
    return {"recording": recording, "dispatched": dispatched, "logprobs": token_logprobs(logits, labels)}


def single_process_gradients(batch: list[MicroBatch]) -> dict[str, torch.Tensor | None]:
    """Gradients of the summed micro-batch losses, replaying each one's routes, without recompute."""
    model = MoELM(CFG)
    for sequence in batch:
        model.set_replay_targets(sequence.routes, sequence.mask)
        model.set_routing_mode(RoutingMode.REPLAY_FORWARD)
        labels, valid = next_token_labels(sequence.tokens)
        (-(token_logprobs(model(sequence.tokens[None])[0], labels) * valid).sum()).backward()
        model.clear_replay()
    return {name: p.grad for name, p in model.named_parameters()}


AXES = ("position", "MoE ordinal")


@pytest.mark.capability("layouts", "install_replay")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_record_and_replay_in_the_layout_match_single_process(
    subject: Subject, request: pytest.FixtureRequest, layout: str
) -> None:
    """In each layout, routes recorded on the ranks and gathered back equal the single-process recording,
    and a global trace sliced for the layout replays the single-process routes and log-probs."""
    _require_capabilities(subject)
    spec = LAYOUTS[layout]
    run = run_ranks(
        layout_worker, spec.world_size, args=(layout, subject_spec(request.config)), timeout=TIMEOUT_S
    )
    request.node.user_properties.append(("distributed_cpu_s", run.total_cpu_seconds))
    result = run.results[0]
    batch = make_batch(lengths_for(spec, LENGTHS))
    for dp, row in enumerate(batch):
        for i, sequence in enumerate(row):
            where = (
                f"{layout} ({spec.world_size} ranks), sequence dp={dp} micro-batch={i} "
                f"of {len(sequence.tokens)} tokens"
            )
            expected = single_process(sequence)
            assert_same_routes(
                result["recording"][dp][i],
                expected["recording"],
                names=(f"recorded in {layout}, gathered back", "recorded in one process"),
                what=where,
                axes=AXES,
            )
            for axis in ("decoder", "moe_ordinal"):
                replayed = f"{where}, {axis}-axis trace replayed"
                assert_same_routes(
                    result[axis]["dispatched"][dp][i],
                    expected["dispatched"],
                    names=(f"dispatched in {layout}", "dispatched in one process"),
                    what=replayed,
                    axes=AXES,
                )
                # every position but the last predicts a token
                assert_close_logprobs(
                    result[axis]["logprobs"][dp][i][:-1],
                    expected["logprobs"][:-1],
                    names=(layout, "one process"),
                    what=f"{replayed}: log-probs",
                    atol=LOGPROB_ATOL,
                    axes=("position",),
                )


@pytest.mark.capability("layouts", "install_replay")
def test_recompute_under_pp2_replays_each_forwards_targets(
    subject: Subject, request: pytest.FixtureRequest
) -> None:
    """Under pp2 with 1F1B and activation recompute (two micro-batches in flight on stage 0), each backward
    recompute dispatches what its own forward did, and the gradients equal single-process replay without
    recompute."""
    _require_capabilities(subject)
    run = run_ranks(
        recompute_worker, LAYOUTS["pp2"].world_size, args=(subject_spec(request.config),), timeout=TIMEOUT_S
    )
    request.node.user_properties.append(("distributed_cpu_s", run.total_cpu_seconds))
    if any(stage.get("one_forward_in_flight") for stage in run.results):
        pytest.skip(
            "the controller declares one forward in flight (OneForwardInFlight); 1F1B keeps two "
            "micro-batches in flight on stage 0, outside its contract"
        )
    batch = make_batch(RECOMPUTE_LENGTHS)[0]
    expected = single_process_gradients(batch)
    for stage in run.results:
        where = f"pp2 stage {stage['pp_rank']}"
        _check_recompute_dispatch(stage, where)
        assert stage["error"] is None, f"{where}: the 1F1B step with recompute failed: {stage['error']}"
        for name in stage["params"]:
            got, want = stage["grads"].get(name), expected[name]
            assert (got is None) == (want is None), (
                f"{where}: parameter {name} has {'no' if got is None else 'a'} gradient, expected "
                f"{'none' if want is None else 'one'} (single-process replay without recompute)"
            )
            if got is not None and want is not None:
                assert_close_logprobs(
                    got,
                    want,
                    names=("pp2 with recompute", "one process without recompute"),
                    what=f"{where}: gradient of {name}",
                    atol=GRAD_ATOL,
                    rtol=GRAD_RTOL,
                )


def _check_recompute_dispatch(stage: dict[str, Any], where: str) -> None:
    """Each recompute dispatched what the forward of the same micro-batch did (one router call per phase)."""
    phases = [tuple(p) for p in stage["phases"]]
    failed_after = f"; the step then failed: {stage['error']}" if stage["error"] else ""
    for layer, calls in zip(stage["moe_layers"], stage["dispatch_log"], strict=True):
        # After a failed step the log may stop early: compare the pairs that exist.
        forwards = {i: ids for (phase, i), ids in zip(phases, calls, strict=False) if phase == "forward"}
        for (phase, index), recompute in zip(phases, calls, strict=False):
            if phase != "recompute" or index not in forwards:
                continue
            assert_same_routes(
                recompute,
                forwards[index],
                names=("the backward recompute", "its forward"),
                what=(
                    f"{where}, MoE layer {layer}, micro-batch {index} (recompute must pop this micro-batch's "
                    f"targets from the FIFO: REPLAY_BACKWARD){failed_after}"
                ),
                axes=("token",),
            )
        if not stage["error"]:
            assert len(calls) == len(phases), (
                f"{where}, MoE layer {layer}: {len(calls)} router calls, expected {len(phases)}: one per "
                f"phase of its 1F1B schedule {phases} (each forward, and each backward's recompute)"
            )
