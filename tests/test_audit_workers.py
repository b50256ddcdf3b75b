"""Workers that die or stop mid-audit: a lost unit is retried or reported, a stuck one times out.

A process-pool worker killed from outside (SIGKILL, SIGSEGV, SIGTERM), a worker stopped
(SIGSTOP), the fork server killed: the audit still ends with the serial result, every unit
audited. A unit that kills its worker every time, or stops it every time, is reported as not
audited (an input error naming the file and the row groups, so the audit is never reported
complete and never exits with the violation code), and every other unit is audited. Ray with a
task whose worker always dies: the unit is reported, not a ``WorkerCrashedError`` traceback.

The kills come from the ``progress`` hook of ``audit_run``, called in the test's process as each
unit finishes: at the first one, the pool's workers (the fork server's children) are alive and
other units are still pending, so the kill always lands mid-audit.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyarrow")

from harness.audit import audit_run
from harness.audit.checks.fold import AuditOptions
from harness.audit.checks.state import AuditState
from harness.audit.execution.executors import audit_unit, plan_run
from harness.audit.execution.pool import processes
from harness.audit.layout.reader import Unit
from harness.audit.result.audit_result import AuditResult
from harness.audit.synthetic.generate import RunShape, generate_run

# No wall clock of its own: a stuck pool is the case under test (its budget), and a hang of the
# test itself is failed by the stall watch (harness.testing.stall).
pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="finds the pool's workers in /proc"
)

SHAPE = RunShape(
    steps=2, prompts=2, group_size=3, prompt_len=7, response_len=9, layers=5, experts=16, top_k=4
)
PLACES = ("bytes_read", "seconds")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("workers")
    generate_run(directory, SHAPE, seed=3, faults=("all_zero_layer", "nan_logprob"), file_bytes=6_000,
                 row_group_bytes=2_500)  # fmt: skip
    return directory


@pytest.fixture(scope="module")
def serial(run: Path) -> dict[str, Any]:
    return _comparable(audit_run(run, executor="serial", unit_bytes=1))


def _comparable(result: AuditResult) -> dict[str, Any]:
    doc = result.as_dict()
    for key in PLACES:
        doc.pop(key, None)
    return doc


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    stat = handle.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _kill_at_first_unit(target: str, sig: signal.Signals, killed: list[int]) -> Any:
    """A ``progress`` hook that sends ``sig`` to a worker (or the fork server) when the first unit is in."""

    def progress(stream: Iterable[tuple[Unit, AuditState]], total: int) -> Iterator[tuple[Unit, AuditState]]:
        for item in stream:
            if not killed:
                server = forkserver._forkserver._forkserver_pid
                assert server is not None
                victim = server if target == "server" else _children(server)[0]
                os.kill(victim, sig)
                killed.append(victim)
            yield item

    return progress


@pytest.mark.parametrize(
    ("target", "sig"),
    [
        ("worker", signal.SIGKILL),
        ("worker", signal.SIGSTOP),
        ("server", signal.SIGKILL),
        pytest.param("worker", signal.SIGSEGV, marks=pytest.mark.slow),
        pytest.param("worker", signal.SIGTERM, marks=pytest.mark.slow),
    ],
    ids=["SIGKILL", "SIGSTOP", "fork-server-SIGKILL", "SIGSEGV", "SIGTERM"],
)
def test_a_worker_killed_or_stopped_mid_audit_still_gives_the_serial_result(
    run: Path, serial: dict[str, Any], target: str, sig: signal.Signals, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RRH_UNIT_SECONDS", "4")  # a stopped worker is taken for stuck after 4 s
    killed: list[int] = []
    result = audit_run(run, executor="processes", workers=2, unit_bytes=1,
                       progress=_kill_at_first_unit(target, sig, killed))  # fmt: skip
    assert killed, "the kill never happened: the run finished in one unit"
    assert result.input_errors == []
    assert _comparable(result) == serial


def dies_on_its_unit(unit: Unit, options: AuditOptions) -> AuditState:
    """``audit_unit``, except that the worker given the file's row group 1 dies (a reader crash)."""
    if 1 in unit.row_groups and unit.path.endswith("000000.parquet"):
        # The default disposition: a crash handler a library left installed exits 255 instead.
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    return audit_unit(unit, options)


def stops_on_its_unit(unit: Unit, options: AuditOptions) -> AuditState:
    if 1 in unit.row_groups and unit.path.endswith("000000.parquet"):
        os.kill(os.getpid(), signal.SIGSTOP)
    return audit_unit(unit, options)


