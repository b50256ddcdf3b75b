"""The Megatron-core replay checks, run on every rank of an initialised ``torch.distributed`` world.

:func:`run_checks` builds a tiny GPT MoE for a :class:`MegatronLayout`, and checks DESIGN §3.5–3.8
against Megatron-core's own ``RouterReplay``:

1. **live**: native routing, forward + backward with MoE activation recompute → reference loss
   and gradients.
2. **record → canonical**: RECORD, gather every rank's per-router recordings, merge them into one
   canonical decoder-axis ``RoutingTrace`` per sample (``merge_recordings``), and check that
   placing those traces back through the layout gives each rank exactly what it recorded.
3. **replay own recording (R2)**: feed the canonical traces through the layout into
   ``RouterReplay.set_replay_data`` (one tensor per instance, build order), REPLAY_FORWARD,
   REPLAY_BACKWARD for the recompute; every router — forward *and* recompute — chooses exactly its
   targets, the dispatcher hands every local expert exactly the tokens whose targets name it (all
   ranks of the ``tp·ep`` group), the FIFO is drained, and the loss and every gradient equal live
   routing's **bit for bit**.
4. **replay foreign targets (R3)**: random canonical traces; the same dispatch, instance and FIFO
   checks; the router weights still receive gradients; the loss differs from live.
5. **two micro-batches (pipeline schedule)**: forward mb1, forward mb2, then backward mb1, mb2:
   REPLAY_BACKWARD pops the FIFO in forward order, and the accumulated gradients equal those of
   the two micro-batches run one at a time.

Placement has an oracle independent of the layout functions: every token carries its own position
into the decoder (channel 0 of the embeddings), so each router row's expected route is read off the
canonical trace at the position Megatron actually put there.

``mutant`` breaks one step on purpose so the checks can be seen to fail: ``"layer_shift"`` gives
each router the previous MoE layer's targets (verl #5037), ``"batch_major"`` flattens tokens
``b·S + s`` instead of seq-major, ``"forward_in_backward"`` leaves REPLAY_FORWARD set through the
recompute (FACTS §2 "recompute drift").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.trace import LayerAxis, RoutingTrace
from harness.trainers.megatron.layout import (
    MegatronLayout,
    MegatronReplayError,
    batch_routes,
    expected_local_map,
    ids_to_map,
    merge_recordings,
    random_traces,
    rank_targets,
)
from harness.trainers.megatron.model import batch_tokens, build_gpt, tiny_config
from harness.trainers.megatron.replay import DispatchProbe, MegatronReplay

MUTANTS = ("layer_shift", "batch_major", "forward_in_backward")


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
    """One rank's model, replay handle, probe and data."""

    def __init__(
        self, layout: MegatronLayout, seed: int, mutant: str | None = None, **config_overrides: Any
    ) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.layout = layout
        self.mutant = mutant
        self.coords = init_parallel(layout, seed)
        RouterReplay.clear_global_router_replay_instances()
        self.config = tiny_config(layout, **config_overrides)
        self.model = build_gpt(self.config, layout)
        self.replay = MegatronReplay.install(self.model, config=self.config)
        self.probe = DispatchProbe.attach(self.model)
        stage = layout.stage_moe_layers(self.coords.pp)
        if self.replay.layer_numbers != stage:
            raise MegatronReplayError(
                f"routers sit on decoder layers {self.replay.layer_numbers}, the layout says {stage}"
            )
        self.device = next(self.model.parameters()).device
        self._mark_positions()
        ids, labels = batch_tokens(layout, seed + 1)
        b = layout.micro_batch
        self.micro_batches = [
            (
                ids[self.coords.dp * b : (self.coords.dp + 1) * b],
                labels[self.coords.dp * b : (self.coords.dp + 1) * b],
            )
        ]
        ids2, labels2 = batch_tokens(layout, seed + 2)
        self.micro_batches.append(
            (
                ids2[self.coords.dp * b : (self.coords.dp + 1) * b],
                labels2[self.coords.dp * b : (self.coords.dp + 1) * b],
            )
        )
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
        """
        emb = self.model.embedding
        with torch.no_grad():
            emb.word_embeddings.weight[:, 0] = 0
            emb.position_embeddings.weight[:, 0] = torch.arange(
                self.layout.seq_len, dtype=emb.position_embeddings.weight.dtype
            )
        self.positions: list[torch.Tensor] = []

        def hook(module: Any, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.positions.append(hidden[..., 0].detach().round().long().cpu().clone())

        self.model.decoder.layers[0].register_forward_pre_hook(hook, with_kwargs=True)

    # --- steps -------------------------------------------------------------------------------

    def forward(self, mb: int) -> torch.Tensor:
        ids, labels = (t.to(self.device) for t in self.micro_batches[mb])
        position_ids = torch.arange(self.layout.seq_len, device=self.device).unsqueeze(0).expand_as(ids)
        mask = torch.triu(
            torch.ones(self.layout.seq_len, self.layout.seq_len, dtype=torch.bool, device=self.device),
            diagonal=1,
        ).view(1, 1, self.layout.seq_len, self.layout.seq_len)
        losses = self.model(ids, position_ids, mask, labels=labels)
        return losses.float().sum()

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in self.model.named_parameters()
        }

    def _place(self, routes: torch.Tensor, coords: Coordinates) -> list[torch.Tensor]:
        """``rank_targets`` for ``coords`` (or, for a layout mutant, a known-wrong variant of it)."""
        layout = self.layout
        targets = rank_targets(routes, layout, dp_rank=coords.dp, tp_rank=coords.tp, pp_rank=coords.pp)
        if self.mutant == "layer_shift":  # every router gets the previous MoE layer's targets
            targets = targets[-1:] + targets[:-1]
        elif self.mutant == "batch_major":  # tokens flattened b·S + s instead of Megatron's s·B + b
            s_local = layout.seq_len // layout.tp
            targets = [
                t.view(layout.micro_batch, s_local, layout.top_k).transpose(0, 1).reshape(-1, layout.top_k)
                for t in targets
            ]
        return targets

    def targets(self, traces: list[RoutingTrace]) -> list[torch.Tensor]:
        routes = batch_routes(traces, self.layout)
        return [t.to(self.device) for t in self._place(routes, self.coords)]

    def gathered(self, traces: list[RoutingTrace]) -> list[torch.Tensor]:
        """Per router: the targets of every token the dispatcher gathers onto this rank, in group order."""
        routes = batch_routes(traces, self.layout)
        per_rank = [self._place(routes, self.all_coords[r]) for r in self.gather_ranks]
        return [torch.cat([rt[j] for rt in per_rank]) for j in range(len(self.replay.routers))]

    # --- checks ------------------------------------------------------------------------------

    def check_dispatch(
        self, targets: list[torch.Tensor], gathered: list[torch.Tensor], what: str, calls: int
    ) -> None:
        """Each router chose, and each local expert received, its exact targets in all ``calls`` forwards."""
        layout = self.layout
        for j, layer in enumerate(self.replay.layer_numbers):
            where = f"{what}: rank {self.coords.rank} router {j} (decoder layer {layer})"
            chosen, dispatched = self.probe.chosen[j], self.probe.dispatched[j]
            if len(chosen) != calls or len(dispatched) != calls:
                raise MegatronReplayError(
                    f"{where}: {len(chosen)} router / {len(dispatched)} expert calls, expected {calls}"
                )
            want = ids_to_map(targets[j].cpu(), layout.num_experts)
            want_local = expected_local_map(gathered[j].cpu(), layout, self.coords.ep)
            for call in range(calls):
                if not torch.equal(chosen[call], want):
                    bad = int((chosen[call] != want).any(dim=1).sum())
                    raise MegatronReplayError(
                        f"{where}, forward {call}: {bad} tokens routed to other experts than their targets"
                    )
                if not torch.equal(dispatched[call], want_local):
                    bad = int((dispatched[call] != want_local).any(dim=1).sum())
                    raise MegatronReplayError(
                        f"{where}, forward {call}: the dispatcher handed {bad} gathered tokens to other "
                        "local experts "
                        f"(EP rank {self.coords.ep}) than their targets name"
                    )
                counts = want_local.sum(dim=0).long()
                if not torch.equal(self.probe.tokens_per_expert[j][call], counts):
                    raise MegatronReplayError(
                        f"{where}, forward {call}: tokens_per_expert differs from the targets"
                    )

    def check_placement(self, traces: list[RoutingTrace], what: str) -> None:
        """Independent of the layout functions: row ``s·B + b`` of every router chose the canonical route
        of the sample and position Megatron actually put there (read from the tokens themselves)."""
        layout = self.layout
        routes = batch_routes(traces, layout)  # [dp·B, S, layers, k]
        positions = self.positions[-1]  # [S/tp, B]
        if tuple(positions.shape) != (layout.seq_len // layout.tp, layout.micro_batch):
            raise MegatronReplayError(f"{what}: decoder input holds {tuple(positions.shape)} rows per rank")
        samples = self.coords.dp * layout.micro_batch + torch.arange(layout.micro_batch)
        for j, layer in enumerate(self.replay.layer_numbers):
            want = routes[samples.unsqueeze(0).expand_as(positions), positions, layer].reshape(
                -1, layout.top_k
            )
            for call, chosen in enumerate(self.probe.chosen[j]):
                if not torch.equal(chosen, ids_to_map(want, layout.num_experts)):
                    bad = int((chosen != ids_to_map(want, layout.num_experts)).any(dim=1).sum())
                    raise MegatronReplayError(
                        f"{what}: rank {self.coords.rank} router {j} (decoder layer {layer}), "
                        f"forward {call}: "
                        f"{bad} tokens did not get the canonical route of the position they hold"
                    )

    def check_received(self, targets: list[torch.Tensor], what: str) -> None:
        for j, inst in enumerate(self.replay.instances):
            if inst.target_topk_idx is None or not torch.equal(inst.target_topk_idx, targets[j]):
                raise MegatronReplayError(f"{what}: RouterReplay instance {j} does not hold its targets")

    def feed(self, targets: list[torch.Tensor]) -> None:
        self.replay.feed(list(targets), self.layout.local_tokens)

    def replay_step(
        self, traces: list[RoutingTrace], mutant: str | None, what: str
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """REPLAY_FORWARD forward, REPLAY_BACKWARD backward; dispatch / instance / FIFO checks."""
        targets, gathered = self.targets(traces), self.gathered(traces)
        self.zero_grad()
        self.probe.clear()
        self.positions.clear()
        self.feed(targets)
        self.replay.replay_forward()
        loss = self.forward(0)
        self.check_received(targets, what)
        if mutant != "forward_in_backward":
            self.replay.prepare_backward()
        loss.backward()
        calls = 2 if self.config.recompute_granularity == "selective" else 1
        self.check_dispatch(targets, gathered, what, calls)
        self.check_placement(traces, what)
        self.replay.check_drained()
        self.replay.disarm()
        return loss.detach(), self.grads()


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


def run_checks(layout: MegatronLayout, *, seed: int = 0, mutant: str | None = None) -> dict[str, Any]:
    """Run the five checks on this rank; raise ``MegatronReplayError`` on the first failure.

    Returns a small report (this rank's coordinates, token and router counts, the loss values).
    """
    if mutant is not None and mutant not in MUTANTS:
        raise ValueError(f"mutant must be one of {MUTANTS}, got {mutant!r}")
    if layout.pp != 1:
        raise MegatronReplayError("run_checks drives one pipeline stage (pp = 1); layouts cover pp > 1")
    r = _Rank(layout, seed, mutant)
    report: dict[str, Any] = {
        "coords": r.coords,
        "routers": len(r.replay.routers),
        "local_tokens": layout.local_tokens,
    }

    # 1. live routing, with recompute
    r.replay.native()
    r.zero_grad()
    live_loss = r.forward(0)
    live_loss.backward()
    live_grads = r.grads()
    report["live_loss"] = float(live_loss.detach())

    # 2. record → canonical traces → back through the layout
    r.replay.record()
    with torch.no_grad():
        r.forward(0)
    recorded = r.replay.recording()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (r.coords, [t.cpu() for t in recorded]))
    merged = merge_recordings({(c.dp, c.tp, c.pp): recs for c, recs in everyone}, layout)
    traces = [
        RoutingTrace(
            sample.numpy(),
            num_experts=layout.num_experts,
            moe_layers=layout.moe_layers,
            num_layers=layout.num_layers,
            layer_axis=LayerAxis.MOE_ORDINAL,
        ).to_decoder_axis()
        for sample in merged
    ]
    placed = r.targets(traces)
    for j, (a, b) in enumerate(zip(placed, recorded, strict=True)):
        if not torch.equal(a.cpu(), b.cpu().long()):
            raise MegatronReplayError(f"record → canonical → layout is not the identity (router {j})")

    # 3. replay the recording: bit-exact gradients
    loss, grads = r.replay_step(traces, mutant, "replay of the recording")
    if not torch.equal(loss, live_loss.detach()):
        raise MegatronReplayError(f"replay of the recording: loss {float(loss)} != live {float(live_loss)}")
    report["max_grad_diff_record_replay"] = _compare_grads(
        grads, live_grads, "replay of the recording vs live"
    )

    # 4. foreign targets (R3): forced dispatch, router still gets gradients
    foreign = random_traces(layout, seed + 3)
    loss_f, grads_f = r.replay_step(foreign, mutant, "replay of foreign targets")
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
        r.probe.clear()
        r.feed(r.targets(tr))
        r.replay.replay_forward()
        loss_mb = r.forward(mb)
        r.replay.prepare_backward()
        loss_mb.backward()
        r.replay.check_drained()
        r.replay.disarm()
        singles.append(r.grads())
    r.zero_grad()
    r.probe.clear()
    losses = []
    for mb, tr in ((0, foreign), (1, traces2)):
        r.feed(r.targets(tr))
        r.replay.replay_forward()
        losses.append(r.forward(mb))
    if r.replay.pending() != [2] * len(r.replay.routers):
        raise MegatronReplayError(f"two queued forwards, FIFO lengths {r.replay.pending()}")
    if mutant != "forward_in_backward":
        r.replay.prepare_backward()
    for loss_mb in losses:
        loss_mb.backward()
    summed = {name: singles[0][name] + singles[1][name] for name in singles[0]}
    report["max_grad_diff_fifo"] = _compare_grads(
        r.grads(), summed, "two micro-batches vs one at a time", exact=False
    )
    r.replay.check_drained()
    r.replay.disarm()
    r.probe.remove()
    return report


def run_mutants(
    layout: MegatronLayout, *, seed: int = 0, mutants: tuple[str, ...] = MUTANTS
) -> dict[str, str | None]:
    """Run :func:`run_checks` once per mutant on a one-rank world; return each mutant's error (None: missed).

    One rank only: on several ranks one rank's failure can leave the others waiting in a collective.
    """
    if dist.get_world_size() != 1:
        raise MegatronReplayError("run_mutants needs a one-rank world")
    caught: dict[str, str | None] = {}
    for mutant in mutants:
        try:
            run_checks(layout, seed=seed, mutant=mutant)
            caught[mutant] = None
        except MegatronReplayError as err:
            caught[mutant] = str(err)
    return caught
