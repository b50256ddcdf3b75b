"""Test support: run a function on N freshly spawned ranks of one process group, safely.

``run_ranks(fn, world_size, args=..., setup=..., timeout=...)`` starts ``world_size`` processes
with the ``forkserver`` start method, joins them into one ``torch.distributed`` process group,
runs ``setup(rank, world_size)`` (the per-rank setup hook: Megatron's CPU patches,
``harness.testing.megatron_cpu.setup_rank``) and then
``fn(rank, world_size, *args)`` in each, and returns every rank's return value. It is the one
spawner of the harness's distributed suites (``suites/test_distributed.py``,
``suites/test_megatron.py``).

Start: never a fork of the caller (a forked torch with threads is undefined behaviour). Each rank
is forked from multiprocessing's fork server, a process started once per caller that has imported
torch, the harness and megatron-core when installed (``PRELOAD``) and run nothing else: a rank
then starts in a fraction of a second instead of importing them anew (~3 s of CPU for torch, ~5 s
more for megatron-core on the CI machine, for every rank of every run). It is otherwise a fresh
process: its ``sys.path`` and working directory are the caller's at the call (multiprocessing
sends them), and so is its environment (``run_ranks`` sends it: the server's own is that of the
moment it started).

Rendezvous: a ``file://`` store in a fresh temporary directory per run. Unlike a TCP store it needs
no free port, so parallel test workers (``pytest -n``) cannot race for one, and a stale store from
an earlier run cannot be joined by mistake.

Hygiene, so a distributed test can fail but never hang or leak:

* **hard timeout**: the whole run has ``timeout`` seconds; past that every rank still running is
  killed. The process group's own collective timeout is the same, so a rank stuck in a collective
  also errors out by itself.
* **dead ranks fail fast**: a rank that exits without reporting (a signal, ``os._exit``, OOM) is
  noticed as soon as it exits, not at the timeout; its peers get ``_GRACE_S`` to report, then are
  killed.
* **one error**: every way a run can fail raises `RankFailure`, which names the ranks, what
  happened to them (``kind``: raised, died, timed out) and, for a rank that raised, its exception
  type and traceback. It is an ``AssertionError``, so a check failing inside a rank reads as a
  failed test.
* **cleanup**: only the processes this call started are killed (by their handles), the rendezvous
  directory is removed and the pipes are closed, whatever happens.
* **determinism**: one torch thread per rank, whatever the machine (reductions do not depend on
  the core count, and N ranks do not oversubscribe a small CI runner).

The backend is chosen by device: NCCL when CUDA has a device per rank, gloo otherwise. ``fn`` and
``setup`` must be importable by the spawned processes (module-level functions). Return values travel
as ``torch.save`` bytes loaded with ``weights_only=True`` (no pickle of arbitrary objects), so keep
them to tensors, numbers, strings, None and lists/tuples/dicts of those.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

PRELOAD = ("harness.testing.rank_imports", __name__)
"""What the fork server imports once, before it forks any rank: what every rank imports anyway."""

DEFAULT_TIMEOUT_S = 60.0
_GRACE_S = 2.0  # after a rank fails or dies, how long its peers get to report before they are killed

FailureKind = Literal["raised", "died", "timed out"]


class RankFailure(AssertionError):
    """A run of ranks did not complete.

    ``kind`` says how: a rank ``"raised"`` (``error_type`` and ``remote_traceback`` are its own),
    ``"died"`` without reporting, or the run ``"timed out"``. ``ranks`` are the ranks it is about:
    the first rank that raised, the dead ranks, or the ranks still running at the timeout.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: FailureKind,
        ranks: Sequence[int],
        error_type: str = "",
        remote_traceback: str = "",
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.ranks = list(ranks)
        self.error_type = error_type
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class RankRun:
    """What a completed run returned, and what it cost.

    ``results[r]`` is rank r's return value; ``cpu_seconds[r]`` its process's user + system CPU
    time since the fork (``PRELOAD``'s imports excluded); ``wall_seconds`` the whole run, start
    to join.
    """

    results: list[Any]
    cpu_seconds: list[float]
    wall_seconds: float
    backend: str

    @property
    def total_cpu_seconds(self) -> float:
        return sum(self.cpu_seconds)


