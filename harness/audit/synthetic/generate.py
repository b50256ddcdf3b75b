"""A seeded run of realistic shape, with faults planted at known places (``rrh generate``).

GRPO groups share their prompt rows; partial rollouts log their attempt boundaries and weight
versions; the routing is Qwen3-30B-A3B's by default (48 MoE layers, 128 experts, top-8, uint8);
the trainer's routes (as a tap writes them) replay the engine's under R3, each route listed in
another order (sets are compared, never lists). Faults, each at one (step, sample, row, layer):

- ``layer_shift``: the trainer replays the previous layer's routes (verl #5037);
- ``duplicated_resume``: a resumed sample's trace repeats its last attempt's rows (verl #6029);
- ``all_zero_layer``: a MoE layer captured as all zeros (vLLM #44116);
- ``wrapped_id``: an id wrapped into ``[num_experts, 256)`` (the signed/unsigned wrap class);
- ``replay_noop``: replay that did nothing: the trainer routes natively (verl #4562);
- ``nan_logprob``: a NaN engine log-prob on a trained token.

And two faults every sample of the last step shares (``SHARED_FAULTS``; no per-sample check can see
them, ``harness.audit.checks.shared`` judges them across the run):

- ``shared_row_shift``: the first row duplicated and the last dropped (a one-row shift of capture),
  replayed so under R3;
- ``shared_layer_copy``: MoE layer 2 holds layer 1's routes.

Each step draws from its own generator, seeded by ``(seed, step)``, so a run is the same whatever
writes it: the columnar path (default: Arrow arrays built from numpy, one file per block of
steps, blocks in parallel processes with ``workers``) or ``columnar=False`` (``SampleRecord``
through ``RunWriter``, as a framework would write it). Both give the same rows; only the split
into files and row groups differs, which no audit figure depends on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.execution.pool import pool_context
from harness.audit.layout.schema import FILE_SUFFIX, SampleRecord, arrow_schema
from harness.audit.layout.writer import ROW_GROUP_BYTES, RunWriter, write_table

FAULTS = ("layer_shift", "duplicated_resume", "all_zero_layer", "wrapped_id", "replay_noop", "nan_logprob")
SHARED_FAULTS = ("shared_row_shift", "shared_layer_copy")
EVERY = -1
"""The victim index of a shared fault: every sample of the last step."""
SOURCE = "rrh generate (synthetic: Qwen3-30B-A3B routing shape)"


@dataclass(frozen=True)
class RunShape:
    """The shape of a generated run; the defaults are Qwen3-30B-A3B's routing."""

    steps: int = 2
    prompts: int = 4
    group_size: int = 4
    prompt_len: int = 64
    response_len: int = 96
    layers: int = 48
    experts: int = 128
    top_k: int = 8

    def sample_bytes(self) -> int:
        """Route bytes of a sample of average length."""
        return (self.prompt_len + self.response_len - 1) * self.layers * self.top_k


