"""The Megatron-core replay checks, run on every rank of an initialised ``torch.distributed`` world.

:func:`run_checks` loads the subject (a spec: ranks are fresh processes), builds a tiny GPT MoE for a
:class:`MegatronLayout` with the subject driver's ``config_overrides()`` (one model chunk per virtual
pipeline stage, each handed to the subject together), installs the driver
(``install_megatron_replay``) and feeds targets through the subject's data movement
(``megatron_data``); the harness observes every router and expert with its own probe
(``harness.probes.megatron``) and checks DESIGN §3.5–3.8:

1. **live**: native routing, forward + backward with MoE activation recompute → reference loss
   and gradients.
2. **record → canonical**: RECORD, the subject merges this DP rank's recordings (all TP/PP ranks)
   into canonical routes; gathered over DP they form one ``RoutingTrace`` per sample, and every
   router's probed native choice is the canonical route of the position it held.
3. **replay own recording (R2)**: the canonical traces go back through the subject's
   ``set_replay_data``, REPLAY_FORWARD, REPLAY_BACKWARD for the recompute; every router — forward
   *and* recompute — chooses exactly its targets, the dispatcher hands every local expert exactly
   the tokens whose targets name it (all ranks of the ``tp·ep`` group), the backward FIFO is drained,
   and the loss and every gradient equal live routing's **bit for bit**.
4. **replay foreign targets (R3)**: random canonical traces; the same checks; the router weights
   still receive gradients; the loss differs from live.
5. **two micro-batches (pipeline schedule)**: forward mb1, forward mb2, then backward mb1, mb2:
   recompute pops the FIFO in forward order, and the accumulated gradients equal those of the two
   micro-batches run one at a time.

Placement has an oracle independent of the layout functions: every token carries its own position
into the decoder (channel 0 of the embeddings), so each router row's expected route is read off the
canonical trace at the position Megatron actually put there. The bugs these checks catch are
subjects in the zoo (``harness.mutants.megatron``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import MegatronReplayError
from harness.probes.megatron import DispatchProbe, expected_gate_weights
from harness.subjects import load_subject
from harness.subjects.replay import ensure_patched
from harness.trace import RoutingTrace
from harness.trainers.megatron import packed as thd
from harness.trainers.megatron.layout import (
    MegatronLayout,
    batch_routes,
    expected_local_map,
    ids_to_map,
    random_traces,
    rank_targets,
)
from harness.trainers.megatron.model import (
    HIDDEN,
    batch_tokens,
    build_gpt,
    randomise_expert_bias,
    slot_count,
    tiny_config,
)
from reference_impl.config import axis_of_width
from suites.megatron_pipeline import MicroBatchStep, StageLink, StageStep, stage_input


@dataclass(frozen=True)
class Coordinates:
    """This rank's place in the Megatron grid."""

    rank: int
    dp: int
    tp: int
    pp: int
    ep: int


