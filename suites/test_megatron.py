"""Megatron-core ``RouterReplay`` under real parallel layouts (DESIGN §3.5–3.8, FACTS §2).

Each case spawns a world of ranks (gloo on CPU with the test-support patches of
``harness.testing.megatron_cpu``, NCCL on a GPU runner, unpatched), builds a tiny GPT MoE with
``moe_enable_routing_replay=True`` and MoE activation recompute, and runs
``harness.trainers.megatron.checks.run_checks`` on every rank: canonical traces fed through the
layout into ``RouterReplay.set_replay_data``; dispatched experts, placement (independent of the
layout code), instances, FIFO and bit-exact RECORD → REPLAY gradients checked.

Layouts (``RRH_MEGATRON_LAYOUT=name[,name…]`` selects; ``tox -e megatron-tp2ep2`` sets ``tp2ep2``):

- ``tp1ep1``: one rank (default run);
- ``tp2ep2etp1``: two ranks, sequence-parallel TP = 2 and EP = 2 over the same ranks (expert-TP 1)
  (default run);
- ``tp2ep2``: four ranks, TP = 2, EP = 2, DP = 2 (expert-TP 2): ``slow`` unless selected by name
  (~35 s of gloo on 2 cores).
"""

from __future__ import annotations

import os

import pytest

from harness.trainers.megatron.layout import MegatronLayout

TIMEOUT_S = 240

_COMMON = dict(num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2, seq_len=8, micro_batch=2)
LAYOUTS: dict[str, MegatronLayout] = {
    "tp1ep1": MegatronLayout(**_COMMON),
    "tp2ep2etp1": MegatronLayout(**_COMMON, tp=2, ep=2, etp=1, dp=1),
    "tp2ep2": MegatronLayout(**_COMMON, tp=2, ep=2, dp=2),
}
DEFAULT = ("tp1ep1", "tp2ep2etp1")
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


def _run(layout: MegatronLayout, **kwargs: object) -> list[dict[str, object]]:
    from harness.testing.megatron_cpu import spawn_ranks

    return spawn_ranks(
        "harness.trainers.megatron.checks:run_checks",
        layout.world_size,
        timeout=TIMEOUT_S,
        layout=layout,
        **kwargs,
    )


@pytest.mark.megatron
@pytest.mark.distributed
@pytest.mark.parametrize("name", _params())
def test_router_replay_follows_canonical_targets(name: str) -> None:
    """Every router on every rank replays exactly its canonical targets; RECORD → REPLAY is bit-exact."""
    layout = LAYOUTS[name]
    reports = _run(layout, seed=0)
    assert len(reports) == layout.world_size
    coords = {(r["coords"].dp, r["coords"].tp, r["coords"].ep) for r in reports}  # type: ignore[attr-defined]
    assert len(coords) == layout.world_size, coords
    for report in reports:
        assert report["routers"] == len(layout.moe_layers)
        assert report["local_tokens"] == layout.local_tokens
        assert report["max_grad_diff_record_replay"] == 0.0
        assert report["foreign_loss"] != report["live_loss"]


@pytest.mark.megatron
@pytest.mark.distributed
def test_checks_catch_broken_replay() -> None:
    """The checks have power: each deliberately broken step is reported (one rank, one spawn)."""
    from harness.testing.megatron_cpu import spawn_ranks
    from harness.trainers.megatron.checks import MUTANTS

    (caught,) = spawn_ranks(
        "harness.trainers.megatron.checks:run_mutants", 1, timeout=TIMEOUT_S, layout=LAYOUTS["tp1ep1"], seed=0
    )
    assert set(caught) == set(MUTANTS)
    missed = [m for m, err in caught.items() if err is None]
    assert not missed, f"mutants not caught: {missed}"
    assert "canonical route" in caught["layer_shift"] or "identity" in caught["layer_shift"]
    assert "FIFO" in caught["forward_in_backward"]
