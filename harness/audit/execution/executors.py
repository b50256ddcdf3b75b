"""Running an audit: units of work folded into states, serially, in a process pool or on Ray.

Every executor runs the same function, ``audit_unit``, on the same units and merges the states
it gets back in whatever order they arrive; the result does not depend on that order
(``harness.audit.checks.state``). A unit that cannot be read becomes an input error of the state and
the other units are still audited; ``strict`` stops at the first violation or input error.

- ``serial``: in this process, one unit after another (the next row group read on a second thread
  while this one is checked, where there is a second CPU);
- ``processes``: a ``ProcessPoolExecutor`` of the CPUs this process may use (default);
- ``ray``: one Ray task per unit, on the cluster at ``ray_address`` or a local one (extra
  ``ray``; imported only when asked for).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.audit.checks.fold import AuditOptions, fold_batch, fold_shards
from harness.audit.checks.invariants import DETECTORS
from harness.audit.checks.state import AuditState
from harness.audit.execution.pool import RETRIES, UNIT_SECONDS_ENV, first_line, lost, processes, unit_seconds
from harness.audit.execution.read_ahead import ReadAhead
from harness.audit.layout.decode import decode
from harness.audit.layout.reader import (
    Model,
    Unit,
    check_model,
    first_model,
    plan_units,
    read_unit,
    run_files,
)
from harness.audit.layout.schema import LayoutError
from harness.audit.result.audit_result import AuditResult
from harness.audit.tap.manifest import check_manifests
from harness.cpus import available_cpus

EXECUTORS = ("serial", "processes", "ray")

EVERY_ROW = AuditOptions()
"""The default options: every step and every sample (frozen, so one instance serves every call)."""


def _selected(table: Any, options: AuditOptions) -> tuple[Any, Any]:
    """The rows of ``table`` the options select (all of them by default: no copy), and their indices."""
    if options.steps is None and options.every <= 1 and options.samples >= 1.0:
        return table, None
    import numpy as np
    import pyarrow as pa

    from harness.audit.checks.fold import sample_hash
    from harness.audit.layout.decode import arrow_column, arrow_numpy

    step = arrow_numpy(arrow_column(table, "step")).astype(np.int64)
    keep = np.ones(table.num_rows, dtype=bool)
    if options.steps is not None:
        keep &= np.isin(step, list(options.steps))
    if options.every > 1:
        keep &= step % options.every == 0
    if options.samples < 1.0:
        keys = table.column("sample_key").to_pylist()
        keep &= np.array(
            [sample_hash(int(s), k) < options.samples for s, k in zip(step, keys, strict=True)], dtype=bool
        )
    return table.filter(pa.array(keep)), np.flatnonzero(keep)


def _decode(table: Any, path: str, first_row: int, rows: Any, model: Model | None) -> Any:
    """``decode``, with what pyarrow raises on data it cannot convert (strings that are not UTF-8, …)
    said as a ``LayoutError`` naming the file and the rows, and the run's model checked."""
    try:
        batch = decode(table, path, first_row, rows)
    except LayoutError:
        raise
    except Exception as err:
        text = (str(err).splitlines() or [""])[0][:200]
        raise LayoutError(f"{path} rows {first_row}…: undecodable ({type(err).__name__}: {text})") from None
    check_model(batch, model)
    return batch


def _fold_table(
    table: Any,
    path: str,
    first_row: int,
    options: AuditOptions,
    state: AuditState,
    model: Model | None = None,
) -> None:
    selected, kept = _selected(table, options)
    if not selected.num_rows:
        return
    rows = None if kept is None else first_row + kept  # the file's rows, named in offenders
    if "shard" not in selected.schema.names or selected.column("shard").null_count == selected.num_rows:
        fold_batch(_decode(selected, path, first_row, rows, model), state)
        return
    # Shard rows (layout v2, a CP/SP rank's part of a sample) are folded apart from whole samples.
    import numpy as np
    import pyarrow as pa

    index = np.arange(selected.num_rows) if kept is None else kept
    shard = selected.column("shard").is_valid().to_numpy(zero_copy_only=False)
    for mask, fold in ((~shard, fold_batch), (shard, fold_shards)):
        if mask.any():
            fold(
                _decode(selected.filter(pa.array(mask)), path, first_row, first_row + index[mask], model),
                state,
            )