@dataclass(frozen=True)
class PlantedFault:
    """Where a fault was planted: the invariant that must name it there."""

    kind: str
    invariant: str
    step: int
    sample_key: str
    row: int
    layer: int

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _routes(rng: np.random.Generator, rows: int, shape: RunShape) -> npt.NDArray[Any]:
    """Random routes with ``top_k`` distinct ids: ``(a + j·s) mod E`` with s odd (E a power of two) or 1.

    With E a power of two that fits a byte, the arithmetic runs on bytes drawn in one call: a byte
    wraps mod 256 and E divides 256, so the ids are those of exact arithmetic, 8× cheaper to make.
    """
    e, k = shape.experts, shape.top_k
    if e & (e - 1) == 0 and e <= 256:
        # One draw of random bytes: a = b mod E, s = (b' mod E) | 1 (uniform over the odd ids).
        mask = np.uint8(e - 1)
        draws = np.frombuffer(rng.bytes(2 * rows * shape.layers), dtype=np.uint8).reshape(
            2, rows, shape.layers, 1
        )
        a = draws[0] & mask
        stride = (draws[1] & mask) | np.uint8(1)
        out = a + np.arange(k, dtype=np.uint8) * stride
        if e < 256:
            out &= mask
        return out
    a64 = rng.integers(0, e, size=(rows, shape.layers, 1), dtype=np.int64)
    stride64 = (
        2 * rng.integers(0, e // 2, size=(rows, shape.layers, 1), dtype=np.int64) + 1
        if e & (e - 1) == 0
        else 1
    )
    return ((a64 + np.arange(k) * stride64) % e).astype(np.uint8 if e <= 256 else np.uint16)


def _different(rng: np.random.Generator, route: npt.NDArray[Any], experts: int) -> npt.NDArray[Any]:
    """A route whose set differs from ``route`` (ids shifted by one, mod E)."""
    return ((route.astype(np.int64) + 1) % experts).astype(route.dtype)


@dataclass
class _Sample:
    """One generated sample as arrays (what a ``SampleRecord`` holds, before encoding)."""

    step: int
    key: str
    group: str
    prompt_len: int
    response_len: int
    tokens: npt.NDArray[Any]
    engine: npt.NDArray[Any]
    trainer: npt.NDArray[Any]
    engine_lp: npt.NDArray[np.float32]
    trainer_lp: npt.NDArray[np.float32]
    attempt_ends: list[int]

    def record(self, shape: RunShape) -> SampleRecord:
        return SampleRecord(
            step=self.step,
            sample_key=self.key,
            group_key=self.group,
            prompt_len=self.prompt_len,
            response_len=self.response_len,
            tokens=self.tokens,
            num_experts=shape.experts,
            top_k=shape.top_k,
            num_layers=shape.layers,
            moe_layers=range(shape.layers),
            source=SOURCE,
            loss_mask=np.ones(self.response_len, dtype=bool),
            engine_logprobs=self.engine_lp,
            trainer_logprobs=self.trainer_lp,
            engine_routes=self.engine,
            trainer_routes=self.trainer,
            replay="R3",
            attempt_ends=self.attempt_ends,
            attempt_kinds=["start", "resume"][: len(self.attempt_ends)],
            weight_versions=[self.step] * len(self.attempt_ends),
        )


def _steps(shape: RunShape, target_bytes: int | None) -> int:
    per_step = shape.prompts * shape.group_size * shape.sample_bytes()
    return shape.steps if target_bytes is None else max(shape.steps, -(-target_bytes // per_step))


def _step_samples(
    shape: RunShape, seed: int, step: int, victims: dict[str, int]
) -> Iterator[tuple[_Sample, list[PlantedFault]]]:
    """The samples of one step, drawn from the step's own generator; ``victims``: fault → sample index."""
    rng = np.random.default_rng((seed, step))
    index = 0
    for prompt in range(shape.prompts):
        group = f"s{step}-p{prompt}"
        prompt_routes = _routes(rng, shape.prompt_len, shape)
        prompt_tokens = rng.integers(0, 32000, size=shape.prompt_len, dtype=np.int32)
        for member in range(shape.group_size):
            kinds = [k for k, v in victims.items() if v in (index, EVERY)]
            yield _sample(rng, shape, step, group, member, prompt_routes, prompt_tokens, kinds)
            index += 1


def generate_run(
    directory: str | os.PathLike[str],
    shape: RunShape = RunShape(),
    *,
    seed: int = 0,
    faults: tuple[str, ...] = (),
    target_bytes: int | None = None,
    file_bytes: int = 256 << 20,
    columnar: bool = True,
    workers: int = 1,
    row_group_bytes: int = ROW_GROUP_BYTES,
) -> list[PlantedFault]:
    """Write a run into ``directory``; return the faults planted (one of each kind asked for).

    ``target_bytes`` grows the number of steps until the engine routes reach that size.
    Faults go to distinct samples of the last step, so a clean run and a faulty one share all
    other rows. ``columnar`` (default) builds Arrow arrays from numpy, one file per block of
    steps of about ``file_bytes``, ``workers`` processes writing blocks in parallel; otherwise
    every sample goes through ``SampleRecord`` and ``RunWriter``. The rows are the same.
    ``row_group_bytes`` sizes the columnar path's row groups as ``RunWriter`` does with its
    ``ROW_GROUP_BYTES`` (smaller ones make a small run of many row groups, for tests).
    """
    unknown = [f for f in faults if f not in (*FAULTS, *SHARED_FAULTS)]
    if unknown:
        raise ValueError(f"faults: {unknown[0]!r}; expected some of {[*FAULTS, *SHARED_FAULTS]}")
    if shape.experts >= 256 and "wrapped_id" in faults:
        raise ValueError("faults: wrapped_id needs num_experts < 256 (an id wrapped into [E, 256))")
    own = [f for f in faults if f in FAULTS]
    if len(own) > shape.prompts * shape.group_size:
        raise ValueError(f"faults: {len(own)} faults need as many samples per step; the shape has fewer")
    steps = _steps(shape, target_bytes)
    victims = {kind: i for i, kind in enumerate(own)}  # fault → sample index in the last step
    victims |= {kind: EVERY for kind in faults if kind in SHARED_FAULTS}
    if not columnar:
        planted: list[PlantedFault] = []
        with RunWriter(directory, file_bytes=file_bytes) as writer:
            for step in range(steps):
                records = step_records(shape, step, seed=seed, faults=faults if step == steps - 1 else ())
                planted.extend(records.planted)
                for record in records.records:
                    writer.write(record)
        return planted
    Path(directory).mkdir(parents=True, exist_ok=True)
    # Blocks of whole steps, sized from the shape, so that each file is known before it is made.
    per_step = shape.prompts * shape.group_size * 2 * shape.sample_bytes()
    block = max(1, file_bytes // max(1, per_step))
    jobs = [
        (
            str(directory),
            shape,
            seed,
            lo,
            min(lo + block, steps),
            steps,
            victims,
            lo // block,
            row_group_bytes,
        )
        for lo in range(0, steps, block)
    ]
    if workers <= 1 or len(jobs) == 1:
        return [f for job in jobs for f in _write_block(*job)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=pool_context()) as pool:
        return [f for part in pool.map(_write_block, *zip(*jobs, strict=True)) for f in part]


@dataclass(frozen=True)
class StepRecords:
    """One generated step: its records and the faults planted in it."""

    records: list[SampleRecord]
    planted: list[PlantedFault]


def step_records(shape: RunShape, step: int, *, seed: int = 0, faults: tuple[str, ...] = ()) -> StepRecords:
    """The records of step ``step`` of the run ``generate_run`` writes (the same rows), with ``faults``
    planted in this step as ``generate_run`` plants them in its last: what a writer hands a run step
    by step (the tests of ``rrh audit --follow``)."""
    own = [f for f in faults if f in FAULTS]
    victims = {kind: i for i, kind in enumerate(own)} | {k: EVERY for k in faults if k in SHARED_FAULTS}
    records, planted = [], []
    for sample, fault in _step_samples(shape, seed, step, victims):
        planted.extend(fault)
        records.append(sample.record(shape))
    return StepRecords(records, planted)


def _write_block(
    directory: str,
    shape: RunShape,
    seed: int,
    lo: int,
    hi: int,
    steps: int,
    victims: dict[str, int],
    sequence: int,
    row_group_bytes: int = ROW_GROUP_BYTES,
) -> list[PlantedFault]:
    """Generate steps ``[lo, hi)`` and write them as one layout file (``part-r00000-<sequence>``)."""
    samples: list[_Sample] = []
    planted: list[PlantedFault] = []
    for step in range(lo, hi):
        for sample, fault in _step_samples(shape, seed, step, victims if step == steps - 1 else {}):
            samples.append(sample)
            planted.extend(fault)
    path = Path(directory) / f"part-r00000-{sequence:06d}{FILE_SUFFIX}"
    write_table(path, _table(samples, shape), sum(_row_bytes(s, shape) for s in samples), row_group_bytes)
    return planted


def _offsets(lengths: list[int], dtype: Any) -> npt.NDArray[Any]:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out.astype(dtype)


def _table(samples: list[_Sample], shape: RunShape) -> Any:
    """The samples as one Arrow table of the run layout, built column by column from numpy."""
    import pyarrow as pa

    from harness.trace import storage_dtype

    schema = arrow_schema()
    n = len(samples)
    dtype = storage_dtype(shape.experts).newbyteorder("<")

    def ints(values: list[int], name: str) -> Any:
        return pa.array(np.asarray(values, dtype=np.int64), schema.field(name).type)

    def const(value: Any, name: str) -> Any:
        return pa.array([value] * n, schema.field(name).type)

    def lists(parts: list[npt.NDArray[Any]], name: str) -> Any:
        kind = schema.field(name).type
        values = np.concatenate(parts).astype(kind.value_type.to_pandas_dtype(), copy=False)
        return pa.ListArray.from_arrays(
            pa.array(_offsets([p.size for p in parts], np.int32)), pa.array(values)
        )

    def blobs(parts: list[npt.NDArray[Any]]) -> tuple[Any, Any]:
        data = np.concatenate([np.ascontiguousarray(p, dtype=dtype).reshape(-1) for p in parts])
        offsets = _offsets([p.size * dtype.itemsize for p in parts], np.int64)
        array = pa.Array.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        return array, pa.array(np.asarray([p.shape[0] for p in parts], dtype=np.int32))

    engine, engine_rows = blobs([s.engine for s in samples])
    trainer, trainer_rows = blobs([s.trainer for s in samples])
    moe = np.arange(shape.layers, dtype=np.int32)
    columns = {
        "step": ints([s.step for s in samples], "step"),
        "sample_key": pa.array([s.key for s in samples], pa.string()),
        "group_key": pa.array([s.group for s in samples], pa.string()),
        "rank": const(0, "rank"),
        "prompt_len": ints([s.prompt_len for s in samples], "prompt_len"),
        "response_len": ints([s.response_len for s in samples], "response_len"),
        "tokens": lists([s.tokens for s in samples], "tokens"),
        "trainer_tokens": pa.nulls(n, schema.field("trainer_tokens").type),
        "loss_mask": lists([np.ones(s.response_len, dtype=bool) for s in samples], "loss_mask"),
        "engine_logprobs": lists([s.engine_lp for s in samples], "engine_logprobs"),
        "trainer_logprobs": lists([s.trainer_lp for s in samples], "trainer_logprobs"),
        "num_experts": const(shape.experts, "num_experts"),
        "top_k": const(shape.top_k, "top_k"),
        "layer_axis": const("decoder", "layer_axis"),
        "num_layers": const(shape.layers, "num_layers"),
        "moe_layers": lists([moe] * n, "moe_layers"),
        "routes_start": const(0, "routes_start"),
        "engine_routes": engine,
        "engine_rows": engine_rows,
        "engine_captured": pa.nulls(n, schema.field("engine_captured").type),
        "trainer_routes": trainer,
        "trainer_rows": trainer_rows,
        "recorded_routes": pa.nulls(n, schema.field("recorded_routes").type),
        "recorded_rows": pa.nulls(n, schema.field("recorded_rows").type),
        "replay": const("R3", "replay"),
        "attempt_ends": lists([np.asarray(s.attempt_ends) for s in samples], "attempt_ends"),
        "attempt_kinds": pa.array(
            [["start", "resume"][: len(s.attempt_ends)] for s in samples], schema.field("attempt_kinds").type
        ),
        "weight_versions": lists([np.full(len(s.attempt_ends), s.step) for s in samples], "weight_versions"),
        "source": const(SOURCE, "source"),
    }
    # The tap's columns (layout v2: forward, attempt payloads, shards) are not generated: null.
    return pa.Table.from_arrays([columns.get(f.name, pa.nulls(n, f.type)) for f in schema], schema=schema)


def _row_bytes(sample: _Sample, shape: RunShape) -> int:
    """``RunWriter``'s size estimate of the sample's row (``harness.audit.layout.writer._row_bytes``)."""
    attempts = len(sample.attempt_ends)
    entries = sample.tokens.size + 3 * sample.response_len + shape.layers + 3 * attempts
    return 256 + sample.engine.nbytes + sample.trainer.nbytes + 4 * entries


def _sample(
    rng: np.random.Generator,
    shape: RunShape,
    step: int,
    group: str,
    member: int,
    prompt_routes: npt.NDArray[Any],
    prompt_tokens: npt.NDArray[Any],
    kinds: list[str],
) -> tuple[_Sample, list[PlantedFault]]:
    p = shape.prompt_len
    r = int(rng.integers(shape.response_len // 2, shape.response_len * 3 // 2 + 1))
    key = f"{group}-m{member}"
    engine = np.concatenate([prompt_routes, _routes(rng, r - 1, shape)])
    # The trainer lists each route's ids in another order: the same sets (R3 replayed them all).
    trainer = engine[:, :, ::-1].copy()
    engine_lp = -rng.exponential(1.0, size=r).astype(np.float32)
    trainer_lp = np.minimum(engine_lp + rng.normal(0.0, 1e-3, size=r).astype(np.float32), 0.0)
    resumed = r > shape.response_len  # the longer half of the responses were aborted and resumed once
    attempt_ends = [r // 2, r] if resumed else [r]
    faults = []
    for kind in kinds:
        row, layer = int(rng.integers(1, p + r - 2)), int(rng.integers(1, shape.layers))
        if kind == "layer_shift":
            trainer[:, 1:] = trainer[:, :-1].copy()
            row, layer = 0, 1
            while {*engine[0, layer].tolist()} == {*engine[0, layer - 1].tolist()}:
                layer += 1
            faults.append(PlantedFault(kind, "replay_fidelity", step, key, row, layer))
        elif kind == "duplicated_resume":
            extra = engine[-(r // 2) :]
            engine = np.concatenate([engine, extra])
            trainer = np.concatenate([trainer, extra[:, :, ::-1]])
            attempt_ends = [r // 2, r]
            faults.append(PlantedFault(kind, "coverage", step, key, p + r - 1, -1))
        elif kind == "all_zero_layer":
            engine[:, layer] = 0
            trainer[:, layer] = 0
            faults.append(PlantedFault(kind, "moe_layer_nonzero", step, key, 0, layer))
        elif kind == "wrapped_id":
            engine[row, layer, 0] = engine[row, layer, 0] % shape.experts + shape.experts
            trainer[row, layer] = engine[row, layer, ::-1]
            faults.append(PlantedFault(kind, "ids_valid", step, key, row, layer))
        elif kind == "replay_noop":
            trainer = _routes(rng, engine.shape[0], shape)
            trainer[0, 0] = _different(rng, engine[0, 0], shape.experts)
            faults.append(PlantedFault(kind, "replay_fidelity", step, key, 0, 0))
        elif kind == "shared_row_shift":
            engine = np.concatenate([engine[:1], engine[:-1]])
            trainer = np.concatenate([trainer[:1], trainer[:-1]])
            faults.append(PlantedFault(kind, "repeated_rows", step, key, 1, -1))
        elif kind == "shared_layer_copy":
            engine[:, 2], trainer[:, 2] = engine[:, 1], trainer[:, 1]
            faults.append(PlantedFault(kind, "copied_layers", step, key, 0, 2))
        elif kind == "nan_logprob":
            token = int(rng.integers(0, r))
            engine_lp[token] = np.nan
            faults.append(PlantedFault(kind, "logprobs_valid", step, key, p + token, -1))
    tokens = np.concatenate([prompt_tokens, rng.integers(0, 32000, size=r, dtype=np.int32)])
    sample = _Sample(step, key, group, p, r, tokens, engine, trainer, engine_lp, trainer_lp, attempt_ends)
    return sample, faults


def write_example(directory: Path) -> list[PlantedFault]:
    """The audit page's example (docs/audit.md): a small run (two steps) with one of each fault."""
    return generate_run(directory, RunShape(), seed=0, faults=FAULTS)
