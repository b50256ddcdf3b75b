"""Megatron-core ``RouterReplay`` under real parallel layouts (DESIGN §3.5–3.8, FACTS §2).

Each case spawns a world of ranks (``harness.testing.ranks.run_ranks``: gloo on CPU with the
test-support patches of ``harness.testing.megatron_cpu`` applied by its ``setup_rank`` hook, NCCL on
a GPU runner, unpatched), builds a tiny GPT MoE with
the subject driver's ``config_overrides()`` (``moe_enable_routing_replay=True``) and MoE activation
recompute, and runs ``suites.megatron_checks.run_checks`` on every rank against the
subject (``--rr-subject``): its ``install_megatron_replay`` driver switches the actions, its
``megatron_data`` feeds canonical traces to every router and merges the recordings back; the
harness's probe checks dispatched experts, placement (independent of the layout code), the FIFO and
bit-exact RECORD → REPLAY gradients. The reference subject is the harness's own backend;
``harness.subjects.megatron_core:MEGATRON_CORE`` is Megatron-core's ``RouterReplay`` alone.

Layouts (``RRH_MEGATRON_LAYOUT=name[,name…]`` selects; ``tox -e megatron-tp2ep2`` sets ``tp2ep2``):

- ``tp1ep1``: one rank, one sample per micro-batch, 512 experts (default run);
- ``tp2ep2etp1``: two ranks, sequence-parallel TP = 2 and EP = 2 over the same ranks (expert-TP 1)
  (default run);
- ``tp2ep2``: four ranks, TP = 2, EP = 2, DP = 2 (expert-TP 2): ``slow`` unless selected by name
  (~35 s of gloo on 2 cores).
- ``pp2thd``: two pipeline stages (PP = 2, one MoE layer each, activations and gradients exchanged
  over gloo), the micro-batch packed THD (two samples of 5 and 8 tokens, ``PackedSeqParams``: verl's
  default ``use_remove_padding=True`` input, SkyRL's packed path) (default run);
- ``pp2vpp2thd``: two pipeline stages of two virtual chunks each (rank 0 builds layers 0 (dense) and
  2, rank 1 layers 1 and 3: a rank's routers span chunks), the packed micro-batch (default run);
- ``pp2``: two pipeline stages, the padded ``[B, S]`` micro-batch: ``slow``;
- ``pp2vpp2``: ``pp2vpp2thd``'s chunks with the padded ``[B, S]`` micro-batch: ``slow``;
- ``thd-align4``: one rank, the packed micro-batch of two samples of 5 and 6 tokens each padded to
  a multiple of 4 (the alignment ``tp·cp·2`` gives at TP = 1, CP = 2): ``cu_seqlens_padded``
  ``[0, 8, 16]`` differs from ``cu_seqlens`` ``[0, 5, 11]``, so a data movement that packs at the
  unpadded offsets while the rows follow the padded ones is caught without TP > 1 (default run);
- ``thd-tp2ep2``: the packed micro-batch under TP = 2 (each sample padded to a multiple of 2: filler
  rows, a shard boundary inside a sample), EP = 2: ``slow``.

Gate-weight rules (``test_gate_weights_follow_every_router_rule``): on one rank with one sample per
micro-batch (the micro-batch layout is the layouts' question, not the rules'), a model per rule
megatron-core's ``TopKRouter`` offers (``harness.trainers.megatron.model.router_rules``: softmax after
or before top-k, sigmoid, each with and without the top-k scaling factor, group-limited routing, the
sigmoid expert bias, top-1), native and replayed; every router call's gate weights must follow the
rule. All eighteen run by default (one rank, ~0.2 s a rule).

MTP router (``test_mtp_router_routes_natively_under_replay``): on one rank, a model of two MoE decoder
layers and one multi-token-prediction layer (its router owns the third ``RouterReplay``); under replay
of canonical decoder targets the decoder routers dispatch them and the MTP router, which canonical
traces hold no rows for, routes natively by its own logits, never a decoder layer's targets (~2 s).

A packed layout needs a data movement whose ``set_replay_data`` / ``merge_recordings`` take
``packed_seq_params``; a subject without it skips, naming it. A layout the subject's driver declares
its release refuses at setup (``refusal``, e.g. SkyRL 0.4.0 with VPP) skips, naming the reason; so
does a packed layout whose alignment a release that packs by itself (``packing_align``: verl,
SkyRL) never builds at that TP.
"""

