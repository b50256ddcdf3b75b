"""Replay effect (DESIGN §3.6–3.8), one suite over (model kind × router family), observed by the harness.

The subject supplies the driver of each model kind (``install_replay`` for the reference ``MoELM``,
``install_hf_replay`` for transformers MoE models); the harness builds the model, installs the
driver, and attaches its *own* route probe (``harness.probes``) at the dispatch step, after the
subject's hooks. Every check compares what the subject was asked to do with what the probe saw the
experts receive; nothing the subject reports about itself (``dispatched()``) is used.

- the experts receive exactly the targets, whatever the live logits prefer (no silent fallback: every
  live router is replayed);
- replaying a model's own recording reproduces its logits and gate weights bit for bit (fp32, bf16);
- the router gets gradients at targets its live top-k would not pick;
- activation recompute replays each forward's own targets (two forwards in flight);
- rows without a target (left padding, last tokens) route natively, never with the filler;
- targets for the wrong number of MoE layers are an error, not native routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st

from harness.probes import RouteProbe
from harness.subjects import Subject
from harness.subjects.capabilities import MissingMember, OneForwardInFlight, ReplayController
from harness.subjects.replay import controlled
from harness.testing.asserts import assert_close_logprobs, assert_same_routes
from harness.testing.suite import require
from harness.trainers.hf.models import MODEL_TYPES
from harness.trainers.kinds import ModelKind, Routing, hf_kind, reference_kind
from reference_impl import ROUTER_FAMILIES
from reference_impl.layouts import place_left_padded

BATCH, SEQ = 2, 6
KINDS = {"reference": reference_kind(), "hf": hf_kind()}


def _cases(dtypes: tuple[str, ...], hf_types: tuple[str, ...] = tuple(MODEL_TYPES)) -> list[object]:
    on_reference = pytest.mark.capability(KINDS["reference"].capability)
    on_hf = [pytest.mark.hf, pytest.mark.capability(KINDS["hf"].capability)]
    cases = [
        pytest.param("reference", f, d, id=f"reference-{f}-{d}", marks=on_reference)
        for f in ROUTER_FAMILIES
        for d in dtypes
    ]
    cases += [pytest.param("hf", m, d, id=f"hf-{m}-{d}", marks=on_hf) for m in hf_types for d in dtypes]
    return cases


every_case = pytest.mark.parametrize(("kind", "family", "dtype"), _cases(("fp32", "bf16")))
fp32_cases = pytest.mark.parametrize(("kind", "family", "dtype"), _cases(("fp32",)))


@contextmanager
def _armed(
    subject: Subject, kind: str, family: str, dtype: str, *, negate: bool = False
) -> Iterator[tuple[ModelKind, torch.nn.Module, ReplayController, RouteProbe, Routing]]:
    """A fresh model of ``family``, the subject's controller on it, then the harness's probe."""
    model_kind = KINDS[kind]
    model = model_kind.build(family, dtype)
    if negate:
        model_kind.negate_routers(model)
    capability = require(subject, model_kind.capability)
    try:
        with controlled(capability, model, model_kind.capability) as controller:
            probe = model_kind.probe(model)
            try:
                yield model_kind, model, controller, probe, model_kind.routing(model)
            finally:
                probe.remove()
    except MissingMember as err:
        pytest.skip(str(err))


def _tokens(kind: ModelKind, seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, kind.vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _random_targets(routing: Routing, rows: int, seed: int) -> torch.Tensor:
    """Valid targets ``[rows, n_moe, k]``: distinct uniformly random ids per route."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * len(routing.moe_layers)
    ids = torch.argsort(torch.rand(n, routing.num_experts, generator=gen), dim=-1)[:, : routing.top_k]
    return ids.reshape(rows, len(routing.moe_layers), routing.top_k)


AXES = ("token", "MoE ordinal")


@every_case
@settings(max_examples=4)
@given(seed=st.integers(0, 2**31 - 1))
def test_experts_receive_the_targets_whatever_the_live_logits(
    subject: Subject, kind: str, family: str, dtype: str, seed: int
) -> None:
    """With the routers negated (live logits prefer other experts), every expert receives its targets."""
    note(f"counterexample: seed={seed}")
    with _armed(subject, kind, family, dtype, negate=True) as (k, model, ctl, probe, routing):
        targets = _random_targets(routing, BATCH * SEQ, seed)
        ctl.replay(targets)
        with torch.no_grad():
            k.run(model, _tokens(k, seed))
        seen = probe.last().ids
    assert_same_routes(
        seen, targets, names=("dispatched", "targets"), what=f"{kind} {family} {dtype}", axes=AXES
    )