def init_parallel(layout: MegatronLayout, seed: int) -> Coordinates:
    """``initialize_model_parallel`` for ``layout`` on the current world, and the model-parallel seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if dist.get_world_size() != layout.world_size:
        raise MegatronReplayError(f"world size {dist.get_world_size()}, layout needs {layout.world_size}")
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    model_parallel_cuda_manual_seed(seed)
    return Coordinates(
        rank=dist.get_rank(),
        dp=ps.get_data_parallel_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
    )


class _Rank:
    """One rank's model chunks (one per virtual pipeline stage), the subject's controller and data
    movement, the harness's probe, and data."""

    def __init__(
        self, layout: MegatronLayout, seed: int, subject_spec: str, router: Mapping[str, Any] | None = None
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        subject = load_subject(subject_spec)
        driver, data = subject.install_megatron_replay, subject.megatron_data
        if driver is None or data is None:
            raise MegatronReplayError(
                f"subject {subject.name!r} needs install_megatron_replay and megatron_data"
            )
        self.data: Any = data
        self.layout = layout
        self.coords = init_parallel(layout, seed)
        ensure_patched(driver)
        RouterReplay.clear_global_router_replay_instances()
        self.config = tiny_config(layout, **dict(router or {}), **dict(driver.config_overrides()))
        virtual = layout.vpp > 1
        self.chunks = [build_gpt(self.config, layout, c if virtual else None) for c in range(layout.vpp)]
        for chunk in self.chunks:
            randomise_expert_bias(chunk, seed)
        self.control = driver.install(self.chunks, self.config)
        self.routers = [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.layer_numbers = [int(r.layer_number) - 1 for r in self.routers]
        self.probe = DispatchProbe.attach(*self.chunks)
        stage = layout.rank_moe_layers(self.coords.pp)
        if self.layer_numbers != stage:
            raise MegatronReplayError(
                f"routers sit on decoder layers {self.layer_numbers}, the layout says {stage}"
            )
        self.device = next(self.chunks[0].parameters()).device
        self.links = [StageLink(c, layout.vpp) for c in range(layout.vpp)]
        self.positions: list[torch.Tensor] = []
        if self.links[0].first_stage:
            self._mark_positions()
        b, d = layout.micro_batch, self.coords.dp
        self.micro_batches = []
        for offset in (1, 2):
            ids, labels = batch_tokens(layout, seed + offset)
            self.micro_batches.append((ids[d * b : (d + 1) * b], labels[d * b : (d + 1) * b]))
        # Ranks whose tokens the all-gather dispatcher gathers, in group order, with their coordinates.
        from megatron.core import parallel_state as ps

        group = ps.get_expert_tensor_and_model_parallel_group()
        self.gather_ranks = dist.get_process_group_ranks(group)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.coords)
        self.all_coords = {c.rank: c for c in everyone}

    def _mark_positions(self) -> None:
        """Make every token carry its own position into the decoder, for an independent placement oracle.

        Channel 0 of the word embeddings is zeroed and channel 0 of the learned absolute position
        embeddings set to the position, so the first decoder layer's input ``[S/tp, B, H]`` says, in
        channel 0, which sequence position each of this rank's rows holds, as Megatron itself placed
        it (transpose, sequence-parallel scatter). The batch column is never moved by Megatron.
        A packed micro-batch's position ids name a ``(sample, position)`` slot each (``b·S + s``,
        filler rows the last slot, marked ``-1``). Only the first pipeline stage embeds; later stages
        receive the slots with the activations.
        """
        emb = self.chunks[0].embedding
        slots = torch.arange(slot_count(self.layout), dtype=emb.position_embeddings.weight.dtype)
        if self.layout.packed:
            slots[-1] = -1
        with torch.no_grad():
            emb.word_embeddings.weight[:, 0] = 0
            emb.position_embeddings.weight[:, 0] = slots

        def hook(module: Any, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.positions.append(hidden[..., 0].detach().round().long().cpu().clone())

        self.chunks[0].decoder.layers[0].register_forward_pre_hook(hook, with_kwargs=True)

    # --- steps -------------------------------------------------------------------------------

    def _inputs(self, mb: int) -> dict[str, Any]:
        """The model's inputs for micro-batch ``mb``: padded ``[B, S]`` with a causal mask, or packed
        ``[1, T]`` with ``PackedSeqParams`` and slot position ids (and the loss mask of real rows)."""
        layout = self.layout
        ids, labels = self.micro_batches[mb]
        if not layout.packed:
            s = layout.seq_len
            return dict(
                input_ids=ids,
                position_ids=torch.arange(s).unsqueeze(0).expand_as(ids),
                attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s),
                labels=labels,
                loss_mask=torch.ones_like(labels, dtype=torch.float32),
            )
        assert layout.lengths is not None
        slots = thd.packed_slots(layout.lengths, layout.packing_align)
        real = slots[:, 0] >= 0
        pick = slots.clamp(min=0)
        position = torch.where(real, pick[:, 0] * layout.seq_len + pick[:, 1], slot_count(layout) - 1)
        return dict(
            input_ids=torch.where(real, ids[pick[:, 0], pick[:, 1]], 0).unsqueeze(0),
            position_ids=position.unsqueeze(0),
            attention_mask=None,
            labels=torch.where(real, labels[pick[:, 0], pick[:, 1]], 0).unsqueeze(0),
            loss_mask=real.float().unsqueeze(0),
            packed_seq_params=self.packed_seq_params(),
        )

    def packed_seq_params(self) -> Any:
        """The packed micro-batch's ``PackedSeqParams`` (THD; samples padded to a multiple of the
        layout's ``align``)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        assert self.layout.lengths is not None
        lengths = self.layout.lengths
        padded = thd.padded_lengths(lengths, self.layout.packing_align)
        cu, cu_padded = thd.cu_seqlens(lengths).to(self.device), thd.cu_seqlens(padded).to(self.device)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=max(padded),
            max_seqlen_kv=max(padded),
        )

    def _rows_shape(self) -> tuple[int, int]:
        """The decoder's ``[rows, batch]`` on this rank: ``[S/tp, B]``, packed ``[T/tp, 1]``."""
        if self.layout.packed:
            return (self.layout.local_tokens, 1)
        return (self.layout.seq_len // self.layout.tp, self.layout.micro_batch)

    def forward(self, mb: int) -> MicroBatchStep:
        """Micro-batch ``mb`` through this rank's chunks in turn (activations and slots from / to the
        neighbouring virtual stages); the step's loss is the last stage's, on every rank."""
        inputs = {
            k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in self._inputs(mb).items()
        }
        loss_mask = inputs.pop("loss_mask")
        rows = self._rows_shape()
        stages, loss = [], None
        for chunk, link in zip(self.chunks, self.links, strict=True):
            received = None
            if not link.first_stage:
                received = stage_input(link, chunk, (*rows, HIDDEN), self.device)
                self.positions.append(link.receive(rows, torch.long, torch.device("cpu")))
            out = chunk(**inputs)
            if link.last_stage:
                loss = (out.float() * loss_mask).sum()
                stages.append(StageStep(loss, received=received))
            else:
                link.send(out)
                link.send(self.positions[-1])
                stages.append(StageStep(output=out, received=received))
        return MicroBatchStep(self.links[-1].share_loss(loss, self.device), stages)

    def backward(self, step: MicroBatchStep) -> None:
        """This rank's backward of ``step``, chunks in reverse order (gradients to / from the
        neighbouring virtual stages)."""
        for link, stage in zip(reversed(self.links), reversed(step.stages), strict=True):
            link.backward(stage)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            for p in chunk.parameters():
                p.grad = None

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            f"{c}.{name}": (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for c, chunk in enumerate(self.chunks)
            for name, p in chunk.named_parameters()
        }

    def _place(self, routes: torch.Tensor, coords: Coordinates) -> list[torch.Tensor]:
        """The canonical per-router targets of ``coords`` (the harness's expectation, not the subject's),
        chunk after chunk."""
        place = thd.thd_rank_targets if self.layout.packed else rank_targets
        return [
            target
            for chunk in range(self.layout.vpp)
            for target in place(
                routes, self.layout, dp_rank=coords.dp, tp_rank=coords.tp, pp_rank=coords.pp, vpp_chunk=chunk
            )
        ]

    def _real(self, coords: Coordinates) -> torch.Tensor:
        """Which router rows of ``coords`` hold a token (filler rows of a packed micro-batch do not)."""
        if not self.layout.packed:
            return torch.ones(self.layout.local_tokens, dtype=torch.bool)
        return thd.rank_slots(self.layout, coords.tp)[:, 0] >= 0

    def targets(self, traces: list[RoutingTrace]) -> list[torch.Tensor]:
        routes = batch_routes(traces, self.layout)
        return [t.to(self.device) for t in self._place(routes, self.coords)]

    def gathered(self, traces: list[RoutingTrace]) -> list[torch.Tensor]:
        """Per router: the targets of every token the dispatcher gathers onto this rank, in group order."""
        routes = batch_routes(traces, self.layout)
        per_rank = [self._place(routes, self.all_coords[r]) for r in self.gather_ranks]
        return [torch.cat([rt[j] for rt in per_rank]) for j in range(len(self.routers))]

    def gathered_real(self) -> torch.Tensor:
        """Which gathered rows hold a token, in the dispatcher's group order."""
        return torch.cat([self._real(self.all_coords[r]) for r in self.gather_ranks])

    # --- checks ------------------------------------------------------------------------------

    def check_dispatch(
        self, targets: list[torch.Tensor], gathered: list[torch.Tensor], what: str, calls: int
    ) -> None:
        """Each router chose, and each local expert received, its exact targets in all ``calls`` forwards."""
        layout = self.layout
        real, gathered_real = self._real(self.coords), self.gathered_real()
        for j, layer in enumerate(self.layer_numbers):
            where = f"{what}: rank {self.coords.rank} router {j} (decoder layer {layer})"
            chosen, dispatched = self.probe.chosen[j], self.probe.dispatched[j]
            if len(chosen) != calls or len(dispatched) != calls:
                raise MegatronReplayError(
                    f"{where}: {len(chosen)} router / {len(dispatched)} expert calls, expected {calls}"
                )
            want = ids_to_map(targets[j].cpu(), layout.num_experts)
            want_local = expected_local_map(gathered[j].cpu(), layout, self.coords.ep)
            for call in range(calls):
                if not torch.equal(chosen[call][real], want[real]):
                    bad = int((chosen[call] != want)[real].any(dim=1).sum())
                    raise MegatronReplayError(
                        f"{where}, forward {call}: {bad} tokens routed to other experts than their targets"
                    )
                if not torch.equal(dispatched[call][gathered_real], want_local[gathered_real]):
                    bad = int((dispatched[call] != want_local)[gathered_real].any(dim=1).sum())
                    raise MegatronReplayError(
                        f"{where}, forward {call}: the dispatcher handed {bad} gathered tokens to other "
                        "local experts "
                        f"(EP rank {self.coords.ep}) than their targets name"
                    )
                counts = want_local.sum(dim=0).long()
                if bool(gathered_real.all()) and not torch.equal(
                    self.probe.tokens_per_expert[j][call], counts
                ):
                    raise MegatronReplayError(
                        f"{where}, forward {call}: tokens_per_expert differs from the targets"
                    )

    def observed_slots(self, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(sample, position, real)`` of every router row of this rank, read off the tokens the first
        stage embedded (the batch column of ``[S/tp, B]``; a packed row's slot ``b·S + s``, or ``-1``)."""
        layout = self.layout
        positions = self.positions[-1]
        if tuple(positions.shape) != self._rows_shape():
            raise MegatronReplayError(f"{what}: decoder input holds {tuple(positions.shape)} rows per rank")
        base = self.coords.dp * layout.micro_batch
        if not layout.packed:
            samples = base + torch.arange(layout.micro_batch).unsqueeze(0).expand_as(positions)
            return samples.reshape(-1), positions.reshape(-1), torch.ones(positions.numel(), dtype=torch.bool)
        slot = positions.reshape(-1)
        real = slot >= 0
        slot = slot.clamp(min=0)
        return base + slot // layout.seq_len, slot % layout.seq_len, real

    def check_gate_weights(self, what: str) -> None:
        """Every router, in every forward (recompute included), weighted the experts it routed each
        token to with the training model's own scores (recomputed by the harness from the router's
        input and weight), and gave no weight elsewhere: replay moves ids, never weights."""
        real = self._real(self.coords)
        for j, layer in enumerate(self.layer_numbers):
            for call, (chosen, weights, logits) in enumerate(
                zip(self.probe.chosen[j], self.probe.weights[j], self.probe.logits[j], strict=True)
            ):
                want = expected_gate_weights(logits, chosen, self.config)
                close = torch.isclose(weights, want, rtol=1e-5, atol=1e-6).all(dim=1) | ~real
                if not bool(close.all()):
                    first = int((~close).nonzero()[0])
                    raise MegatronReplayError(
                        f"{what}: rank {self.coords.rank} router {j} (decoder layer {layer}), forward "
                        f"{call}: {int((~close).sum())} tokens got gate weights other than the model's "
                        f"scores at their experts; first, token {first}: weights "
                        f"{weights[first].tolist()}, expected {want[first].tolist()}"
                    )

    def check_placement(self, traces: list[RoutingTrace], what: str) -> None:
        """Independent of the layout functions: every router row chose the canonical route of the sample
        and position Megatron actually put there (read from the tokens themselves; filler rows of a
        packed micro-batch hold no position and are not judged)."""
        layout = self.layout
        routes = batch_routes(traces, layout)  # [dp·B, S, layers, k]
        samples, positions, real = self.observed_slots(what)
        for j, layer in enumerate(self.layer_numbers):
            want = routes[samples, positions, layer]
            for call, chosen in enumerate(self.probe.chosen[j]):
                wrong = (chosen != ids_to_map(want, layout.num_experts)).any(dim=1) & real
                if bool(wrong.any()):
                    first = int(wrong.nonzero()[0])
                    raise MegatronReplayError(
                        f"{what}: rank {self.coords.rank} router {j} (decoder layer {layer}), "
                        f"forward {call}: {int(wrong.sum())} tokens did not get the canonical route "
                        f"of the position they hold; first, token {first}: the trace's route "
                        f"{sorted(want[first].tolist())}, the router chose "
                        f"{chosen[first].nonzero().flatten().tolist()}"
                    )

    def pending(self) -> list[int]:
        """Entries left in each router's ``RouterReplay`` backward FIFO (read off the model)."""
        return [len(getattr(r.router_replay, "replay_backward_list", ())) for r in self.routers]

    def check_drained(self, what: str) -> None:
        left = self.pending()
        if any(left):
            raise MegatronReplayError(
                f"{what}: backward FIFO not drained, entries left per router {left} (recompute did not "
                "replay every forward, or REPLAY_BACKWARD was never set)"
            )

    def attention_mask(self) -> torch.Tensor:
        """This micro-batch's ``[B, S]`` mask: every position, or each packed sample's first ``n``."""
        layout = self.layout
        lengths = torch.tensor(layout.lengths or [layout.seq_len] * layout.micro_batch)
        return (torch.arange(layout.seq_len).unsqueeze(0) < lengths.unsqueeze(1)).long()

    def packed_keyword(self) -> dict[str, Any]:
        """``packed_seq_params=`` for the data movement of a packed micro-batch."""
        return {"packed_seq_params": self.packed_seq_params()} if self.layout.packed else {}

    def feed(self, traces: list[RoutingTrace]) -> None:
        """The subject's data movement: this DP rank's micro-batch of canonical routes → its routers."""
        b, d = self.layout.micro_batch, self.coords.dp
        routes = batch_routes(traces, self.layout)[d * b : (d + 1) * b]
        self.data.set_replay_data(
            routes, self.attention_mask(), self.config, model=self.chunks, **self.packed_keyword()
        )

    def record(self) -> list[RoutingTrace]:
        """RECORD one forward; the subject merges the recordings; canonical traces of the global batch."""
        layout = self.layout
        self.probe.clear()
        self.positions.clear()
        self.control.record()
        with torch.no_grad():
            self.forward(0)
        merged = torch.as_tensor(
            self.data.merge_recordings(
                self.attention_mask(), self.config, model=self.chunks, **self.packed_keyword()
            )
        ).long()
        self.control.disarm()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.coords.dp, merged.cpu()))
        by_dp = dict(everyone)
        routes = torch.cat([by_dp[d] for d in range(layout.dp)])
        width = routes.shape[2]
        axis = axis_of_width(width, layout.num_layers, len(layout.moe_layers))
        if tuple(routes.shape) != (layout.global_batch, layout.seq_len, width, layout.top_k) or axis is None:
            raise MegatronReplayError(
                f"merge_recordings: global routes {tuple(routes.shape)}, expected [{layout.global_batch}, "
                f"{layout.seq_len}, {layout.num_layers} or {len(layout.moe_layers)}, {layout.top_k}]"
            )
        lengths = layout.lengths or (layout.seq_len,) * layout.micro_batch
        return [
            RoutingTrace(
                sample[: lengths[i % layout.micro_batch]].numpy(),
                num_experts=layout.num_experts,
                moe_layers=layout.moe_layers,
                num_layers=layout.num_layers,
                layer_axis=axis,
            ).to_decoder_axis()
            for i, sample in enumerate(routes)
        ]

    def replay_step(
        self, traces: list[RoutingTrace], what: str
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """REPLAY_FORWARD forward, REPLAY_BACKWARD backward; dispatch, placement and FIFO checks."""
        targets, gathered = self.targets(traces), self.gathered(traces)
        self.zero_grad()
        self.probe.clear()
        self.positions.clear()
        self.feed(traces)
        self.control.replay_forward()
        step = self.forward(0)
        self.control.prepare_backward()
        self.backward(step)
        calls = 2 if self.config.recompute_granularity == "selective" else 1
        self.check_dispatch(targets, gathered, what, calls)
        self.check_gate_weights(what)
        self.check_placement(traces, what)
        self.check_drained(what)
        self.control.disarm()
        return step.loss.detach(), self.grads()


def _compare_grads(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, exact: bool = True
) -> float:
    worst = 0.0
    for name in a:
        diff = float((a[name] - b[name]).abs().max()) if a[name].numel() else 0.0
        worst = max(worst, diff)
        same = (
            torch.equal(a[name], b[name]) if exact else torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-6)
        )
        if not same:
            raise MegatronReplayError(f"{what}: gradient of {name} differs (max |Δ| = {diff:.3e})")
    return worst


def run_checks(layout: MegatronLayout, *, seed: int = 0, subject: str) -> dict[str, Any]:
    """Run the five checks on this rank against ``subject`` (a ``module:attr`` spec); raise
    ``MegatronReplayError`` on the first failure.

    Returns a small report of plain values (this rank's coordinates as a dict, token and router
    counts, the loss values).
    """
    r = _Rank(layout, seed, subject)
    report: dict[str, Any] = {
        "coords": asdict(r.coords),  # plain values: the report leaves the rank as torch.save bytes
        "routers": len(r.routers),
        "local_tokens": layout.local_tokens,
    }

    # 1. live routing, with recompute
    r.control.disarm()
    r.zero_grad()
    live_step = r.forward(0)
    r.backward(live_step)
    live_loss = live_step.loss
    live_grads = r.grads()
    report["live_loss"] = float(live_loss.detach())

    # 2.–3. R2, for a subject that records (an R3-only one, SkyRL, has no merge_recordings: the
    # report says so and the suite skips the R2 half by name)
    report["r2"] = hasattr(r.data, "merge_recordings")
    if report["r2"]:
        # 2. record → canonical traces: every router's native choice is the route of the position it held
        traces = r.record()
        r.check_placement(traces, "record → canonical traces")

        # 3. replay the recording: bit-exact gradients (the loss bit-exact always; the gradients within
        # float rounding where a packed micro-batch has filler rows: a trace has no route for them, so
        # they may go to other experts than in the recording pass, and each expert's gradient then
        # sums its tokens' exact-zero contributions in another blocking)
        loss, grads = r.replay_step(traces, "replay of the recording")
        if not torch.equal(loss, live_loss.detach()):
            raise MegatronReplayError(
                f"replay of the recording: loss {float(loss)} != live {float(live_loss)}"
            )
        report["r2_bit_exact"] = not layout.packed or layout.packed_rows == sum(layout.lengths or ())
        report["max_grad_diff_record_replay"] = _compare_grads(
            grads, live_grads, "replay of the recording vs live", exact=report["r2_bit_exact"]
        )

    # 4. foreign targets (R3): forced dispatch, router still gets gradients
    foreign = random_traces(layout, seed + 3)
    loss_f, grads_f = r.replay_step(foreign, "replay of foreign targets")
    report["foreign_loss"] = float(loss_f)
    for name, g in grads_f.items():
        if name.endswith("router.weight") and not bool(g.abs().sum() > 0):
            raise MegatronReplayError(f"replay of foreign targets: {name} received no gradient")
    if torch.equal(loss_f, live_loss.detach()):
        raise MegatronReplayError("replay of foreign targets did not change the loss: replay had no effect")

    # 5. two micro-batches, FIFO order through the recompute
    traces2 = random_traces(layout, seed + 4)
    singles = []
    for mb, tr in ((0, foreign), (1, traces2)):
        r.zero_grad()
        r.feed(tr)
        r.control.replay_forward()
        step_mb = r.forward(mb)
        r.control.prepare_backward()
        r.backward(step_mb)
        r.control.disarm()
        singles.append(r.grads())
    r.zero_grad()
    losses = []
    for mb, tr in ((0, foreign), (1, traces2)):
        r.feed(tr)
        r.control.replay_forward()
        losses.append(r.forward(mb))
    r.control.prepare_backward()
    for step_mb in losses:
        r.backward(step_mb)
    summed = {name: singles[0][name] + singles[1][name] for name in singles[0]}
    report["max_grad_diff_fifo"] = _compare_grads(
        r.grads(), summed, "two micro-batches vs one at a time", exact=False
    )
    r.check_drained("two micro-batches")
    r.control.disarm()
    r.probe.remove()
    return report


def run_router_checks(
    layout: MegatronLayout, rules: Mapping[str, Mapping[str, Any]], *, seed: int = 0, subject: str
) -> dict[str, Any]:
    """For each gate-weight rule (``TransformerConfig`` fields, ``moe_router_topk`` included, merged
    under the subject driver's ``config_overrides()``): a model of that router on this rank, native
    routing, then foreign targets replayed through the subject with recompute; every router call's
    gate weights must be the rule's (``expected_gate_weights``, from the router's own logits), and
    the replay checks of :func:`run_checks` hold (dispatch, placement, FIFO). Returns the rules
    checked, by name."""
    checked = []
    for name, rule in rules.items():
        what = f"router rule {name!r}"
        rule_layout = replace(layout, top_k=int(rule.get("moe_router_topk", layout.top_k)))
        r = _Rank(rule_layout, seed, subject, router=rule)
        r.control.disarm()
        r.zero_grad()
        r.probe.clear()
        r.positions.clear()
        step = r.forward(0)
        r.backward(step)
        r.check_gate_weights(f"{what}, native routing")
        r.replay_step(random_traces(rule_layout, seed + 3), f"{what}, replay of foreign targets")
        r.probe.remove()
        checked.append(name)
    return {"rules": checked}
