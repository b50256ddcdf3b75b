"""What the importers share: the model's routing shape (and the placeholder of a dump without
routes), the checks of a padded route tensor, the samples cut out of it, and the loop that streams
a dump's files into records.

A padded batch dump (SkyRL's ``rollout_expert_indices``, verl's ``routed_experts``) holds one
``[B, S, layers, top_k]`` tensor, zero-filled outside each sample's payload: ``padded_samples`` cuts
each sample's rows out (``model_shape.payload_rows``), leaves out a sample whose ids the layout
cannot store (``model_shape.ids_fit``), and ``PaddedSample.record`` writes the record every such
importer writes. ``dump_records`` reads one file at a time under its time budget and, at the end,
says what was inferred.

It imports ``harness.audit``'s layout, inputs and ``model_shape``, and ``harness.trace``; no importer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers.model_shape import (
    LayerVote,
    ids_fit,
    moe_layers_input,
    num_experts_input,
    payload_rows,
    step_layers,
)
from harness.audit.layout.inputs import dtype_name, read_file
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.trace import MAX_LAYERS, LayerAxis


@dataclass(frozen=True)
class RoutingShape:
    """The model's routing shape, the same for every record of the run."""

    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: tuple[int, ...]

    def fields(self) -> dict[str, Any]:
        """The ``SampleRecord`` fields this shape fills."""
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_layers": self.num_layers,
            "moe_layers": self.moe_layers,
        }


NO_ROUTES = RoutingShape(num_experts=1, top_k=1, num_layers=1, moe_layers=(0,))
"""A dump without routes (R3 off) has no routing shape; the layout needs one, so this placeholder."""


def model_inputs(
    num_experts: int | None, moe_layers: Sequence[int] | None, framework: str
) -> tuple[int, tuple[int, ...] | None, LayerVote | None]:
    """What a dump that records neither the expert count nor the MoE layers needs: the expert count
    (given, or ``$RRH_NUM_EXPERTS``), the MoE layers if given, and else the vote that infers them."""
    experts = num_experts_input(num_experts, framework)
    layers = moe_layers_input(moe_layers)
    return experts, layers, LayerVote() if layers is None else None


def dump_records(
    reads: Iterable[tuple[Path, Callable[[], tuple[list[SampleRecord], Any]]]],
    errors: list[str] | None,
    vote: LayerVote | None,
    inferred: list[str] | None,
) -> Iterator[SampleRecord]:
    """The records of each ``(file, read)``, one file at a time under its time budget (``read_file``:
    a file that cannot be read is a line in ``errors``), then what ``vote`` inferred, into ``inferred``."""
    for file, read in reads:
        done = read_file(file, errors, read)
        if done is not None:
            yield from done[0]
    if vote is not None and inferred is not None:
        inferred.extend(vote.notes())


def samples_label(start: int, end: int) -> str:
    """A group of the batch rows ``[start, end)`` named by what the dump has, the samples' indices
    (``samples 4-7``; ``sample 4`` alone), where the dump names groups only by their place."""
    return f"sample {start}" if end - start == 1 else f"samples {start}-{end - 1}"


def check_route_ids(routes: npt.NDArray[Any], source: str, field: str) -> None:
    """A padded route tensor holds integer ids."""
    if routes.dtype.kind not in "iu":
        raise LayoutError(f"{source}: field {field!r} is {dtype_name(routes)}; expected integer ids")


def route_widths(routes: npt.NDArray[Any], num_experts: int, source: str, field: str) -> tuple[int, int]:
    """``(num_layers, top_k)`` of a padded ``[B, S, layers, top_k]`` route tensor, each in range."""
    num_layers, top_k = int(routes.shape[2]), int(routes.shape[3])
    if not 1 <= num_layers <= MAX_LAYERS:
        raise LayoutError(f"{source}: field {field!r} has {num_layers} layers; expected 1..{MAX_LAYERS}")
    if not 1 <= top_k <= num_experts:
        raise LayoutError(f"{source}: top_k={top_k} ({field}); expected 1..num_experts={num_experts}")
    return num_layers, top_k


def check_logprobs(values: npt.NDArray[Any] | None, source: str, field: str) -> None:
    """A log-prob tensor the dump may hold is numbers."""
    if values is not None and values.dtype.kind not in "iuf":
        raise LayoutError(f"{source}: field {field!r} is {dtype_name(values)}; expected log-probabilities")


@dataclass(frozen=True)
class PaddedSample:
    """One sample of a padded batch dump: its batch row, its lengths, where its tokens start in the
    padded token axis, and its engine routes cut out of the padded route tensor."""

    index: int
    prompt: int
    response: int
    first: int
    engine: npt.NDArray[Any]
    captured: npt.NDArray[np.bool_]
    column: int

    def record(self, file: str, step: int, shape: RoutingShape, source: str, **columns: Any) -> SampleRecord:
        """The sample's record (decoder layer axis, key its batch row); ``columns``: the rest."""
        return SampleRecord(
            step=step,
            sample_key=str(self.index),
            prompt_len=self.prompt,
            response_len=self.response,
            layer_axis=LayerAxis.DECODER.value,
            source=source,
            engine_routes=self.engine,
            engine_captured=self.captured,
            origin=f"{file} batch row {self.index}",
            origin_column=self.column,
            **shape.fields(),
            **columns,
        )


def padded_samples(
    routes: npt.NDArray[Any],
    spans: Iterable[tuple[int, int, int, int, npt.NDArray[np.bool_] | None]],
    num_experts: int,
    file: str,
    step: int,
    errors: list[str] | None,
    r_max: int,
) -> list[PaddedSample]:
    """The samples of ``spans``, ``(batch row, prompt, response, first token column, rows with a route
    or None)`` each, their routes cut out of ``routes [B, S, L, K]``; a sample holding an id the run
    layout cannot store is a line in ``errors`` and left out (raised when ``errors`` is None).
    ``r_max``: the dump's response width; only a response that fills it may have been truncated
    (``payload_rows``)."""
    samples = []
    for i, prompt, response, first, present in spans:
        cut = response >= r_max
        engine, captured, column = payload_rows(routes[i], first, prompt + response, present, truncated=cut)
        if ids_fit(engine, num_experts, f"{file} batch row {i}", step, i, column, errors):
            samples.append(PaddedSample(i, prompt, response, first, engine, captured, column))
    return samples


def padded_layers(
    vote: LayerVote | None,
    moe_layers: tuple[int, ...] | None,
    step: int,
    samples: Sequence[PaddedSample],
    file: str,
    num_layers: int,
) -> tuple[int, ...]:
    """The MoE layers of one step's padded samples (``model_shape.step_layers``)."""
    places = [(f"{file} batch row {s.index}", s.engine, s.captured) for s in samples]
    return step_layers(vote, moe_layers, step, places, file, num_layers)