from __future__ import annotations

import inspect
import os

import pytest

from harness.subjects import Subject
from harness.subjects.capabilities import CapabilityView
from harness.testing.megatron_cpu import setup_rank
from harness.testing.ranks import run_ranks
from harness.testing.suite import require, subject_spec
from harness.trainers.megatron.layout import MegatronLayout
from harness.trainers.megatron.model import router_rules
from suites.megatron_checks import run_checks, run_router_checks
from suites.megatron_mtp import run_mtp_checks

TIMEOUT_S = 240

_COMMON = dict(num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2, seq_len=8, micro_batch=2)
LAYOUTS: dict[str, MegatronLayout] = {
    # One rank, one sample per micro-batch, 512 experts: half the ids are above 255, so a
    # recording cast to uint8 wraps (verl #7407), with no micro-batch layout question in the way.
    "tp1ep1": MegatronLayout(**{**_COMMON, "num_experts": 512, "micro_batch": 1}),
    "tp2ep2etp1": MegatronLayout(**_COMMON, tp=2, ep=2, etp=1, dp=1),
    "tp2ep2": MegatronLayout(**_COMMON, tp=2, ep=2, dp=2),
    # Stage 0 builds decoder layers 0–1 (router of layer 1), stage 1 layers 2–3 (router of layer 3):
    # one router per stage, so a stage fed the other stage's layer gets well-formed wrong targets.
    "pp2thd": MegatronLayout(**{**_COMMON, "num_layers": 4, "moe_layers": (1, 3)}, pp=2, lengths=(5, 8)),
    "pp2": MegatronLayout(**{**_COMMON, "num_layers": 4, "moe_layers": (1, 3)}, pp=2),
    "pp2vpp2": MegatronLayout(**{**_COMMON, "num_layers": 4, "moe_layers": (1, 2, 3)}, pp=2, vpp=2),
    # Virtual stages: rank 0 builds chunks {layer 0 (dense)} and {layer 2}, rank 1 {1} and {3}, so a
    # rank's routers are not contiguous layers, and one chunk has no router at all.
    "pp2vpp2thd": MegatronLayout(
        **{**_COMMON, "num_layers": 4, "moe_layers": (1, 2, 3)}, pp=2, vpp=2, lengths=(5, 8)
    ),
    "thd-tp2ep2": MegatronLayout(**_COMMON, tp=2, ep=2, etp=1, lengths=(5, 8)),
    # One rank, packed, each sample padded to a multiple of 4 with neither length a multiple: every
    # sample after the first starts at another row padded than unpadded (at TP = 1 and align 1
    # ``cu_seqlens`` equals ``cu_seqlens_padded`` and a data movement may confuse them unseen).
    "thd-align4": MegatronLayout(**_COMMON, lengths=(5, 6), align=4),
}
DEFAULT = ("tp1ep1", "tp2ep2etp1", "pp2thd", "pp2vpp2thd", "thd-align4")
ENV = "RRH_MEGATRON_LAYOUT"


def _selected() -> list[str]:
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(LAYOUTS))
    if unknown:
        raise pytest.UsageError(f"{ENV}: unknown layouts {unknown}; known: {sorted(LAYOUTS)}")
    return names


def _params() -> list[object]:
    chosen = _selected()
    names = chosen or list(LAYOUTS)
    return [
        pytest.param(
            name,
            id=name,
            marks=() if chosen or name in DEFAULT else (pytest.mark.slow,),
        )
        for name in names
    ]


