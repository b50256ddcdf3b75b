"""The Megatron-core MTP-router check, run on one rank of an initialised ``torch.distributed`` world.

A multi-token-prediction block's MoE router owns a ``RouterReplay`` after the decoder's (FACTS §2),
while a canonical trace holds rows for the decoder's MoE layers only. Under replay of canonical
decoder targets every decoder router must dispatch exactly its targets and the MTP router must not
be handed a decoder layer's: with no rows of its own it routes natively (DESIGN §3.8, FACTS §4 "MTP
routers": a replay keyed by the bare 1-based ``layer_number``, which an MTP layer restarts at 1,
gives MTP router k decoder layer k's routes, NeMo-RL #3903).

:func:`run_mtp_checks` builds the tiny GPT MoE with one MTP layer, lets the subject's data movement
(``megatron_data``) feed random canonical traces and its driver (``install_megatron_replay``) switch
REPLAY_FORWARD then REPLAY_BACKWARD (MoE activation recompute), and judges with the harness's probe
(``harness.probes.megatron``): what each router chose, forward and recompute, against the harness's
own placement (``layout.rank_targets``) and, for the MTP router, the top-k of its live logits.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.errors import MegatronReplayError
from harness.probes.megatron import DispatchProbe
from harness.subjects import load_subject
from harness.subjects.replay import ensure_patched
from harness.trainers.megatron.layout import (
    MegatronLayout,
    batch_routes,
    ids_to_map,
    random_traces,
    rank_targets,
)
from harness.trainers.megatron.model import batch_tokens, build_gpt, tiny_config
from suites.megatron_checks import init_parallel


def _mtp_moe_layers(model: torch.nn.Module) -> set[int]:
    """``id`` s of the ``MoELayer`` s inside the model's multi-token-prediction layers (by module)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return {
        id(m)
        for layer in model.modules()
        if isinstance(layer, MultiTokenPredictionLayer)
        for m in layer.modules()
        if isinstance(m, MoELayer)
    }


_NATIVE_RULE = {
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
}
"""The router rule of ``tiny_config`` that ``_native_map`` computes (softmax after top-k, no bias)."""


def _native_map(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The routing map a softmax-after-top-k router with no bias chooses from its live logits."""
    return ids_to_map(logits.topk(top_k, dim=-1).indices, logits.shape[-1])


def run_mtp_checks(layout: MegatronLayout, *, seed: int = 0, subject: str) -> dict[str, Any]:
    """One replayed forward + backward of a model with one MTP layer; raise on the first violation.

    Returns what was checked: decoder and MTP router counts and the MTP router's calls (forward and
    recompute), for the test to assert that the check was not vacuous.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if layout.world_size != 1 or layout.packed:
        raise MegatronReplayError("run_mtp_checks: one rank, padded [B, S] micro-batch only")
    loaded = load_subject(subject)
    driver, data = loaded.install_megatron_replay, loaded.megatron_data
    if driver is None or data is None:
        raise MegatronReplayError(f"subject {loaded.name!r} needs install_megatron_replay and megatron_data")
    init_parallel(layout, seed)
    ensure_patched(driver)
    RouterReplay.clear_global_router_replay_instances()
    config = tiny_config(layout, mtp_num_layers=1, **dict(driver.config_overrides()))
    rule = {name: getattr(config, name, None) for name in _NATIVE_RULE}
    if rule != _NATIVE_RULE:  # the MTP router's native choice is judged by this rule only
        raise MegatronReplayError(
            f"run_mtp_checks: router settings {rule}; expected {_NATIVE_RULE} (the driver's config_overrides "
            "changed the router rule the native check computes)"
        )
    model = build_gpt(config, layout)
    control = driver.install([model], config)
    probe = DispatchProbe.attach(model)
    in_mtp = _mtp_moe_layers(model)
    decoder = [j for j, layer in enumerate(probe.moe_layers) if id(layer) not in in_mtp]
    mtp = [j for j, layer in enumerate(probe.moe_layers) if id(layer) in in_mtp]
    if len(decoder) != len(layout.moe_layers) or len(mtp) != 1:
        raise MegatronReplayError(
            f"model has {len(decoder)} decoder / {len(mtp)} MTP MoE layers, expected "
            f"{len(layout.moe_layers)} / 1"
        )

    ids, labels = batch_tokens(layout, seed + 1)
    s = layout.seq_len
    routes = batch_routes(random_traces(layout, seed + 7), layout)
    targets = rank_targets(routes, layout, dp_rank=0, tp_rank=0, pp_rank=0, vpp_chunk=0)
    data.set_replay_data(routes, torch.ones(layout.micro_batch, s, dtype=torch.long), config, model=[model])
    control.replay_forward()
    loss = model(
        input_ids=ids,
        position_ids=torch.arange(s).unsqueeze(0).expand_as(ids),
        attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s),
        labels=labels,
    )
    control.prepare_backward()
    loss.float().sum().backward()
    control.disarm()

    wanted = [ids_to_map(t.cpu(), layout.num_experts) for t in targets]
    for j, layer, want in zip(decoder, layout.moe_layers, wanted, strict=True):
        calls = probe.chosen[j]
        if len(calls) != 2:
            raise MegatronReplayError(f"decoder layer {layer}: {len(calls)} router calls, expected 2")
        for call, chosen in enumerate(calls):
            if not torch.equal(chosen, want):
                bad = int((chosen != want).any(dim=1).sum())
                raise MegatronReplayError(
                    f"decoder layer {layer} call {call}: {bad}/{len(want)} tokens not routed to their "
                    "canonical targets under replay"
                )
    j = mtp[0]
    calls = list(zip(probe.chosen[j], probe.logits[j], strict=True))
    if not calls:
        raise MegatronReplayError("the MTP router was never called: nothing checked")
    for call, (chosen, logits) in enumerate(calls):
        given = [
            layer for layer, want in zip(layout.moe_layers, wanted, strict=True) if torch.equal(chosen, want)
        ]
        if given:
            raise MegatronReplayError(
                f"MTP router call {call}: routed exactly as decoder layer {given[0]}'s replay targets (a "
                "replay keyed by bare layer_number, NeMo-RL #3903); with no rows of its own it must route "
                "natively"
            )
        native = _native_map(logits, layout.top_k)
        if not torch.equal(chosen, native):
            bad = int((chosen != native).any(dim=1).sum())
            raise MegatronReplayError(
                f"MTP router call {call}: {bad}/{len(native)} tokens not routed by its own live logits "
                "under replay (the canonical trace has no MTP rows: it must route natively)"
            )
    return {"decoder_routers": len(decoder), "mtp_routers": len(mtp), "mtp_calls": len(calls)}
