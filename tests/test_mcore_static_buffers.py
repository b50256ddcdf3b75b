"""Megatron-core ≥ 0.17 ``RouterReplay`` static-buffer (CUDA-graph) mode, as released (FACTS §2, §6).

What ``MCORE_0_19_2_STATIC`` (``harness.subjects.frameworks.mcore``) relies on and what a consumer
of its recordings must know, observed on the installed release's own class (``tox -e
mcore-0.19.2``; skipped, naming the env, where megatron-core is older or absent): instances are
bound to buffer slices by list position, and a recording is a view that the next RECORD
overwrites, so it must be copied before the next forward. The default mode keeps each recording.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from packaging.version import Version

from harness.subjects.frameworks import installed_version

TOP_K = 2


@pytest.fixture
def router_replay() -> Iterator[Any]:
    """The installed release's ``router_replay`` module, its instance list empty before and after."""
    found = installed_version("megatron-core")
    if found is None or Version(found) < Version("0.17"):
        pytest.skip(
            f"megatron-core {found or 'not installed'}: static buffers are 0.17+ (tox -e mcore-0.19.2)"
        )
    from megatron.core.transformer.moe import router_replay as rr

    rr.RouterReplay.clear_global_router_replay_instances()
    yield rr
    rr.RouterReplay.clear_global_router_replay_instances()


def _record(rr: Any, routes: list[torch.Tensor]) -> None:
    """One RECORD forward: router ``i`` computes ``routes[i]`` (its top-k over live scores)."""
    rr.RouterReplay.set_global_router_replay_action(rr.RouterReplayAction.RECORD)
    for instance, ids in zip(rr.RouterReplay.global_router_replay_instances, routes, strict=True):
        scores = torch.zeros(ids.shape[0], 8).scatter(1, ids, 1.0)
        instance.get_replay_topk(scores, TOP_K, default_compute_topk=lambda s, k, *a, ids=ids, **kw: (s, ids))


def _routes(seed: int, routers: int, tokens: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.stack([torch.randperm(8, generator=gen)[:TOP_K] for _ in range(tokens)]) for _ in range(routers)
    ]


def test_instances_record_into_the_slice_at_their_list_position(router_replay: Any) -> None:
    rr = router_replay
    instances = [rr.RouterReplay() for _ in range(3)]
    buffer = torch.full((16, 3, TOP_K), -1, dtype=torch.long)
    rr.RouterReplay.set_global_static_buffers(buffer)
    first = _routes(0, 3, 5)
    _record(rr, first)
    for position, (instance, ids) in enumerate(zip(instances, first, strict=True)):
        assert torch.equal(buffer[:5, position], ids), f"router {position}: not in buffer[:, {position}]"
        assert instance.get_recorded_indices().data_ptr() == buffer[:, position].data_ptr()
    assert (buffer[5:] == -1).all(), "rows past the forward's tokens were written"
    with pytest.raises(AssertionError, match="layers"):
        rr.RouterReplay.set_global_static_buffers(torch.zeros(16, 2, TOP_K, dtype=torch.long))


@pytest.mark.parametrize("static", [False, True], ids=["default", "static-buffers"])
def test_a_recording_read_after_the_next_forward(router_replay: Any, static: bool) -> None:
    """Default mode: a recording keeps its forward's routes. Static buffers: the next RECORD
    overwrites it in place, so only a copy taken before that forward keeps them."""
    rr = router_replay
    for _ in range(2):
        rr.RouterReplay()
    if static:
        rr.RouterReplay.set_global_static_buffers(torch.zeros(16, 2, TOP_K, dtype=torch.long))
    first, second = _routes(1, 2, 6), _routes(2, 2, 6)
    _record(rr, first)
    views = rr.RouterReplay.get_recorded_data()
    copies = [v.clone() for v in views]
    _record(rr, second)
    assert all(torch.equal(c, f) for c, f in zip(copies, first, strict=True))
    held = second if static else first
    assert all(torch.equal(v, h) for v, h in zip(views, held, strict=True)), (
        "static buffers: the first recording should now hold the second forward's routes"
        if static
        else "default mode: a recording changed after the next forward"
    )