def _require_packed(subject: Subject) -> None:
    """Skip, naming it, unless the subject's data movement takes a packed micro-batch."""
    data = subject.megatron_data
    for method in ("set_replay_data", "merge_recordings"):
        fn = getattr(data, method, None)
        if fn is not None and "packed_seq_params" not in inspect.signature(fn).parameters:
            pytest.skip(
                f"subject {subject.name!r}: megatron_data.{method} takes no 'packed_seq_params' "
                "(packed THD micro-batches not checked)"
            )


def _require_accepted(subject: Subject, layout: MegatronLayout) -> None:
    """Skip, naming the release's reason, a layout its driver declares it refuses at setup
    (``RefusesMegatronLayout``)."""
    driver = subject.install_megatron_replay
    target = driver.target if isinstance(driver, CapabilityView) else driver
    refusal = getattr(target, "refusal", None)
    reason = refusal(layout) if callable(refusal) else None
    if reason:
        pytest.skip(f"subject {subject.name!r} refuses this layout at setup: {reason}")


# One sample per micro-batch: the padded [S, B] order the router reads and a packed, sample-major
# order coincide, so a release whose data movement always packs (verl, SkyRL: their
# preprocess_thd_engine) is judged on the gate-weight rules alone, not again on the micro-batch
# layout that ``test_router_replay_follows_canonical_targets`` already judges. 16 positions, 8 experts.
ROUTER_LAYOUT = MegatronLayout(**{**_COMMON, "num_experts": 8, "micro_batch": 1, "seq_len": 16})


def router_worker(rank: int, world_size: int, subject: str, seed: int) -> dict[str, object]:
    return run_router_checks(ROUTER_LAYOUT, router_rules(), seed=seed, subject=subject)


@pytest.mark.capability("install_megatron_replay", "megatron_data")
@pytest.mark.megatron
@pytest.mark.distributed
def test_gate_weights_follow_every_router_rule(subject: Subject, request: pytest.FixtureRequest) -> None:
    """Under each of megatron-core's gate-weight rules, natively and under replay (recompute included),
    every router weights the experts it routed each token to by that rule, from its own logits, and
    the replayed experts are the targets: replay moves ids, never the rule."""
    require(subject, "install_megatron_replay")
    require(subject, "megatron_data")
    run = run_ranks(
        router_worker, 1, args=(subject_spec(request.config), 0), setup=setup_rank, timeout=TIMEOUT_S
    )
    assert run.results[0]["rules"] == list(router_rules()), f"rules checked: {run.results[0]['rules']}"


def _require_alignment(subject: Subject, layout: MegatronLayout) -> None:
    """Skip, naming both, a packed layout padded to an alignment the subject's release never packs
    to at this TP (``PacksAtOwnAlignment``): its own packing would put the rows elsewhere."""
    data = subject.megatron_data
    target = data.target if isinstance(data, CapabilityView) else data
    own = getattr(target, "packing_align", None)
    if callable(own) and own(layout.tp) != layout.packing_align:
        pytest.skip(
            f"subject {subject.name!r} packs each sample to a multiple of {own(layout.tp)} at TP = "
            f"{layout.tp} (its own preprocess_packed_seqs); this layout pads to {layout.packing_align}"
        )


def megatron_worker(
    rank: int, world_size: int, layout: MegatronLayout, subject: str, seed: int
) -> dict[str, object]:
    """One rank's checks (``setup_rank`` has patched megatron-core for this process)."""
    return run_checks(layout, seed=seed, subject=subject)


def _run(layout: MegatronLayout, subject_spec: str, seed: int) -> list[dict[str, object]]:
    run = run_ranks(
        megatron_worker,
        layout.world_size,
        args=(layout, subject_spec, seed),
        setup=setup_rank,
        timeout=TIMEOUT_S,
    )
    return run.results