@pytest.mark.parametrize("work", [dies_on_its_unit, stops_on_its_unit], ids=["SIGSEGV", "SIGSTOP"])
def test_a_unit_that_always_loses_its_worker_is_reported_and_the_others_are_audited(
    run: Path, work: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    if work is stops_on_its_unit:  # taken for stuck after 3 s (a killed worker needs no budget)
        monkeypatch.setenv("RRH_UNIT_SECONDS", "3")
    units = plan_run(run, unit_bytes=1).units
    culprit = next(u for u in units if 1 in u.row_groups and u.path.endswith("000000.parquet"))
    states = dict(processes(units, AuditOptions(), 2, work=work))
    assert sorted(states, key=units.index) == units, "every unit is accounted for, once"
    errors = [e for state in states.values() for e in state.input_errors]
    assert len(errors) == 1 and errors[0].startswith(f"{culprit.path} row groups 1–1 (rows ")
    expected = "SIGSEGV" if work is dies_on_its_unit else "stuck"
    assert "not audited" in errors[0] and expected in errors[0] and "\n" not in errors[0], errors[0]
    for unit, state in states.items():  # the others were audited as the serial executor does
        if unit is not culprit:
            assert state.input_errors == [] and state.rows_read == audit_unit(unit).rows_read


def always_dies(unit: Unit, options: AuditOptions) -> AuditState:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_ray_with_every_worker_dead_reports_the_units(run: Path) -> None:
    ray = pytest.importorskip("ray")
    from harness.audit.execution.executors import _ray

    units = plan_run(run, unit_bytes=1).units[:2]
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        states = dict(_ray(units, AuditOptions(), None, work=always_dies))
    finally:
        ray.shutdown()
    assert set(states) == set(units)
    for state in states.values():
        assert len(state.input_errors) == 1 and "not audited: the Ray task failed" in state.input_errors[0]


def _ray_workers(name: bytes) -> list[int]:
    """The pids of this machine's Ray workers whose title starts with ``ray::`` + ``name``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if handle.read().startswith(b"ray::" + name):
                        found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_ray_with_a_worker_stopped_mid_audit_still_gives_the_serial_result(
    run: Path, serial: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ray worker stopped (SIGSTOP) once left the audit waiting, then reported every unit still
    pending as not audited: the stuck ones now run again, as the process pool's do."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RRH_UNIT_SECONDS", "4")
    stopped: list[int] = []

    def progress(stream: Iterable[tuple[Unit, AuditState]], total: int) -> Iterator[tuple[Unit, AuditState]]:
        for item in stream:
            if not stopped:
                for pid in _ray_workers(b"audit_unit")[:1]:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            yield item

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = audit_run(run, executor="ray", unit_bytes=1, progress=progress)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        ray.shutdown()
    assert stopped, "no Ray worker was running a unit at the first unit's end"
    assert result.input_errors == []
    assert _comparable(result) == serial


@pytest.mark.slow
def test_ray_with_a_unit_that_always_stops_its_worker_reports_it_and_audits_the_others(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    from harness.audit.execution.executors import _ray

    monkeypatch.setenv("RRH_UNIT_SECONDS", "3")
    units = plan_run(run, unit_bytes=1).units[:3]
    culprit = next(u for u in units if 1 in u.row_groups and u.path.endswith("000000.parquet"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        states = dict(_ray(units, AuditOptions(), None, work=stops_on_its_unit))
    finally:
        ray.shutdown()
    assert sorted(states, key=units.index) == units, "every unit is accounted for, once"
    errors = [e for state in states.values() for e in state.input_errors]
    assert len(errors) == 1 and errors[0].startswith(f"{culprit.path} row groups 1–1 (rows "), errors
    assert "not audited" in errors[0] and "stuck" in errors[0] and "3 tries" in errors[0], errors[0]
    for unit, state in states.items():
        if unit is not culprit:
            assert state.input_errors == [] and state.rows_read == audit_unit(unit).rows_read


@pytest.fixture
def server_handle() -> Iterator[Any]:
    """This process's fork-server handle, restored after the test pokes at it."""
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    saved = (server._forkserver_pid, server._forkserver_address, server._forkserver_alive_fd)
    yield server
    server._forkserver_pid, server._forkserver_address, server._forkserver_alive_fd = saved


def _pose_as_server(server: Any, pid: int) -> int:
    """Make ``pid`` this process's fork server, with a fresh "alive" fd; returns the fd."""
    read, write = os.pipe()
    os.close(read)
    server._forkserver_pid, server._forkserver_address, server._forkserver_alive_fd = pid, "\0bogus", write
    return write


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_dead_inherited_fork_server_is_forgotten(server_handle: Any) -> None:
    """A server that is gone and not this process's child (as after a fork of the process that
    started it) is dropped: fd closed, pid and address cleared, so the pool starts its own."""
    import subprocess
    import sys

    from harness.audit.execution.pool import _forget_dead_server

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    fd = _pose_as_server(server_handle, int(gone.stdout))  # exited and reaped: no /proc entry
    _forget_dead_server()
    assert (server_handle._forkserver_pid, server_handle._forkserver_address) == (None, None)
    assert server_handle._forkserver_alive_fd is None and not _fd_open(fd)


@pytest.mark.parametrize("whose", ["own child", "alive, not a child"])
def test_a_live_or_own_fork_server_is_kept(server_handle: Any, whose: str) -> None:
    """This process's own child (``ensure_running`` reaps it if it died) and a live server that is not
    its child are both left as they are."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        pid = child.pid if whose == "own child" else os.getppid()
        fd = _pose_as_server(server_handle, pid)
        from harness.audit.execution.pool import _forget_dead_server

        _forget_dead_server()
        assert server_handle._forkserver_pid == pid and server_handle._forkserver_alive_fd == fd
        os.close(fd)
    finally:
        child.communicate(b"")
