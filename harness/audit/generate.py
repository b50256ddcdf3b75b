"""A seeded run of realistic shape, with faults planted at known places (``rrh audit generate``).

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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout import SampleRecord
from harness.audit.writer import RunWriter

FAULTS = ("layer_shift", "duplicated_resume", "all_zero_layer", "wrapped_id", "replay_noop", "nan_logprob")
SOURCE = "rrh audit generate (synthetic: Qwen3-30B-A3B routing shape)"


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


def _routes(rng: np.random.Generator, rows: int, shape: RunShape) -> npt.NDArray[np.uint8]:
    """Random routes with ``top_k`` distinct ids: ``(a + j·s) mod E`` with s odd (E a power of two) or 1."""
    e, k = shape.experts, shape.top_k
    a = rng.integers(0, e, size=(rows, shape.layers, 1), dtype=np.int64)
    stride = (
        2 * rng.integers(0, e // 2, size=(rows, shape.layers, 1), dtype=np.int64) + 1
        if e & (e - 1) == 0
        else 1
    )
    return ((a + np.arange(k) * stride) % e).astype(np.uint8 if e <= 256 else np.uint16)


def _different(rng: np.random.Generator, route: npt.NDArray[Any], experts: int) -> npt.NDArray[Any]:
    """A route whose set differs from ``route`` (ids shifted by one, mod E)."""
    return ((route.astype(np.int64) + 1) % experts).astype(route.dtype)


def generate_run(
    directory: str | os.PathLike[str],
    shape: RunShape = RunShape(),
    *,
    seed: int = 0,
    faults: tuple[str, ...] = (),
    target_bytes: int | None = None,
    file_bytes: int = 256 << 20,
) -> list[PlantedFault]:
    """Write a run into ``directory``; return the faults planted (one of each kind asked for).

    ``target_bytes`` grows the number of steps until the engine routes reach that size.
    Faults go to distinct samples of the last step, so a clean run and a faulty one share all
    other rows.
    """
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"faults: {unknown[0]!r}; expected some of {list(FAULTS)}")
    if shape.experts > 256 and "wrapped_id" in faults:
        raise ValueError("faults: wrapped_id needs num_experts <= 256 (an id wrapped into [E, 256))")
    steps = shape.steps
    per_step = shape.prompts * shape.group_size * shape.sample_bytes()
    if target_bytes is not None:
        steps = max(steps, -(-target_bytes // per_step))
    rng = np.random.default_rng(seed)
    planted: list[PlantedFault] = []
    victims = {kind: i for i, kind in enumerate(faults)}  # fault → sample index in the last step
    with RunWriter(directory, file_bytes=file_bytes) as writer:
        for step in range(steps):
            index = 0
            for prompt in range(shape.prompts):
                group = f"s{step}-p{prompt}"
                prompt_routes = _routes(rng, shape.prompt_len, shape)
                prompt_tokens = rng.integers(0, 32000, size=shape.prompt_len)
                for member in range(shape.group_size):
                    kinds = [k for k, v in victims.items() if v == index and step == steps - 1]
                    record, fault = _sample(
                        rng, shape, step, group, member, prompt_routes, prompt_tokens, kinds
                    )
                    planted.extend(fault)
                    writer.write(record)
                    index += 1
    return planted


def _sample(
    rng: np.random.Generator,
    shape: RunShape,
    step: int,
    group: str,
    member: int,
    prompt_routes: npt.NDArray[Any],
    prompt_tokens: npt.NDArray[Any],
    kinds: list[str],
) -> tuple[SampleRecord, list[PlantedFault]]:
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
        elif kind == "nan_logprob":
            token = int(rng.integers(0, r))
            engine_lp[token] = np.nan
            faults.append(PlantedFault(kind, "logprobs_valid", step, key, p + token, -1))
    record = SampleRecord(
        step=step,
        sample_key=key,
        group_key=group,
        prompt_len=p,
        response_len=r,
        tokens=np.concatenate([prompt_tokens, rng.integers(0, 32000, size=r)]),
        num_experts=shape.experts,
        top_k=shape.top_k,
        num_layers=shape.layers,
        moe_layers=range(shape.layers),
        source=SOURCE,
        loss_mask=np.ones(r, dtype=bool),
        engine_logprobs=engine_lp,
        trainer_logprobs=trainer_lp,
        engine_routes=engine,
        trainer_routes=trainer,
        replay="R3",
        attempt_ends=attempt_ends,
        attempt_kinds=["start", "resume"][: len(attempt_ends)],
        weight_versions=[step] * len(attempt_ends),
    )
    return record, faults


def write_example(directory: Path) -> list[PlantedFault]:
    """The README's example: a small run (two steps) with one of each fault."""
    return generate_run(directory, RunShape(), seed=0, faults=FAULTS)
