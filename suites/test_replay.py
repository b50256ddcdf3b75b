"""Replay effect (DESIGN §3.6–3.8), one suite over (model kind × router family), observed by the harness.

The subject supplies the driver of each model kind (``install_replay`` for the reference ``MoELM``,
``install_hf_replay`` for transformers MoE models, ``install_megatron_replay`` with ``megatron_data``
for a Megatron-core ``GPTModel`` on one rank, ``harness.testing.megatron_kind``); the harness runs
the driver's ``patch()``, then
builds the model (a driver that patches a router constructor needs models built after it), installs
the driver, and attaches its *own* route probe (``harness.probes``) at the dispatch step, after the
subject's hooks. Every check compares what the subject was asked to do with what the probe saw the
experts receive; nothing the subject reports about itself (``dispatched()``) is used.

- the experts receive exactly the targets, whatever the live logits prefer (no silent fallback: every
  live router is replayed), in a bf16 model with more than 256 experts too;
- a recording is the model's native routing (what a native forward dispatches on the same tokens);
- replaying a model's own recording reproduces its logits and gate weights bit for bit (fp32, bf16);
- the router gets gradients at targets its live top-k would not pick;
- activation recompute replays each forward's own targets (two forwards in flight);
- a model with more than ten decoder layers gets each layer's targets (name order is not layer order);
- an MTP block's router routes natively under replay (the targets carry no MTP rows);
- two controlled models alive at once (actor and reference) each route by their own controller;
- a disarmed model routes natively again, after replay and after a recording;
- a model part built before the driver's ``patch()`` is replayed or refused, never left native;
- rows without a target (left padding, last tokens) route natively, never with the filler;
- targets for the wrong number of MoE layers are an error, not native routing.

The Megatron kind (fp32; Megatron-core's softmax and sigmoid score functions) skips, naming why, two
cases Megatron-core's ``RouterReplay`` cannot be asked: two controlled models in one process (its
actions are class-level, process-global) and rows without a target (it has no per-token mask; its
data movement refuses a padded micro-batch instead, ``suites/test_megatron.py``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st

from harness.probes import RouteProbe
from harness.subjects import Subject, load_subject
from harness.subjects.capabilities import MissingMember, OneForwardInFlight, ReplayController, as_driver
from harness.subjects.replay import controlled, patches, prepare, unpatched
from harness.testing.asserts import assert_close_logprobs, assert_same_routes
from harness.testing.megatron_kind import FAST_FAMILIES as MEGATRON_FAST_FAMILIES
from harness.testing.megatron_kind import MegatronKindDriver, megatron_kind, megatron_session, megatron_world
from harness.testing.ranks import run_ranks
from harness.testing.suite import require, subject_spec
from harness.trainers.hf.models import MODEL_TYPES
from harness.trainers.kinds import ModelKind, Routing, hf_kind, reference_kind
from reference_impl import ROUTER_FAMILIES
from reference_impl.layouts import place_left_padded

BATCH, SEQ = 2, 6
KINDS = {"reference": reference_kind(), "hf": hf_kind(), "megatron": megatron_kind()}
MEGATRON_MARKS = [
    pytest.mark.megatron,
    pytest.mark.capability("install_megatron_replay"),
    pytest.mark.capability("megatron_data"),
]


def _cases(dtypes: tuple[str, ...], hf_types: tuple[str, ...] = tuple(MODEL_TYPES)) -> list[object]:
    on_reference = pytest.mark.capability(KINDS["reference"].capability)
    on_hf = [pytest.mark.hf, pytest.mark.capability(KINDS["hf"].capability)]
    cases = [
        pytest.param("reference", f, d, id=f"reference-{f}-{d}", marks=on_reference)
        for f in ROUTER_FAMILIES
        for d in dtypes
    ]
    cases += [pytest.param("hf", m, d, id=f"hf-{m}-{d}", marks=on_hf) for m in hf_types for d in dtypes]
    cases += [
        pytest.param(
            "megatron",
            f,
            "fp32",
            id=f"megatron-{f}-fp32",
            marks=MEGATRON_MARKS + ([] if f in MEGATRON_FAST_FAMILIES else [pytest.mark.slow]),
        )
        for f in KINDS["megatron"].families
    ]
    return cases


every_case = pytest.mark.parametrize(("kind", "family", "dtype"), _cases(("fp32", "bf16")))
fp32_cases = pytest.mark.parametrize(("kind", "family", "dtype"), _cases(("fp32",)))


@contextmanager
def _armed(
    subject: Subject,
    kind: str,
    family: str,
    dtype: str,
    *,
    negate: bool = False,
    deep: bool = False,
    wide: bool = False,
    mtp: bool = False,
    model: torch.nn.Module | None = None,
) -> Iterator[tuple[ModelKind, torch.nn.Module, ReplayController, RouteProbe, Routing]]:
    """The subject's driver patched, then a model of ``family`` built (or ``model``), the subject's
    controller on it, then the harness's probe. A driver that may patch gets a model constructed after
    its patch, never a copy of one built before."""
    model_kind = KINDS[kind]
    capability = _capability(subject, kind)
    session = megatron_session() if kind == "megatron" else contextlib.nullcontext()
    try:
        session.__enter__()
        driver = prepare(capability, model_kind.capability)
        if model is None:
            model = model_kind.build(
                family,
                dtype,
                fresh=patches(driver),
                deep=deep,
                **({"wide": True} if wide else {}),
                **({"mtp": True} if mtp else {}),
                **_overrides(kind, driver),
            )
        if negate:
            model_kind.negate_routers(model)
        with controlled(driver, model, model_kind.capability) as controller:
            probe = model_kind.probe(model)
            try:
                yield model_kind, model, controller, probe, model_kind.routing(model)
            finally:
                probe.remove()
    except MissingMember as err:
        pytest.skip(str(err))
    finally:
        session.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _one_megatron_world(request: pytest.FixtureRequest) -> Iterator[None]:
    """A Megatron-kind test's examples share one one-rank world (``megatron_world``): a failing
    example hypothesis keeps holds no process group of its own."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("kind") != "megatron":
        yield
        return
    with megatron_world():
        yield


