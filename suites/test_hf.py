"""Real transformers MoE models beyond the replay invariants (DESIGN §3.1, §3.4–3.6, §3.10).

The replay invariants every family must meet (targets reach the experts, bit-exact replay of a
recording, gradients at unpicked targets, recompute FIFO, masked rows native, no fallback) are in
``suites/test_replay.py``, parametrised over (model kind × family). Here: packed (unpadded) and SP-padded
batches keep every replayed row on its token, observed by the harness's probe
(``harness.probes.hf``); abort/resume and multi-turn through real HF generation splice to the
first-computed rows. The harness's own HF engine (KV-cache rollout coverage, the mismatch lab on a
bf16 Qwen3-MoE) is checked in ``conformance/test_hf_engine.py``: no subject is involved there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
import torch

from harness.probes import RouteProbe
from harness.subjects import Subject
from harness.subjects.capabilities import ReplayController
from harness.subjects.replay import controlled, patches, prepare
from harness.testing.asserts import assert_close_logprobs, assert_same_routes, differing_routes
from harness.testing.suite import require
from harness.trainers.hf import install_replay
from harness.trainers.kinds import Routing, hf_kind
from reference_impl.episode import AttemptPlan, Schedule, run_episode
from reference_impl.layouts import pack, sp_pad, sp_shard, sp_valid_mask
from reference_impl.splice import splice_replace

pytestmark = pytest.mark.hf

BATCH, SEQ = 2, 6
KIND = hf_kind()


@pytest.fixture
def arm(
    subject: Subject,
) -> Iterator[Callable[[str], tuple[torch.nn.Module, ReplayController, RouteProbe, Routing]]]:
    """``arm(model_type)``: a fresh fp32 model, the subject's controller on it, then the harness's probe;
    all torn down after the test."""
    stack = ExitStack()

    def arm_model(model_type: str) -> tuple[torch.nn.Module, ReplayController, RouteProbe, Routing]:
        driver = prepare(require(subject, KIND.capability), KIND.capability)  # patch, then build
        model = KIND.build(model_type, "fp32", fresh=patches(driver))
        controller = stack.enter_context(controlled(driver, model, KIND.capability))
        probe = KIND.probe(model)
        stack.callback(probe.remove)
        return model, controller, probe, KIND.routing(model)

    with stack:
        yield arm_model


def _fresh(model_type: str) -> torch.nn.Module:
    return KIND.build(model_type, "fp32")


def _tokens(seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, KIND.vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


AXES = ("token", "MoE ordinal")


_ROUTER_SUFFIXES = ("mlp.gate", "mlp.router", "feed_forward.router")


def _perturb_routers(model: torch.nn.Module, seed: int | None = None) -> None:
    """Negate the router weights (``seed`` None) or add N(0, 1)/sqrt(hidden) noise: live routing changes."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(_ROUTER_SUFFIXES):
                weight = module.weight
                if gen is None:
                    weight.neg_()
                else:
                    noise = torch.randn(weight.shape, generator=gen) / weight.shape[1] ** 0.5
                    weight.add_(noise.to(weight.dtype))


def _forward(model: torch.nn.Module, tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False, **kwargs).logits