@pytest.mark.capability("install_megatron_replay", "megatron_data")
@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize("name", _params())
def test_router_replay_follows_canonical_targets(
    subject: Subject, request: pytest.FixtureRequest, name: str
) -> None:
    """Every router on every rank replays exactly its canonical targets; RECORD → REPLAY is bit-exact."""
    require(subject, "install_megatron_replay")
    require(subject, "megatron_data")
    layout = LAYOUTS[name]
    _require_accepted(subject, layout)
    if layout.packed:
        _require_packed(subject)
        _require_alignment(subject, layout)
    reports = _run(layout, subject_spec(request.config), seed=0)
    assert len(reports) == layout.world_size, (
        f"{name}: {len(reports)} rank reports, expected {layout.world_size}"
    )
    coords = {tuple(r["coords"][axis] for axis in ("dp", "tp", "pp", "ep")) for r in reports}  # type: ignore[index]
    assert len(coords) == layout.world_size, (
        f"{name}: {len(coords)} distinct (dp, tp, pp, ep) coordinates {sorted(coords)}, "
        f"expected {layout.world_size}"
    )
    for report in reports:
        rank = f"{name} rank {report['coords']}"
        stage = layout.rank_moe_layers(report["coords"]["pp"])  # type: ignore[index]
        assert report["routers"] == len(stage), (
            f"{rank}: {report['routers']} routers replayed, expected {len(stage)} "
            "(one per MoE layer of its pipeline stage's chunks)"
        )
        assert report["local_tokens"] == layout.local_tokens, (
            f"{rank}: {report['local_tokens']} local tokens, expected {layout.local_tokens}"
        )
        assert report["foreign_loss"] != report["live_loss"], (
            f"{rank}: the loss replaying foreign targets ({report['foreign_loss']}) equals the live loss "
            f"({report['live_loss']}): the foreign targets changed nothing, no test"
        )
        if report["r2"] and report["r2_bit_exact"]:
            assert report["max_grad_diff_record_replay"] == 0.0, (
                f"{rank}: gradients under R2 replay differ from the recording pass's by up to "
                f"{report['max_grad_diff_record_replay']}, expected 0 (bit-exact)"
            )
    if not reports[0]["r2"]:  # the R3 checks passed; say that the R2 half was not checked
        pytest.skip(
            f"R3 checks passed; R2 not checked: subject {subject.name!r}: megatron_data has no member "
            "'merge_recordings'"
        )


# Two MoE decoder layers (layer_number 1 and 2) and one MTP layer (its MultiTokenPredictionLayer's
# layer_number is 1 again): a replay keyed by that bare number hands it decoder layer 0's targets. One
# sample of 16 tokens per micro-batch, so that no micro-batch layout question (sample- or
# sequence-major, the tp2ep2etp1 finding on verl) is in the way of the MTP one.
MTP_LAYOUT = MegatronLayout(
    **{**_COMMON, "num_layers": 2, "moe_layers": (0, 1), "seq_len": 16, "micro_batch": 1}
)


def mtp_worker(rank: int, world_size: int, subject: str, seed: int) -> dict[str, object]:
    return run_mtp_checks(MTP_LAYOUT, seed=seed, subject=subject)


@pytest.mark.capability("install_megatron_replay", "megatron_data")
@pytest.mark.megatron
@pytest.mark.distributed
def test_mtp_router_routes_natively_under_replay(subject: Subject, request: pytest.FixtureRequest) -> None:
    """Under replay of canonical decoder targets every decoder router dispatches its targets and the
    MTP router gets none of them: it routes natively, forward and recompute (FACTS §4 "MTP routers")."""
    require(subject, "install_megatron_replay")
    require(subject, "megatron_data")
    run = run_ranks(
        mtp_worker, 1, args=(subject_spec(request.config), 0), setup=setup_rank, timeout=TIMEOUT_S
    )
    report = run.results[0]
    assert report["decoder_routers"] == len(MTP_LAYOUT.moe_layers) and report["mtp_routers"] == 1, report
    assert report["mtp_calls"] == 2, (
        f"MTP router calls (forward + recompute): {report['mtp_calls']}, expected 2"
    )