def _overrides(kind: str, driver: object) -> dict[str, object]:
    """The Megatron kind builds its model with the subject driver's ``config_overrides()``."""
    if kind != "megatron":
        return {}
    return {"overrides": dict(driver.config_overrides())}  # type: ignore[attr-defined]


def _capability(subject: Subject, kind: str) -> object:
    """The subject's driver of ``kind``: for Megatron its action switch and data movement as one."""
    capability = require(subject, KINDS[kind].capability)
    if kind == "megatron":
        return MegatronKindDriver(capability, require(subject, "megatron_data"))
    return capability


def _not_megatron(kind: str, why: str) -> None:
    if kind == "megatron":
        pytest.skip(f"Megatron-core RouterReplay: {why}")


def _tokens(kind: ModelKind, seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(3, kind.vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _random_targets(routing: Routing, rows: int, seed: int) -> torch.Tensor:
    """Valid targets ``[rows, n_moe, k]``: distinct uniformly random ids per route."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * len(routing.moe_layers)
    ids = torch.argsort(torch.rand(n, routing.num_experts, generator=gen), dim=-1)[:, : routing.top_k]
    return ids.reshape(rows, len(routing.moe_layers), routing.top_k)


AXES = ("token", "MoE ordinal")
SEED_PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
"""The phases of a test that draws only a seed: no shrinking. A smaller seed is no simpler a
counterexample, and each shrink step rebuilds a model (a Megatron-kind step a world and a GPT): a
failure reports the first failing seed, in seconds, instead of shrinking it for minutes."""


def _check_experts_receive_targets(
    subject: Subject,
    kind: str,
    family: str,
    dtype: str,
    seed: int,
    *,
    deep: bool = False,
    wide: bool = False,
) -> None:
    note(f"counterexample: seed={seed}")
    armed = _armed(subject, kind, family, dtype, negate=True, deep=deep, wide=wide)
    with armed as (k, model, ctl, probe, routing):
        targets = _random_targets(routing, BATCH * SEQ, seed)
        ctl.replay(targets)
        with torch.no_grad():
            k.run(model, _tokens(k, seed))
        seen = probe.last().ids
    what = f"{kind} {family} {dtype}" + (f", {len(routing.moe_layers)} MoE layers" if deep else "")
    what += f", {routing.num_experts} experts" if wide else ""
    assert_same_routes(seen, targets, names=("dispatched", "targets"), what=what, axes=AXES)


@every_case
@settings(max_examples=4, phases=SEED_PHASES)
@given(seed=st.integers(0, 2**31 - 1))
def test_experts_receive_the_targets_whatever_the_live_logits(
    subject: Subject, kind: str, family: str, dtype: str, seed: int
) -> None:
    """With the routers negated (live logits prefer other experts), every expert receives its targets."""
    _check_experts_receive_targets(subject, kind, family, dtype, seed)


ONE_FAMILY = {"reference": "softmax_topk", "hf": "qwen2_moe", "megatron": "softmax"}
"""The family each model kind's cross-cutting cases (deep model, two models, disarm) are built with."""


def _one_family_per_kind(*variants: str) -> list[object]:
    cases = []
    for kind, family in ONE_FAMILY.items():
        marks = (
            MEGATRON_MARKS
            if kind == "megatron"
            else [pytest.mark.capability(KINDS[kind].capability)] + ([pytest.mark.hf] if kind == "hf" else [])
        )
        for variant in variants or ("",):
            cases.append(
                pytest.param(
                    kind,
                    family,
                    *((variant,) if variant else ()),
                    id="-".join(filter(None, (kind, variant))),
                    marks=marks,
                )
            )
    return cases


@pytest.mark.parametrize(("kind", "family"), _one_family_per_kind())
@settings(max_examples=2, phases=SEED_PHASES)
@given(seed=st.integers(0, 2**31 - 1))
def test_experts_receive_the_targets_in_a_deep_model(
    subject: Subject, kind: str, family: str, seed: int
) -> None:
    """More than ten decoder layers (``layers.10`` sorts before ``layers.2`` as a string): each layer's
    experts still receive that layer's targets."""
    _check_experts_receive_targets(subject, kind, family, "fp32", seed, deep=True)


WIDE_FAMILY = {"reference": "softmax_topk", "hf": "qwen3_moe"}
"""The family each model kind's wide case is built with (a transformers type with one expert-count field)."""
WIDE_CASES = [
    pytest.param(c.values[0], WIDE_FAMILY[c.values[0]], id=c.id, marks=c.marks)  # type: ignore[attr-defined]
    for c in _one_family_per_kind()
    if c.values[0] in WIDE_FAMILY  # type: ignore[attr-defined]
]


@pytest.mark.parametrize(("kind", "family"), WIDE_CASES)
@settings(max_examples=2, phases=SEED_PHASES)
@given(seed=st.integers(0, 2**31 - 1))
def test_experts_receive_the_targets_in_a_wide_bf16_model(
    subject: Subject, kind: str, family: str, seed: int
) -> None:
    """A bf16 model with more than 256 experts (Kimi K2 384, Qwen3-Next 512): every id reaches its
    experts. bf16 holds every integer only up to 256, so a driver that moves its targets with the
    logits' dtype (``ids.to(router_logits)``) rounds ids above 256 onto other experts. The Megatron
    kind is built in fp32 and has no such case."""
    _check_experts_receive_targets(subject, kind, family, "bf16", seed, wide=True)


@pytest.mark.parametrize(
    ("kind", "family"),
    [pytest.param("reference", f, id=f"reference-{f}", marks=pytest.mark.capability("install_replay"))
     for f in ("softmax_topk", "sigmoid_grouped")],
)  # fmt: skip
def test_mtp_routers_route_natively_under_replay(subject: Subject, kind: str, family: str) -> None:
    """A model with a multi-token-prediction block (DeepSeek-V3, GLM-4.5) after its decoder: under replay
    the decoder's experts receive the targets, and the MTP block's router, for which the targets carry
    no rows, chooses natively from its own live logits. Megatron-core numbers MTP layers 1-based, as it
    numbers decoder layers: a driver keying routers by that bare ``layer_number`` gives the MTP router a
    decoder layer's routes (NeMo-RL #3903, #4057; verl #7340 review). A driver that counts the MTP router
    among the layers and so refuses targets without its rows fails loudly, which is correct."""
    with _armed(subject, kind, family, "fp32", negate=True, mtp=True) as (k, model, ctl, probe, routing):
        block = model.mtp[0].mlp  # the harness's own model: it knows where its MTP block is
        live: list[torch.Tensor] = []
        hook = block.router.register_forward_hook(lambda _m, _a, out: live.append(out[2].detach()))
        targets = _random_targets(routing, BATCH * SEQ, 3)
        try:
            ctl.replay(targets)
            with torch.no_grad():
                k.run(model, _tokens(k, 3))
        except Exception as err:  # a driver that counts the MTP router as a layer refuses, loudly: correct
            print(f"refused: {type(err).__name__}: {err}")
            return
        finally:
            hook.remove()
        dispatched, mtp_dispatched = probe.last().ids, block.last_dispatch
    what = f"{kind} {family} with an MTP block"
    assert_same_routes(dispatched, targets, names=("dispatched", "targets"), what=what, axes=AXES)
    native = type(block.router.family).select(block.router.family, live[-1])
    assert_same_routes(
        mtp_dispatched[:, None],
        native[:, None],
        names=("the MTP block dispatched", "its native choice"),
        what=f"{what}: the MTP router under replay (its layer number is {block.router.layer})",
        axes=AXES,
    )


def _native(
    k: ModelKind, model: torch.nn.Module, probe: RouteProbe, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dispatched ids, logits) of one forward of ``model`` on ``tokens``."""
    with torch.no_grad():
        logits = k.run(model, tokens)
    return probe.last().ids, logits


def _assert_native(
    k: ModelKind,
    model: torch.nn.Module,
    probe: RouteProbe,
    tokens: torch.Tensor,
    native: tuple[torch.Tensor, torch.Tensor],
    what: str,
) -> None:
    ids, logits = _native(k, model, probe, tokens)
    assert_same_routes(ids, native[0], names=("dispatched", "a native forward"), what=what, axes=AXES)
    assert_close_logprobs(
        logits,
        native[1],
        names=("got", "a native forward"),
        what=f"{what}: logits",
        axes=("sample", "position", "vocab id"),
    )


@pytest.mark.parametrize(("kind", "family", "order"), _one_family_per_kind("replayed-first", "replayed-last"))
def test_two_controlled_models_replay_independently(
    subject: Subject, kind: str, family: str, order: str
) -> None:
    """An actor and a reference model alive in one process, both controlled (installed in either order):
    replaying on one dispatches its targets there and leaves the other routing natively (a driver whose
    state is process-global must not let the last installed model win)."""
    _not_megatron(kind, "actions are class-level (process-global): one controlled model per process")
    first = order == "replayed-first"
    with _armed(subject, kind, family, "fp32") as (k, one, ctl_one, probe_one, routing):
        with _armed(subject, kind, family, "fp32") as (_, two, ctl_two, probe_two, _):
            replayed, other = (one, two) if first else (two, one)
            ctl, (probe, probe_other) = (
                (ctl_one, (probe_one, probe_two)) if first else (ctl_two, (probe_two, probe_one))
            )
            tokens = _tokens(k, 5)
            native = _native(k, other, probe_other, tokens)
            targets = _random_targets(routing, BATCH * SEQ, 5)
            ctl.replay(targets)
            with torch.no_grad():
                k.run(replayed, tokens)
            seen = probe.last().ids
            _assert_native(
                k, other, probe_other, tokens, native, f"{kind} {family}: the model not replayed ({order})"
            )
    assert_same_routes(
        seen,
        targets,
        names=("dispatched", "targets"),
        what=f"{kind} {family}: the replayed model ({order})",
        axes=AXES,
    )


@pytest.mark.parametrize(("kind", "family"), _one_family_per_kind())
def test_a_disarmed_model_routes_natively(subject: Subject, kind: str, family: str) -> None:
    """Replay → forward → ``disarm()`` → forward routes like a native forward (ids and logits), and so
    does a forward after ``recording()``: no stale targets reach a later reference, evaluation or
    colocated-prefill forward."""
    with _armed(subject, kind, family, "fp32") as (k, model, ctl, probe, routing):
        tokens = _tokens(k, 7)
        native = _native(k, model, probe, tokens)
        ctl.replay(_random_targets(routing, BATCH * SEQ, 7))
        _native(k, model, probe, tokens)
        ctl.disarm()
        _assert_native(
            k, model, probe, tokens, native, f"{kind} {family}: a forward after replay and disarm()"
        )
        ctl.record()
        _native(k, model, probe, tokens)
        ctl.recording()
        _assert_native(k, model, probe, tokens, native, f"{kind} {family}: a forward after recording()")


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    return inner.layers  # type: ignore[return-value]


@pytest.mark.parametrize(("kind", "family"), _one_family_per_kind())
def test_a_part_built_before_the_patch_is_replayed_or_refused(
    subject: Subject, request: pytest.FixtureRequest, kind: str, family: str
) -> None:
    """A model part built before the driver's ``patch()`` (an MTP head, a critic; here the last decoder
    layer, built before the patch and copied in) is replayed like the rest or refused loudly (an
    exception) — never left routing natively while the other layers replay (DESIGN §3.8).

    "Before the patch" holds whatever ran earlier in the process: a driver an earlier test patched is
    undone for the build (``unpatched``), and one that cannot be undone gets a fresh process (a rank
    of the fork server, which no driver ever patched), so the verdict does not depend on test order.
    """
    _not_megatron(kind, "a decoder layer copied between GPT models keeps the other model's RouterReplay")
    k = KINDS[kind]
    driver = as_driver(require(subject, k.capability), k.capability)
    with unpatched(driver) as clean:
        early = copy.deepcopy(_decoder_layers(k.build(family, "fp32", fresh=True))[-1]) if clean else None
    if early is not None:
        _part_built_before_the_patch(subject, kind, family, early)
        return
    run = run_ranks(
        part_built_before_the_patch_worker,
        1,
        args=(subject_spec(request.config), kind, family),
        timeout=RANK_TIMEOUT_S,
    )
    if run.results[0]:
        pytest.skip(run.results[0])


RANK_TIMEOUT_S = 120


def part_built_before_the_patch_worker(rank: int, world_size: int, spec: str, kind: str, family: str) -> str:
    """The check in a fresh process (no driver has patched it): ``""``, or why it skips."""
    subject = load_subject(spec)
    try:
        early = copy.deepcopy(_decoder_layers(KINDS[kind].build(family, "fp32", fresh=True))[-1])
        _part_built_before_the_patch(subject, kind, family, early)
    except pytest.skip.Exception as skipped:
        return str(skipped.msg)
    return ""


def _part_built_before_the_patch(subject: Subject, kind: str, family: str, early: torch.nn.Module) -> None:
    """``early`` (built before the driver's patch) as the last decoder layer of a model built after
    it: replayed like the rest, or refused loudly."""
    k = KINDS[kind]
    driver = prepare(require(subject, k.capability), k.capability)
    model = k.build(family, "fp32", fresh=patches(driver))
    _decoder_layers(model)[-1] = early
    k.negate_routers(model)
    try:
        with _armed(subject, kind, family, "fp32", model=model) as (_, _, ctl, probe, routing):
            targets = _random_targets(routing, BATCH * SEQ, 3)
            ctl.replay(targets)
            with torch.no_grad():
                k.run(model, _tokens(k, 3))
            seen = probe.last().ids
    except AssertionError:
        raise
    except Exception:  # refused loudly: the invariant holds
        return
    assert_same_routes(
        seen,
        targets,
        names=("dispatched", "targets"),
        what=f"{kind} {family}: the last decoder layer built before patch()",
        axes=AXES,
    )


@fp32_cases
def test_a_recording_is_the_models_native_routing(
    subject: Subject, kind: str, family: str, dtype: str
) -> None:
    """What ``record()`` keeps, and what the experts receive while recording, is the routing a native
    forward of the same model dispatches on the same tokens. A RECORD branch that re-implements the
    choice (a top-k without the group limit of a DeepSeek-V3 router) records a routing the model never
    takes, and R2 then faithfully replays it: every "replay equals recording" check still holds."""
    with _armed(subject, kind, family, dtype) as (k, model, ctl, probe, _):
        tokens = _tokens(k, 11)
        native, _ = _native(k, model, probe, tokens)
        ctl.record()
        while_recording, _ = _native(k, model, probe, tokens)
        recording = ctl.recording()
    what = f"{kind} {family} {dtype}"
    assert_same_routes(
        while_recording,
        native,
        names=("dispatched while recording", "a native forward"),
        what=what,
        axes=AXES,
    )
    assert_same_routes(recording, native, names=("recording()", "a native forward"), what=what, axes=AXES)


@every_case
@settings(max_examples=3, phases=SEED_PHASES)
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
    _not_megatron(kind, "no per-token replay mask (a padded micro-batch is refused: test_megatron.py)")
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