def _block_causal_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive ``[1, 1, N, N]`` mask: query q sees key j iff same sample and j ≤ q (0 there, min elsewhere).

    transformers 5.x ``masking_utils._preprocess_mask_arguments`` returns a user-supplied 4-D mask as
    is (early exit), so this is what every attention layer gets. An additive float mask works for
    SDPA (``sdpa_attention_forward`` passes a non-bool mask to ``scaled_dot_product_attention`` as an
    additive bias) and for eager attention (which adds it to the scores) alike.
    """
    n = segments.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = causal & (segments[:, None] == segments[None, :])
    mask = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@pytest.mark.capability("install_hf_replay")
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_packed_batch_keeps_every_row_on_its_token(arm: Any, model_type: str) -> None:
    """Samples packed into one ``[1, N]`` row (``pack`` indices) route and replay exactly as alone (§3.5).

    The packed row restarts ``position_ids`` per sample and carries a block-diagonal causal 4-D mask
    (the varlen layout of FlashAttention / verl ``use_remove_padding``). (a) The packed forward's
    native recording, unpacked with the same indices, is each sample's solo recording. (b) With the
    routers negated (live routing prefers other experts), replaying each sample's solo routes gathered
    into packed order dispatches exactly them, and the logits unpacked equal each sample's solo replay:
    every target sits on its own token.
    """
    model, handle, probe, routing = arm(model_type)
    lengths = (5, 3, 7)
    batch, width, layers = len(lengths), max(lengths), len(routing.moe_layers)
    attention = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # right-padded [B, W]
    tokens = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        tokens[b, :n] = _tokens(20 + b, batch=1, seq=n)[0]
    packing = pack(attention)
    packed = packing.gather(tokens)[None]
    position_ids = packing.gather(torch.arange(width).expand(batch, width))[None]
    segments = packing.gather(torch.arange(batch)[:, None].expand(batch, width))
    mask4d = _block_causal_mask(segments, torch.float32)

    def packed_forward() -> torch.Tensor:
        return _forward(model, packed, attention_mask=mask4d, position_ids=position_ids)[0]

    with torch.no_grad():
        solo_routes = torch.zeros(batch, width, layers, routing.top_k, dtype=torch.long)
        solo_logits = []
        for b, n in enumerate(lengths):
            handle.record()
            solo_logits.append(_forward(model, tokens[b : b + 1, :n])[0])
            solo_routes[b, :n] = handle.recording()
        handle.record()
        logits = packing.scatter(packed_forward())
        native = packing.scatter(handle.recording())
        for b, n in enumerate(lengths):
            assert_same_routes(
                native[b, :n],
                solo_routes[b, :n],
                names=("packed", "alone"),
                what=f"{model_type}: sample {b} routed natively",
                axes=AXES,
            )
            assert_close_logprobs(
                logits[b, :n],
                solo_logits[b],
                names=("packed", "alone"),
                what=f"{model_type}: sample {b}'s logits",
                atol=1e-4,
                axes=("token", "vocab id"),
            )

        _perturb_routers(model)
        solo_replayed = []
        live_differs = 0
        for b, n in enumerate(lengths):
            handle.record()
            _forward(model, tokens[b : b + 1, :n])
            live_differs += int(differing_routes(handle.recording(), solo_routes[b, :n]).sum())
            handle.replay(solo_routes[b, :n])
            solo_replayed.append(_forward(model, tokens[b : b + 1, :n])[0])
        assert live_differs > 0, f"{model_type}: negated routers still pick the targets: replay is untested"
        targets = packing.gather(solo_routes)
        handle.replay(targets)
        replayed = packing.scatter(packed_forward())
        dispatched = probe.last().ids
    handle.disarm()
    assert_same_routes(
        dispatched,
        targets,
        names=("dispatched", "targets"),
        what=f"{model_type}: packed replay",
        axes=("packed position", "MoE ordinal"),
    )
    for b, n in enumerate(lengths):
        assert_close_logprobs(
            replayed[b, :n],
            solo_replayed[b],
            names=("packed", "alone"),
            what=f"{model_type}: sample {b}'s replayed logits",
            atol=1e-4,
            axes=("token", "vocab id"),
        )


@pytest.mark.capability("install_hf_replay")
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_sp_padded_shards_replay_their_own_targets(arm: Any, model_type: str, tp: int) -> None:
    """SP slicing, single process: each TP rank's shard of the dispatched ids is its targets' shard (§3.6).

    This is the single-process alignment check of the SP slicing (Megatron sequence parallel / slime,
    verl): one sequence is padded with ``sp_pad`` to a multiple of ``tp`` (pad token id 0 at the end,
    attention mask 0 there), its routes padded the same way and marked with ``sp_valid_mask``; the
    padded targets are replayed with that mask through the real model, and for every rank the rows
    of ``sp_shard(dispatched)`` equal ``sp_shard(targets)`` at the valid positions. Padded positions
    are never replayed with the zero filler: they route natively. The true multi-rank path (each rank
    routing only its shard, Ulysses all-to-all) is not run here; ``suites/test_distributed.py`` runs
    the reference model's SP shards under real process groups.

    Two replays: (1) targets = the model's own native routes, so the logits are bit-exact (every row
    sits on its token) and a padded position routes exactly as in the native run; (2) the routers
    negated, so the live routing prefers other experts and every valid row must still be its target
    (padded rows: native at the first MoE layer, which no replayed layer precedes, and never the
    filler anywhere).
    """
    model, handle, probe, routing = arm(model_type)
    seq_len = 9
    tokens, pad_len = sp_pad(_tokens(30, batch=1, seq=seq_len)[0], tp)
    assert pad_len > 0, "no padding: the test cannot see filler"
    attention = torch.ones(1, seq_len + pad_len, dtype=torch.long)
    attention[0, seq_len:] = 0
    valid = torch.cat([sp_valid_mask(seq_len, tp, rank) for rank in range(tp)])
    padded_positions = (~valid).nonzero().squeeze(1).tolist()

    def forward() -> torch.Tensor:
        return _forward(model, tokens[None], attention_mask=attention)

    with torch.no_grad():
        handle.record()
        native_logits = forward()
        native = handle.recording()
        targets, _ = sp_pad(native[:seq_len], tp)  # real rows, then zero filler rows
        handle.replay(targets, valid)
        own_logits = forward()
        own = probe.last().ids
        _perturb_routers(model)
        handle.record()
        forward()
        live = handle.recording()
        handle.replay(targets, valid)
        forward()
        negated = probe.last().ids
    handle.disarm()
    assert bool(differing_routes(live[valid], targets[valid]).any()), (
        f"{model_type}: negated routers still pick the targets at every valid position: replay is untested"
    )
    for run, dispatched in (("own routes", own), ("negated routers", negated)):
        for rank in range(tp):
            rank_valid = sp_valid_mask(seq_len, tp, rank)
            assert_same_routes(
                sp_shard(dispatched, tp, rank),
                sp_shard(targets, tp, rank),
                names=("dispatched", "targets"),
                what=f"{model_type} tp={tp} ({run}): rank {rank}'s shard",
                axes=("shard row", "MoE ordinal"),
                mask=rank_valid,
            )
        pad_rows = dispatched[~valid].sort(dim=-1).values
        filler = (pad_rows[..., 1:] == pad_rows[..., :-1]).any(-1) if routing.top_k > 1 else pad_rows == 0
        assert not filler.any(), (
            f"{model_type} tp={tp} ({run}): padded positions {padded_positions} replayed the zero filler "
            f"(dispatched {pad_rows.tolist()})"
        )
    assert_close_logprobs(
        own_logits,
        native_logits,
        names=("replaying its own padded routes", "native"),
        what=f"{model_type} tp={tp}: logits (rows off their tokens?)",
        axes=("sample", "position", "vocab id"),
    )
    assert_same_routes(
        own,
        native,
        names=("replaying its own routes", "native"),
        what=f"{model_type} tp={tp}: padded positions {padded_positions}",
        axes=("position", "MoE ordinal"),
        mask=~valid,
    )
    assert_same_routes(
        negated[:, :1],
        live[:, :1],
        names=("replaying with negated routers", "live routing"),
        what=f"{model_type} tp={tp}: padded positions {padded_positions} at the first MoE layer",
        axes=("position", "MoE ordinal"),
        mask=~valid,
    )


def _first_computed_rows(attempts, rows: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Row p from the first attempt whose payload covers p: the routing live when p was fed."""
    out = []
    for p in range(rows):
        payload = next(a.routes for a in attempts if a.routes is not None and a.routes.shape[0] > p)
        out.append(payload[p])
    return torch.stack(out)


