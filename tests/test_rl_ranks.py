"""``rrh run --ranks``'s plumbing without vLLM (``harness.run.ranks``): the CP/SP splits hold every
position of a sample exactly once (the broken ``sp-halo`` holds boundary rows twice), samples
cross ranks as JSON unchanged, and two real gloo ranks broadcast rank 0's samples and sum their
gradients. The real run with two ranks is ``conformance/test_tap_run.py`` (``tox -e vllm-cpu``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.audit.tap.engine import EngineSample, TapAttempt, TapError
from harness.run.ranks import (
    RankGroup,
    ranks_started,
    samples_from_json,
    samples_to_json,
    shard_mask,
    shard_positions,
)


@given(length=st.integers(1, 200), world=st.integers(1, 4), split=st.sampled_from(["cp", "sp"]))
def test_cp_and_sp_splits_hold_every_position_exactly_once(length: int, world: int, split: str) -> None:
    held = np.concatenate([shard_positions(split, length, r, world) for r in range(world)])
    assert np.array_equal(np.sort(held), np.arange(length))


def test_cp_is_the_zig_zag_and_the_halo_split_holds_each_boundary_twice() -> None:
    assert [shard_positions("cp", 12, r, 2).tolist() for r in range(2)] == [
        [0, 1, 2, 9, 10, 11],
        [3, 4, 5, 6, 7, 8],
    ]
    halo = np.concatenate([shard_positions("sp-halo", 12, r, 2) for r in range(2)])
    assert np.bincount(halo).tolist() == [1] * 6 + [2] + [1] * 5  # position 6: both ranks
    with pytest.raises(TapError, match="--split: expected one of"):
        shard_positions("ring", 12, 0, 2)


def test_shard_mask_marks_each_rows_positions_in_a_right_padded_batch() -> None:
    held = shard_mask("sp", [4, 2], 5, 1, 2)
    assert held.tolist() == [[False, False, True, True, False], [False, True, False, False, False]]


def test_samples_cross_ranks_as_json_unchanged() -> None:
    sample = EngineSample("s0-p0-g0", "s0-p0", 2)
    routes = np.arange(24, dtype=np.int64).reshape(3, 4, 2) % 16
    sample.attempts.append(TapAttempt("start", 0, (9, 10), (11, 12), (-1.5, -2.25), routes))
    sample.spliced = routes
    (back,) = samples_from_json(samples_to_json([sample]))
    assert (back.key, back.group_key, back.prompt_len) == ("s0-p0-g0", "s0-p0", 2)
    assert back.tokens == (9, 10, 11, 12)
    assert back.attempts[0].logprobs == (-1.5, -2.25) and back.attempts[0].kind == "start"
    assert back.spliced is not None and np.array_equal(back.spliced, routes)
    assert np.array_equal(back.attempts[0].routes, routes)


def _on_two_ranks(tmp_path: Path, body: Callable[[RankGroup], Any]) -> list[Any]:
    """``body`` on ranks 0 and 1 of a real gloo group (two threads), the results by rank."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = body(RankGroup(tmp_path / "rendezvous", r, 2))
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a gloo rank did not finish within 120 s"
    return results


@pytest.mark.distributed
def test_two_gloo_ranks_get_rank_0s_bytes_and_the_summed_gradients(tmp_path: Path) -> None:
    def body(group: RankGroup) -> tuple[bytes, list[float]]:
        got = group.broadcast_bytes(b"step 0 samples" if group.rank == 0 else None)
        model = torch.nn.Linear(2, 1, bias=True)
        model.weight.grad = torch.full((1, 2), float(group.rank + 1))  # the bias has no grad here
        group.sum_gradients(model)
        assert model.bias.grad is not None
        return got, model.weight.grad.reshape(-1).tolist() + model.bias.grad.tolist()

    assert _on_two_ranks(tmp_path, body) == [(b"step 0 samples", [3.0, 3.0, 0.0])] * 2


def test_a_run_with_no_rank_or_an_unknown_split_is_refused_naming_the_option() -> None:
    from harness.run.loop import RunConfig

    with pytest.raises(TapError, match="--ranks: expected a positive integer, got 0"):
        RunConfig(ranks=0)
    with pytest.raises(TapError, match=r"--split: expected one of \['cp', 'sp', 'sp-halo'\], got 'ring'"):
        RunConfig(split="ring")


def _rank_that_fails(rank: int, rendezvous: str) -> None:
    """A rank ≥ 1 that joins the group, then fails (a spawned process: module-level)."""
    RankGroup(Path(rendezvous), rank, 2)
    raise SystemExit(3)


@pytest.mark.distributed
def test_a_rank_that_fails_is_named_with_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(TapError, match=r"rank 1: exited with code 3; expected 0"):
        with ranks_started(2, tmp_path, _rank_that_fails) as group:
            assert group is not None and (group.rank, group.world) == (0, 2)