def forget_inherited_forkserver() -> None:
    """In a process forked from one that already started the rank fork server: drop the inherited
    server, so that this process starts one of its own on its next run.

    The inherited server is not this process's child, so ``multiprocessing`` cannot ``waitpid`` it
    (``ChildProcessError``); dropping this copy of its handle leaves it running for the parent.
    """
    from harness.audit.execution.pool import forget_forkserver

    forget_forkserver()


_SERVER_PID: int | None = None
"""The fork server this process started with ``PRELOAD``, once it has."""


def ensure_rank_server(context: Any) -> None:
    """Make the process's fork server one that imported ``PRELOAD``.

    The fork server is one per process, and its preload is whatever the first caller set: a server
    another caller started (the audit's pool, ``harness.audit.execution.pool``, with its own preload) would
    have every rank import torch, megatron-core and the harness anew (~8 s of CPU a run). Such a
    server is stopped and ours started; what it already forked keeps running.
    """
    global _SERVER_PID
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None and server._forkserver_pid != _SERVER_PID:
        try:
            server._stop()
        except ChildProcessError:  # inherited through a fork: not ours to wait for
            forget_inherited_forkserver()
    context.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    _SERVER_PID = server._forkserver_pid


def default_backend(world_size: int) -> str:
    """``"nccl"`` when CUDA has at least one device per rank, else ``"gloo"``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    setup: Callable[[int, int], None] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> RankRun:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks of one process group.

    ``setup(rank, world_size)``, when given, runs in every rank once the process group exists and
    before ``fn``. Raises `RankFailure` when a rank raises, dies, or the run passes ``timeout``
    seconds; otherwise returns a `RankRun` with the ranks' values in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size = {world_size}: expected an int >= 1")
    if timeout <= 0:
        raise ValueError(f"timeout = {timeout}: expected seconds > 0")
    _check_importable("fn", fn)
    if setup is not None:
        _check_importable("setup", setup)
    backend = default_backend(world_size)
    context = multiprocessing.get_context("forkserver")
    ensure_rank_server(context)
    environment = dict(os.environ)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rrh-ranks-") as scratch:
        init_method = f"file://{os.path.join(scratch, 'rendezvous')}"
        processes, readers = [], []
        reports: list[tuple[Any, ...]] = []
        try:
            for rank in range(world_size):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_rank_main,
                    args=(
                        fn,
                        setup,
                        rank,
                        world_size,
                        tuple(args),
                        init_method,
                        backend,
                        timeout,
                        environment,
                        writer,
                    ),
                    name=f"rrh-rank-{rank}",
                    daemon=True,
                )
                process.start()
                writer.close()  # the child holds the only write end: EOF on the reader = it is gone
                processes.append(process)
                readers.append(reader)
            reports = _collect(processes, readers, start + timeout, timeout)
        finally:
            settle = time.perf_counter() + (2.0 if reports else 0.0)  # let finished ranks leave the group
            for process in processes:
                process.join(timeout=max(0.0, settle - time.perf_counter()))
                if process.is_alive():
                    process.kill()  # only processes this call started, by handle
            for process in processes:
                process.join(timeout=5)
            for reader in readers:
                reader.close()
    results = [_loads(report[1]) for report in reports]
    return RankRun(results, [report[2] for report in reports], time.perf_counter() - start, backend)


def _check_importable(name: str, fn: Callable[..., Any]) -> None:
    """Spawned ranks import ``fn`` by module and name: refuse what they could not find."""
    qualname = getattr(fn, "__qualname__", "")
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"{name} = {qualname or fn!r}: spawned ranks import it, so it must be a module-level "
            "function of an importable module"
        )


def _collect(
    processes: list[Any], readers: list[Connection], deadline: float, timeout: float
) -> list[tuple[Any, ...]]:
    """Wait for every rank's report; raise as soon as one fails, dies, or time runs out."""
    reports: dict[int, tuple[Any, ...]] = {}
    failures: dict[int, tuple[Any, ...]] = {}  # in the order they arrived
    dead: dict[int, str] = {}
    failed_at: float | None = None
    while len(reports) < len(processes):
        waiting = [
            r for r in range(len(processes)) if r not in reports and r not in failures and r not in dead
        ]
        if not waiting:
            break
        now = time.perf_counter()
        if failed_at is not None and now - failed_at > _GRACE_S:
            break
        if now >= deadline:
            raise RankFailure(
                f"ranks {waiting} of {len(processes)} did not finish within {timeout:g} s and were killed "
                f"(finished: {sorted(reports)}); a rank waiting in a collective for a peer that never "
                "arrives looks like this",
                kind="timed out",
                ranks=waiting,
            )
        limit = deadline - now if failed_at is None else _GRACE_S - (now - failed_at)
        ready = wait(
            [readers[r] for r in waiting] + [processes[r].sentinel for r in waiting],
            timeout=max(0.0, min(limit, 1.0)),
        )
        for rank in waiting:
            if readers[rank] in ready or processes[rank].sentinel in ready:
                message = _read(readers[rank])
                if message is None:
                    if processes[rank].sentinel in ready or not processes[rank].is_alive():
                        processes[rank].join(timeout=1)
                        dead[rank] = _exit_reason(processes[rank].exitcode)
                        failed_at = failed_at or time.perf_counter()
                    continue
                if message[0] == "ok":
                    reports[rank] = message
                else:
                    failures[rank] = message
                    failed_at = failed_at or time.perf_counter()
    if dead:
        said = "; ".join(f"rank {r} raised {m[1]}: {m[2][:200]}" for r, m in failures.items())
        names = ", ".join(f"rank {r} ({why})" for r, why in sorted(dead.items()))
        raise RankFailure(
            f"{names} died without reporting a result; the other ranks were stopped"
            + (f" (what they reported: {said})" if said else ""),
            kind="died",
            ranks=sorted(dead),
        )
    if failures:
        # The first rank to fail is the cause; peers then typically fail with "connection closed".
        # The first line names the cause alone (reports keep a failure's first line).
        rank = next(iter(failures))
        _, error_type, text, remote = failures[rank]
        others = [r for r in failures if r != rank]
        also = (
            f"\nthen ranks {others} failed too, e.g. rank {others[0]}: {failures[others[0]][2][:200]}"
            if others
            else ""
        )
        raise RankFailure(
            f"rank {rank} raised {error_type}: {text}{also}\n--- rank {rank} traceback ---\n{remote}",
            kind="raised",
            ranks=[rank],
            error_type=error_type,
            remote_traceback=remote,
        )
    return [reports[r] for r in range(len(processes))]