EPISODES = {
    "abort-resume": (
        AttemptPlan(3, finish_reason="abort"),
        AttemptPlan(2, finish_reason="abort"),
        AttemptPlan(4, finish_reason="length"),
    ),
    "multi-turn": (AttemptPlan(3), AttemptPlan(2, tool_tokens=(5, 6, 7)), AttemptPlan(3, tool_tokens=(8, 9))),
}


@pytest.mark.capability("splice")
@pytest.mark.parametrize("perturbed", [False, True], ids=["same-weights", "weights-updated"])
@pytest.mark.parametrize("episode", list(EPISODES))
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_hf_generation_attempts_splice_to_first_computed_rows(
    subject: Subject, model_type: str, episode: str, perturbed: bool
) -> None:
    """Abort/resume and multi-turn through real HF generation (KV cache) splice to P + Σa − 1 rows (§3.4).

    ``hf_generate`` is the engine call of the one episode driver (``run_episode``); every engine call
    re-prefills the whole context. Each spliced row — the drivers' and the
    subject's splice of the same attempts — is the row of the first attempt that computed it, and
    each ``hf_generate`` payload is the routing of a full forward of its sequence (fp32). With
    ``weights-updated`` the routers change before every later attempt (the fully-async case), so the
    later re-prefills route earlier positions differently and a replace-with-latest splice (verl
    #6046) would differ; with the same weights, fp32 re-prefill reproduces the decode routing.
    """
    from harness.engines.checkpoint import spliced_trace
    from harness.engines.hf import hf_generate

    splice = require(subject, "splice")
    model = _fresh(model_type)
    handle = install_replay(model)  # the harness's HF engine records each call's payload itself
    engine = hf_generate(model, handle, generator=torch.Generator().manual_seed(7))
    calls = 0

    def generate(context, max_tokens):  # type: ignore[no-untyped-def]
        """One engine call; its payload must be the routing of a full forward of its sequence (fp32)."""
        nonlocal calls
        if perturbed and calls:
            _perturb_routers(model, seed=calls)
        calls += 1
        call = engine(context, max_tokens)
        with torch.no_grad():
            handle.record()
            _forward(model, torch.tensor([call.sequence]))
            full = handle.recording()[:-1]
        assert call.trace.start == 0, (
            f"{model_type} {episode}: call {calls}'s payload starts at {call.trace.start}, expected 0"
        )
        assert_same_routes(
            call.trace.to_moe_ordinal().experts,
            full,
            names=(f"call {calls}'s payload", "a full forward of its sequence"),
            what=f"{model_type} {episode}",
            axes=("position", "MoE ordinal"),
        )
        return call

    prompt = _tokens(40, batch=1, seq=4)[0].tolist()
    spliced = run_episode(generate, Schedule(tuple(prompt), EPISODES[episode]))
    trace = spliced_trace(spliced)
    added = sum(a.new_tokens for a in spliced.attempts)
    expected_rows = len(prompt) + added - 1
    assert len(spliced.tokens) == len(prompt) + added, (
        f"{model_type} {episode}: spliced sample has {len(spliced.tokens)} tokens, expected P + Σa = "
        f"{len(prompt)} + {added}"
    )
    assert trace.rows == expected_rows, (
        f"{model_type} {episode}: spliced trace has {trace.rows} rows, expected P + Σa − 1 = {expected_rows}"
    )
    want = _first_computed_rows(spliced.attempts, expected_rows)
    drivers = trace.experts
    got = splice(spliced.prompt_len, list(spliced.attempts))
    for who, rows in (("the drivers' splice", drivers), ("the subject's splice", got)):
        assert_same_routes(
            rows,
            want,
            names=(who, "the first-computed routing"),
            what=f"{model_type} {episode}",
            axes=("position", "layer slot"),
        )
    latest = splice_replace(spliced.prompt_len, list(spliced.attempts))
    if perturbed:
        assert bool(differing_routes(latest, want).any()), (
            f"{model_type} {episode}: the weight update changed no re-prefilled row: the test has no teeth"
        )
    else:
        assert_same_routes(
            latest,
            want,
            names=("replace-with-latest", "the first-computed routing"),
            what=f"{model_type} {episode}: same weights (re-prefill must reproduce decode routing)",
            axes=("position", "layer slot"),
        )