@every_case
@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1))
def test_replaying_own_recording_is_bit_exact(
    subject: Subject, kind: str, family: str, dtype: str, seed: int
) -> None:
    """Replaying a model's own recording reproduces its logits, dispatched ids and gate weights bit-exact."""
    note(f"counterexample: seed={seed}")
    with _armed(subject, kind, family, dtype) as (k, model, ctl, probe, routing):
        tokens = _tokens(k, seed)
        with torch.no_grad():
            ctl.record()
            native_logits = k.run(model, tokens)
            native = probe.last()
            recording = ctl.recording()
            ctl.replay(recording)
            replayed_logits = k.run(model, tokens)
            replayed = probe.last()
    expected = (BATCH * SEQ, len(routing.moe_layers), routing.top_k)
    assert tuple(recording.shape) == expected, (
        f"{kind} {family}: recording {tuple(recording.shape)}, expected {expected}"
    )
    assert_same_routes(
        native.ids,
        recording,
        names=("dispatched natively", "the recording"),
        what=f"{kind} {family} {dtype}",
        axes=AXES,
    )
    assert_same_routes(
        replayed.ids,
        recording,
        names=("dispatched under replay", "the recording"),
        what=f"{kind} {family} {dtype}",
        axes=AXES,
    )
    order = native.ids.argsort(-1), replayed.ids.argsort(-1)
    w_native, w_replayed = native.weights.gather(-1, order[0]), replayed.weights.gather(-1, order[1])
    assert w_native.dtype == w_replayed.dtype, (
        f"{kind} {family} {dtype}: replayed gate weights are {w_replayed.dtype}, native {w_native.dtype}"
    )
    assert_close_logprobs(
        w_replayed,
        w_native,
        names=("replayed", "native"),
        what=f"{kind} {family} {dtype}: gate weights (ids in set order)",
        axes=(*AXES, "slot"),
    )
    assert_close_logprobs(
        replayed_logits,
        native_logits,
        names=("replayed", "native"),
        what=f"{kind} {family} {dtype}: logits",
        axes=("sample", "position", "vocab id"),
    )


@every_case
def test_router_gets_gradient_at_targets_live_top_k_would_not_pick(
    subject: Subject, kind: str, family: str, dtype: str
) -> None:
    """Gate weights come from the live logits at the targets, so the router gets gradients there (§3.7)."""
    with _armed(subject, kind, family, dtype) as (k, model, ctl, probe, routing):
        tokens = _tokens(k, 0)
        ctl.record()
        with torch.no_grad():
            k.run(model, tokens)
        natural = ctl.recording()
        unpicked = next(e for e in range(routing.num_experts) if e not in natural[0, 0].tolist())
        targets = natural.clone()
        targets[0, 0, -1] = unpicked  # token 0, first MoE layer: an expert its live top-k did not pick
        ctl.replay(targets)
        k.run(model, tokens).float().logsumexp(-1).sum().backward()
        seen = probe.last().ids
    assert unpicked in seen[0, 0].tolist(), (
        f"{kind} {family}: expert {unpicked} never received token 0 (dispatched {seen[0, 0].tolist()}, "
        f"targets {targets[0, 0].tolist()})"
    )
    grad = k.router_weights(model)[0].grad
    assert grad is not None, f"{kind} {family} {dtype}: the router weight received no gradient"
    assert grad[unpicked].abs().sum() > 0, (
        f"{kind} {family} {dtype}: the router row of replayed expert {unpicked} has gradient 0 everywhere "
        f"(token 0 targets {targets[0, 0].tolist()}, its live top-k {natural[0, 0].tolist()})"
    )