def _read(reader: Connection) -> tuple[Any, ...] | None:
    """The rank's report, or None if it has none (nothing yet, or it closed its pipe by dying)."""
    try:
        if reader.poll():
            return reader.recv()  # type: ignore[no-any-return]
    except (EOFError, OSError):
        return None
    return None


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _dumps(value: Any) -> bytes:
    """Tensors go through the pipe as ``torch.save`` bytes, not through torch's shared-memory
    reductions, which need the sending rank alive until the parent has read them."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank_main(
    fn: Callable[..., Any],
    setup: Callable[[int, int], None] | None,
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    init_method: str,
    backend: str,
    timeout: float,
    environment: dict[str, str],
    writer: Connection,
) -> None:
    """Body of a rank: the caller's environment, join the group, run ``setup`` and ``fn``, report, leave."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.clear()
    os.environ.update(environment)
    # What torchrun sets, for code under test that reads it (the process group itself needs none).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        # Every rank is in the group before any runs: a rank whose function runs no collective could
        # otherwise leave while a peer was still connecting, closing the pair under it (gloo:
        # "connectFullMesh failed … Connection closed by peer", seen in CI). Leaving early later is
        # fine, and wanted: it is what unblocks a peer waiting on this rank when this rank failed.
        dist.barrier()
        if setup is not None:
            setup(rank, world_size)
        value = fn(rank, world_size, *args)
        writer.send(("ok", _dumps(value), _cpu_seconds()))
    except BaseException as err:  # report anything, then exit non-zero
        try:
            writer.send(("error", type(err).__name__, str(err), traceback.format_exc()))
        finally:
            writer.close()
            os._exit(1)  # peers may be blocked in a collective with us: do not wait on the group
    writer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