def _release_arrow_memory() -> None:
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def audit_unit(unit: Unit, options: AuditOptions = EVERY_ROW) -> AuditState:
    """Read and check one unit; a malformed file or row becomes an input error of the returned state.

    One thread: pyarrow decodes on the calling thread and so do the kernels. The pool's and Ray's
    parallelism is their processes; threads inside each would only oversubscribe the CPUs.
    """
    return _audit_tables(unit, read_unit(unit, use_threads=False), options)


def _audit_tables(unit: Unit, tables: Iterator[tuple[int, Any]], options: AuditOptions) -> AuditState:
    """Check the row groups ``tables`` of ``unit`` (as ``read_unit`` yields them) into a state."""
    state = AuditState()
    state.files.add(unit.path)
    try:
        for first_row, table in tables:
            _fold_table(table, unit.path, first_row, options, state, unit.model)
            del table
            # Arrow's allocator keeps what a row group freed for the next one, which may not fit in it:
            # handed back, memory stays the row groups in flight over any number of row groups.
            _release_arrow_memory()
    except LayoutError as err:
        state.input_errors.append(str(err))
    state.bytes_read = unit.nbytes
    return state


@dataclass(frozen=True)
class Plan:
    """The units of a run and the files that could not even be opened."""

    units: list[Unit]
    errors: list[str]

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)


def plan_run(run: str | os.PathLike[str], unit_bytes: int | None = None) -> Plan:
    """Split ``run`` into units; ``LayoutError`` when there is no run at all.

    The run's model (expert count, top-k, layers, MoE layers) is the one most of its files start
    with (the first file's among equals): one damaged file cannot impose its own on the others. A
    row group of another model is an input error, never merged into the figures."""
    errors: list[str] = []
    models: dict[Path, Model | None] = {}
    for path in run_files(run, errors):
        try:
            models[path] = first_model(path)
        except LayoutError as err:
            errors.append(str(err))
    found = [m for m in models.values() if m is not None]
    counts = Counter(found)  # insertion-ordered: among equal counts, the first file's model
    model = max(counts, key=lambda m: counts[m]) if counts else None
    units: list[Unit] = []
    for path in models:
        try:
            units.extend(plan_units(path, *(() if unit_bytes is None else (unit_bytes,)), model=model))
        except LayoutError as err:
            errors.append(str(err))
    return Plan(units, errors)


def _serial(units: list[Unit], options: AuditOptions, read_ahead: bool) -> Iterator[tuple[Unit, AuditState]]:
    """In this process: with ``read_ahead``, the next row group is read on a second thread while
    this one is checked (``harness.audit.execution.read_ahead``); else one row group after another."""
    if not read_ahead:
        for unit in units:
            yield unit, audit_unit(unit, options)
        return
    with ReadAhead(units) as reader:
        for unit in units:
            yield unit, _audit_tables(unit, reader.tables(unit), options)


def _ray(
    units: list[Unit],
    options: AuditOptions,
    address: str | None,
    work: Callable[..., AuditState] = audit_unit,
) -> Iterator[tuple[Unit, AuditState]]:
    try:
        import ray
    except ImportError:
        raise LayoutError(
            "--executor ray: Ray is not installed; expected the 'ray' extra "
            "(pip install 'routing-replay-harness[ray]')"
        ) from None
    started = not ray.is_initialized()
    if started:
        # A cluster of our own (no address, none in RAY_ADDRESS) starts without the dashboard.
        own = address is None and not os.environ.get("RAY_ADDRESS")
        local: dict[str, Any] = {"include_dashboard": False} if own else {}
        ray.init(
            address=address,
            ignore_reinit_error=True,
            logging_level=logging.ERROR,
            log_to_driver=False,
            **local,
        )
    remote: Any = ray.remote(work)
    try:
        # As the process pool does (``execution.pool.processes``): units left by a round in which
        # no task finished within the budget (a stopped or hung worker) run again in a new round, the
        # stuck tasks' workers killed; after ``RETRIES`` rounds each is run alone, so that only a unit
        # that is stuck every time is reported as not audited.
        left = units
        for _ in range(RETRIES):
            left, _why = yield from _ray_round(ray, remote, left, options)
            if not left:
                return
        for unit in left:
            stuck, why = yield from _ray_round(ray, remote, [unit], options)
            for alone in stuck:
                yield alone, lost(alone, f"{why} in {RETRIES + 1} tries")
    finally:
        if started:
            ray.shutdown()