@pytest.mark.parametrize(
    ("kind", "family", "dtype"), _cases(("fp32",), hf_types=("qwen3_moe", "deepseek_v3"))
)
def test_recompute_replays_each_forwards_targets(
    subject: Subject, kind: str, family: str, dtype: str
) -> None:
    """Two forwards in flight, then backward: recompute dispatches the first forward's targets (FIFO).
    A controller that declares one forward in flight (``OneForwardInFlight``: its trainer runs each
    micro-batch's backward before the next forward) is checked with one."""
    with _armed(subject, kind, family, dtype) as (k, model, ctl, probe, routing):
        in_flight = 1 if isinstance(ctl, OneForwardInFlight) and ctl.forwards_in_flight == 1 else 2
        first, second = _tokens(k, 1), _tokens(k, 2)
        rows = BATCH * SEQ
        targets_first, targets_second = _random_targets(routing, rows, 1), _random_targets(routing, rows, 2)
        ctl.replay(targets_first)
        k.run(model, first).float().logsumexp(-1).sum().backward()
        ctl.disarm()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        probe.clear()

        ctl.replay(targets_first)
        loss_first = k.run(model, first, recompute=True).float().logsumexp(-1).sum()
        if in_flight == 2:
            ctl.replay(targets_second)
            k.run(model, second, recompute=True)
        ctl.prepare_backward()
        loss_first.backward()
        calls = probe.calls
    assert min(calls) >= in_flight + 1, (
        f"{kind} {family}: the probe saw {calls} calls per MoE layer, expected {in_flight + 1} "
        f"({in_flight} + recompute)"
    )
    assert_same_routes(
        probe.call(in_flight).ids,
        targets_first,
        names=("dispatched by the recompute", "the first forward's targets"),
        what=f"{kind} {family}",
        axes=AXES,
    )
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys(), (
        f"{kind} {family}: parameters with a gradient after recompute {sorted(got.keys() - expected.keys())} "
        f"extra, {sorted(expected.keys() - got.keys())} missing, vs the forward without recompute"
    )
    for name, grad in got.items():
        assert_close_logprobs(
            grad,
            expected[name],
            names=("with recompute", "without recompute"),
            what=f"{kind} {family}: gradient of {name} (recompute replayed other targets?)",
        )


@fp32_cases
def test_rows_without_a_target_route_natively(subject: Subject, kind: str, family: str, dtype: str) -> None:
    """Each sample's solo routes, left-padded like its tokens, reach the experts at its tokens; padding
    and each sample's last token (no row) route natively, never with the zero filler (§3.5–3.6)."""
    with _armed(subject, kind, family, dtype) as (k, model, ctl, probe, routing):
        lengths = (4, 7)
        samples = []
        with torch.no_grad():
            for i, n in enumerate(lengths):
                tokens = _tokens(k, 10 + i, batch=1, seq=n)
                ctl.record()
                k.run(model, tokens)
                samples.append((tokens[0], ctl.recording()[:-1]))  # rows [0, n − 1)
            placed = place_left_padded(samples, max(lengths) + 2)
            mask = placed.attention_mask.long()
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
            targets = placed.routes.reshape(-1, len(routing.moe_layers), routing.top_k)
            replayed = placed.replay_mask.reshape(-1)
            k.run(model, placed.tokens, attention_mask=mask, position_ids=position_ids)
            native = probe.last().ids
            ctl.replay(targets, replayed)
            k.run(model, placed.tokens, attention_mask=mask, position_ids=position_ids)
            seen = probe.last().ids
    assert_same_routes(
        seen,
        targets,
        names=("dispatched", "targets"),
        what=f"{kind} {family}: rows with a target",
        axes=("flat row", "MoE ordinal"),
        mask=replayed,
    )
    assert_same_routes(
        seen,
        native,
        names=("dispatched under replay", "native"),
        what=f"{kind} {family}: rows without a target (padding, last tokens)",
        axes=("flat row", "MoE ordinal"),
        mask=~replayed,
    )


@fp32_cases
def test_missing_targets_are_an_error_not_native_routing(
    subject: Subject, kind: str, family: str, dtype: str
) -> None:
    """Targets for fewer MoE layers than the model has raise instead of routing natively (§3.8)."""
    with _armed(subject, kind, family, dtype) as (k, model, ctl, _, routing):
        if len(routing.moe_layers) < 2:
            pytest.skip(f"{family}: one MoE layer, no layer can be missing")
        too_few = _random_targets(routing, BATCH * SEQ, 0)[:, :1, :]
        with pytest.raises(Exception) as info:
            ctl.replay(too_few)
            with torch.no_grad():
                k.run(model, _tokens(k, 0))
    assert not isinstance(info.value, AssertionError), (
        f"{kind} {family}: targets for 1 of {len(routing.moe_layers)} MoE layers failed an assertion "
        f"({info.value}), expected the subject's own error"
    )
