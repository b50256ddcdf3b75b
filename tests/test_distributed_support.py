"""harness.testing.ranks: spawned ranks, fresh rendezvous, setup hook, hard timeout, dead-rank
detection; and the parallel mutants, each killed by suites/test_distributed.py on real process groups."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from harness.check.suites import run_suites, suites_dir
from harness.testing.ranks import RankFailure, default_backend, run_ranks
from reference_impl.distributed import ParallelSpec, TopologyError

pytestmark = pytest.mark.distributed


# --------------------------------------------------------------------------------------------------
# Rank bodies (module level: spawned ranks import them)
# --------------------------------------------------------------------------------------------------


def sum_of_ranks(rank: int, world_size: int, scale: float) -> dict[str, object]:
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return {"rank": rank, "world": world_size, "sum": x * scale, "ids": torch.arange(3, dtype=torch.int16)}


def record_setup(rank: int, world_size: int) -> None:
    """A setup hook: leaves a mark that ``fn`` reads, proving it ran in this rank, inside the group."""
    os.environ["RRH_TEST_SETUP"] = f"rank {rank} of {world_size}, group up: {dist.is_initialized()}"


def read_setup(rank: int, world_size: int) -> str:
    return os.environ.get("RRH_TEST_SETUP", "no setup ran")


def setup_fails_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        raise RuntimeError("setup refused rank 0")
    dist.barrier()  # rank 1 waits for a peer whose setup failed


def one_rank_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise AssertionError("expected field 'routes' = [3, 4], got [4, 3]")
    dist.barrier()


def one_rank_is_killed(rank: int, world_size: int) -> None:
    dist.barrier()  # everyone is up
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here for a peer that is gone


def one_rank_hangs(rank: int, world_size: int) -> str:
    if rank == 1:
        time.sleep(600)
    return "done"


# --------------------------------------------------------------------------------------------------
# harness.testing.ranks
# --------------------------------------------------------------------------------------------------


def test_run_ranks_returns_every_ranks_value_through_a_fresh_rendezvous() -> None:
    run = run_ranks(sum_of_ranks, 2, args=(10.0,))
    assert run.backend == default_backend(2)
    assert [r["rank"] for r in run.results] == [0, 1], f"results come back in rank order: {run.results}"
    for result in run.results:
        assert result["world"] == 2
        assert torch.equal(result["sum"], torch.tensor([10.0])), (
            f"all_reduce of ranks 0+1, ×10: {result['sum']}"
        )
        assert result["ids"].dtype == torch.int16, "tensors keep their dtype through the result pipe"
    assert len(run.cpu_seconds) == 2 and all(c > 0 for c in run.cpu_seconds)
    assert run.wall_seconds > 0


def test_the_setup_hook_runs_in_every_rank_inside_the_group_before_fn() -> None:
    run = run_ranks(read_setup, 2, setup=record_setup)
    assert run.results == ["rank 0 of 2, group up: True", "rank 1 of 2, group up: True"], run.results


def test_a_failing_setup_hook_fails_the_run_naming_the_rank() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(read_setup, 2, setup=setup_fails_on_rank_0, timeout=60)
    err = caught.value
    assert (err.kind, err.ranks, err.error_type) == ("raised", [0], "RuntimeError"), str(err)
    assert "setup_fails_on_rank_0" in err.remote_traceback, err.remote_traceback


def test_a_rank_that_raises_fails_the_run_naming_the_rank_and_its_message() -> None:
    with pytest.raises(RankFailure) as caught:
        run_ranks(one_rank_raises, 2, timeout=60)
    err = caught.value
    assert isinstance(err, AssertionError), "a failed check in a rank reads as a failed test"
    assert (err.kind, err.ranks, err.error_type) == ("raised", [1], "AssertionError"), str(err)
    assert "rank 1 raised AssertionError: expected field 'routes' = [3, 4]" in str(err), str(err)
    assert "one_rank_raises" in err.remote_traceback, "the rank's own traceback comes back"


def test_a_killed_rank_fails_the_run_within_60_s_naming_the_dead_rank() -> None:
    start = time.perf_counter()
    with pytest.raises(RankFailure) as caught:
        run_ranks(one_rank_is_killed, 2, timeout=60)
    elapsed = time.perf_counter() - start
    assert (caught.value.kind, caught.value.ranks) == ("died", [1]), str(caught.value)
    assert "rank 1 (killed by signal 9 (SIGKILL)) died" in str(caught.value), str(caught.value)
    assert elapsed < 60, f"noticed the dead rank after {elapsed:.1f} s, expected < 60 s"


def test_a_hanging_rank_is_killed_at_the_hard_timeout_and_named() -> None:
    timeout = 6.0  # rank 1 never finishes; rank 0 may not either if importing torch is slow today
    start = time.perf_counter()
    with pytest.raises(RankFailure) as caught:
        run_ranks(one_rank_hangs, 2, timeout=timeout)
    elapsed = time.perf_counter() - start
    assert caught.value.kind == "timed out", str(caught.value)
    assert 1 in caught.value.ranks, f"unfinished ranks {caught.value.ranks} should include the hanging rank 1"
    assert "did not finish within 6 s" in str(caught.value), str(caught.value)
    assert elapsed < timeout + 15, f"the run took {elapsed:.1f} s for a {timeout:g} s timeout"


def test_run_ranks_rejects_what_spawned_ranks_cannot_import() -> None:
    def local(rank: int, world_size: int) -> None:
        return None

    with pytest.raises(ValueError, match=r"fn = .*module-level function"):
        run_ranks(local, 2)
    with pytest.raises(ValueError, match=r"setup = .*module-level function"):
        run_ranks(sum_of_ranks, 2, setup=local)
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(sum_of_ranks, 0)


def test_parallel_spec_places_ranks_in_megatron_order() -> None:
    spec = ParallelSpec(tp=2, cp=2, pp=2, ep=2)
    assert spec.world_size == 8 and spec.name == "tp2-cp2-ep2-pp2"
    place = spec.place(5)  # 5 = tp 1 + 2·(cp 0 + 2·(dp 0 + 1·pp 1))
    assert (place.tp, place.cp, place.dp, place.pp, place.ep) == (1, 0, 0, 1, 1), place
    assert spec.rank_of(tp=1, cp=0, pp=1) == 5
    interleaved = ParallelSpec(pp=2, vpp=2)  # model chunk m runs on pp rank m % pp as virtual chunk m // pp
    assert [interleaved.model_chunk_owner(m) for m in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    with pytest.raises(TopologyError, match=r"ParallelSpec\.ep = 3"):
        ParallelSpec(tp=2, ep=3)


# --------------------------------------------------------------------------------------------------
# The parallel mutants die in suites/test_distributed.py (not only in the single-process suites)
# --------------------------------------------------------------------------------------------------

KILLS = [
    # (subject spec, -k expression selecting the layout that must kill it). Every parallel mutant is
    # also killed single-process by its named invariant (tests/test_mutants.py); the default run
    # proves the kill that needs two micro-batches in flight under a real PP schedule, `-m slow` the rest.
    ("harness.mutants.parallel:recompute-fifo-cleared", "recompute"),
    pytest.param("harness.mutants.parallel:ep-local-ids-in-place", "ep2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.parallel:cp-merge-contiguous", "cp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.parallel:vpp-chunks-contiguous", "pp2vpp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.parallel:stage-dense-shift", "pp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.parallel:sp-shard-strided", "tp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:recompute-drift", "recompute", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:cp-layout", "cp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:pp-offsets", "pp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:vpp-merge-order", "pp2vpp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:dense-layer-shift", "pp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:fp8-padding", "tp2", marks=pytest.mark.slow),
    pytest.param("harness.mutants.registry:silent-no-op", "tp2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("spec", "keyword"), KILLS)
def test_mutant_is_killed_by_the_distributed_suite(spec: str, keyword: str) -> None:
    outcomes, log = run_suites(
        spec, paths=[str(suites_dir() / "test_distributed.py")], keyword=keyword, extra=["-x"]
    )
    assert outcomes, f"{spec}: no test of suites/test_distributed.py matched -k {keyword!r}\n{log[-2000:]}"
    killers = [o.nodeid.split("::")[-1] for o in outcomes if o.outcome == "failed"]
    assert killers, f"{spec} survived suites/test_distributed.py -k {keyword!r} ({len(outcomes)} tests)"