def _ray_round(
    ray: Any, remote: Any, units: list[Unit], options: AuditOptions
) -> Generator[tuple[Unit, AuditState], None, tuple[list[Unit], str]]:
    """One round of Ray tasks: yields each unit that finished and its state; returns the units left
    when no task finished within the budget (their tasks cancelled, the workers killed) and why."""
    pending = {remote.remote(u, options): u for u in units}
    while pending:
        budget = unit_seconds(pending.values())
        done, _ = ray.wait(list(pending), num_returns=1, timeout=budget)
        if not done:  # nothing finished within the budget: the tasks left are stuck
            for ref in pending:
                ray.cancel(ref, force=True)
            why = f"no Ray task finished in {budget:.0f} s ({UNIT_SECONDS_ENV}): stuck"
            return list(pending.values()), why
        for ref in done:
            unit = pending.pop(ref)
            try:
                state = ray.get(ref)
            except Exception as err:  # Ray retried a lost worker already; this one is reported
                state = lost(unit, f"the Ray task failed ({type(err).__name__}: {first_line(err)})")
            yield unit, state
    return [], ""


def run_units(
    units: list[Unit],
    options: AuditOptions,
    executor: str = "processes",
    workers: int | None = None,
    ray_address: str | None = None,
    read_ahead: bool | None = None,
) -> Iterator[tuple[Unit, AuditState]]:
    """``(unit, state)`` for every unit, in the order the executor finishes them.

    ``read_ahead`` (serial only): read the next row group on a second thread; by default where
    this process may use two CPUs and ``workers`` does not say one.
    """
    # One unit, or one worker: a pool would only add its start-up (a process importing the audit).
    if executor == "serial" or (
        executor == "processes" and min(len(units), workers or available_cpus()) <= 1
    ):
        if read_ahead is None:
            read_ahead = available_cpus() >= 2 and workers != 1
        return _serial(units, options, read_ahead)
    if executor == "processes":
        return processes(units, options, workers or available_cpus(), audit_unit)
    if executor == "ray":
        return _ray(units, options, ray_address)
    raise LayoutError(f"executor: {executor!r}; expected one of {list(EXECUTORS)}")


def audit_run(
    run: str | os.PathLike[str],
    *,
    options: AuditOptions = EVERY_ROW,
    executor: str = "processes",
    workers: int | None = None,
    ray_address: str | None = None,
    strict: bool = False,
    progress: Callable[[Iterable[tuple[Unit, AuditState]], int], Iterable[tuple[Unit, AuditState]]]
    | None = None,
    unit_bytes: int | None = None,
    input_errors: Sequence[str] = (),
    read_ahead: bool | None = None,
) -> AuditResult:
    """Audit every unit of ``run`` and return the merged result.

    ``progress(stream, total_bytes)`` may wrap the stream of finished units (the CLI's progress
    bar). ``strict`` stops at the first unit with a violation or an input error. ``input_errors``:
    what went wrong before the run was there (the dump files an importer could not read).
    ``read_ahead``: as ``run_units`` says.
    """
    plan = plan_run(run, unit_bytes)
    state = AuditState()
    state.input_errors.extend(input_errors)
    state.input_errors.extend(plan.errors)
    manifests = check_manifests(run)
    state.input_errors.extend(manifests.errors)
    stream: Iterable[tuple[Unit, AuditState]] = run_units(
        plan.units, options, executor, workers, ray_address, read_ahead
    )
    if progress is not None:
        stream = progress(stream, plan.nbytes)
    for _, part in stream:
        state.merge(part)
        broken = any(t.violated for name, t in part.tallies.items() if name not in DETECTORS)
        if strict and (part.input_errors or broken):
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            break
    result = AuditResult.of(state)
    result.notes = manifests.notes
    return result
