"""What the SkyRL and verl dumps do not record, taken from the caller; and their payload rows.

Neither dump holds the model's expert count or which decoder layers are MoE: ``num_experts`` comes
from the caller (``rrh audit --num-experts``, or ``$RRH_NUM_EXPERTS``) and is never inferred from
the ids (an id wrapped into ``[E, 256)`` would raise the bound and hide itself); ``moe_layers``
comes from the caller or is inferred from the layers most samples route on (``LayerVote``: one
sample shifted onto a dense layer does not move it). Both dumps keep a
sample's engine rows in a padded, zero-filled row axis: ``payload_rows`` cuts them out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout.schema import LayoutError
from harness.trace import storage_dtype

NUM_EXPERTS_ENV = "RRH_NUM_EXPERTS"
MOE_LAYERS_ENV = "RRH_MOE_LAYERS"


def num_experts_input(num_experts: int | None, framework: str) -> int:
    """``num_experts`` from the argument, else ``$RRH_NUM_EXPERTS``; ``LayoutError`` when neither says.

    Never inferred from the ids: an id wrapped into ``[E, 256)`` would raise the bound and hide itself.
    """
    if num_experts is None:
        text = os.environ.get(NUM_EXPERTS_ENV)
        if text is None:
            raise LayoutError(
                f"num_experts: a {framework} dump does not record it; expected records(path, num_experts=E) "
                f"or {NUM_EXPERTS_ENV}=E (the model config's num_experts / n_routed_experts)"
            )
        try:
            num_experts = int(text)
        except ValueError:
            raise LayoutError(f"{NUM_EXPERTS_ENV}={text!r}: expected an integer number of experts") from None
    if not 1 <= int(num_experts) <= 65536:
        raise LayoutError(f"num_experts: {num_experts}; expected an integer in [1, 65536]")
    return int(num_experts)


def moe_layers_input(moe_layers: Sequence[int] | None) -> tuple[int, ...] | None:
    """Decoder indices of the MoE layers from the argument, else ``$RRH_MOE_LAYERS`` (``"1-47"``,
    ``"0,2,4"``), else ``None`` (inferred from the dump)."""
    if moe_layers is not None:
        return tuple(int(x) for x in moe_layers)
    text = os.environ.get(MOE_LAYERS_ENV)
    if text is None:
        return None
    layers: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise LayoutError(
            f"{MOE_LAYERS_ENV}={text!r}: expected decoder indices like '1-47' or '0,2,4'"
        ) from None
    return tuple(layers)


def signature(
    routes: npt.NDArray[Any], captured: npt.NDArray[np.bool_] | None = None
) -> tuple[int, ...] | None:
    """The decoder layers with a non-zero id in some captured row of one sample's ``routes [rows, L, K]``
    (dense slots are 0), or ``None`` for a sample with no captured row (it has no say)."""
    chosen = routes if captured is None else routes[captured]
    if chosen.shape[0] == 0:
        return None
    return tuple(int(x) for x in np.flatnonzero(chosen.any(axis=(0, 2))))


def layer_span(layers: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1-3,5"`` (the ``--moe-layers`` syntax); ``()`` → ``"none"``."""
    parts: list[str] = []
    values = list(layers)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts) or "none"


SHOWN = 3
"""Disagreeing samples named in an inference note (all of them are judged by the checks)."""


class LayerVote:
    """The MoE layers a dump does not record, inferred from what most samples agree on.

    Each sample votes with its ``signature`` (the layers it routes on); the layout of a step is
    the signature most of its samples hold, so one sample shifted onto a dense layer, or with an
    all-zero MoE layer, does not move it. The run is judged against one layout (a model has one):
    ``decide`` picks it, and ``notes`` say what was inferred, how many samples agree, and which do
    not (the checks then report those at their place: ``dense_empty``, ``moe_layer_nonzero``).
    """

    def __init__(self, flag: str = "--moe-layers", step_name: str = "step") -> None:
        self.flag = flag
        self.step_name = step_name
        """What a step is in the dump, as its lines say it (slime: ``rollout id``)."""
        self.steps: dict[int, dict[tuple[int, ...], list[str]]] = {}
        self.layers: tuple[int, ...] | None = None
        self.decided_by = ""

    def add(self, step: int, layers: tuple[int, ...] | None, place: str) -> None:
        if layers is not None:
            self.steps.setdefault(step, {}).setdefault(layers, []).append(place)

    def merge(self, other: LayerVote) -> None:
        """Add ``other``'s votes (a file's, counted apart until its shape was known to be the run's)."""
        for step, votes in other.steps.items():
            for layers, places in votes.items():
                self.steps.setdefault(step, {}).setdefault(layers, []).extend(places)

    def winner(self, steps: Sequence[int] | None = None) -> tuple[tuple[int, ...], int, int] | None:
        """``(layers, samples holding them, samples voting)`` over ``steps`` (default all); ``None``
        when no sample voted. ``LayoutError`` on a tie: no layout most samples agree on."""
        counts: dict[tuple[int, ...], int] = {}
        for step in self.steps if steps is None else steps:
            for layers, places in self.steps.get(step, {}).items():
                counts[layers] = counts.get(layers, 0) + len(places)
        if not counts:
            return None
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
            where = f"{self.step_name} {steps[0]}" if steps is not None and len(steps) == 1 else "the dump"
            raise LayoutError(
                f"moe_layers: in {where} as many samples route on layers {layer_span(ranked[0][0])} as on "
                f"{layer_span(ranked[1][0])} ({ranked[0][1]} each); expected a layout most samples agree "
                f"on, or {self.flag} (the model's MoE layers)"
            )
        return ranked[0][0], ranked[0][1], sum(counts.values())

    def decide(self, steps: Sequence[int] | None = None) -> tuple[int, ...] | None:
        """Fix the run's layout to the winner over ``steps`` (``None`` while no sample voted)."""
        best = self.winner(steps)
        if best is None:
            return None
        if not best[0]:
            raise LayoutError(
                f"moe_layers: every captured route is zero, so the MoE layers cannot be inferred; "
                f"expected {self.flag} or {MOE_LAYERS_ENV}"
            )
        self.layers = best[0]
        chosen = sorted(self.steps) if steps is None else list(steps)
        name = self.step_name
        span = f"{name}s {chosen[0]}-{chosen[-1]}" if chosen else ""
        self.decided_by = f"{name} {chosen[0]}" if len(chosen) == 1 else span
        return self.layers

    def notes(self) -> list[str]:
        """What was inferred, in a line a user can check, with the samples that disagree."""
        if self.layers is None:
            return []
        agree = total = 0
        others: list[str] = []
        odd_steps: list[str] = []
        for step in sorted(self.steps):
            votes = self.steps[step]
            for layers, places in sorted(votes.items()):
                total += len(places)
                if layers == self.layers:
                    agree += len(places)
                else:
                    others += [f"{p} (layers {layer_span(layers)})" for p in places]
            best = max(votes.items(), key=lambda kv: (len(kv[1]), kv[0]))[0]
            if best != self.layers:
                odd_steps.append(f"{self.step_name} {step} (most of its samples route on {layer_span(best)})")
        line = (
            f"moe_layers {layer_span(self.layers)}: inferred ({self.flag} not given) as the layers most "
            f"samples route on ({self.decided_by}); {agree} of {total} samples agree"
        )
        if others:
            shown = "; ".join(others[:SHOWN]) + (
                f"; and {len(others) - SHOWN} more" if len(others) > SHOWN else ""
            )
            line += f"; the others are judged against it: {shown}"
        lines = [line]
        if odd_steps:
            lines.append(
                f"moe_layers: {', '.join(odd_steps)} disagree with the inferred {layer_span(self.layers)}; "
                f"give {self.flag} if the model's layers are not {layer_span(self.layers)}"
            )
        return lines


class ExpertVote:
    """The expert count a dump does not record, inferred so that one sample cannot raise it.

    ``E = 1 +`` the largest id that more than one sample uses (the largest id of all when only one
    sample has routes): an id only one sample holds (out of range, or wrapped into ``[E, 2**bits)``)
    does not move the bound; the checks then name it (``ids_valid``) at its place.
    """

    def __init__(self) -> None:
        self.users: dict[int, int] = {}
        self.first: dict[int, str] = {}
        self.samples = 0

    def add(self, routes: npt.NDArray[Any], place: str, layers: Sequence[int] | None = None) -> None:
        chosen = routes if layers is None else routes[:, list(layers)]
        if chosen.size == 0:
            return
        self.samples += 1
        for value in np.unique(chosen).tolist():
            self.users[value] = self.users.get(value, 0) + 1
            self.first.setdefault(value, place)

    def merge(self, other: ExpertVote) -> None:
        """Add ``other``'s votes (a file's, counted apart until its shape was known to be the run's)."""
        self.samples += other.samples
        for value, count in other.users.items():
            self.users[value] = self.users.get(value, 0) + count
            self.first.setdefault(value, other.first[value])

    def decide(self, top_k: int) -> int:
        if not self.users:
            return top_k
        shared = [v for v, n in self.users.items() if n > 1]
        high = max(shared) if shared and self.samples > 1 else max(self.users)
        return max(high + 1, top_k)

    def notes(self, num_experts: int) -> list[str]:
        beyond = sorted(v for v in self.users if v >= num_experts)
        line = (
            f"num_experts {num_experts}: inferred (--num-experts not given) as 1 + the largest id more than "
            f"one sample uses ({self.samples} samples with routes)"
        )
        if beyond:
            shown = "; ".join(f"id {v} in {self.first[v]}" for v in beyond[:SHOWN])
            more = f"; and {len(beyond) - SHOWN} more ids" if len(beyond) > SHOWN else ""
            line += f"; ids past it, each in one sample, are judged out of range: {shown}{more}"
        return [line]


def check_moe_layers(moe_layers: tuple[int, ...], num_layers: int, source: str) -> None:
    if (
        not moe_layers
        or list(moe_layers) != sorted(set(moe_layers))
        or not 0 <= moe_layers[0] <= moe_layers[-1] < num_layers
    ):
        raise LayoutError(
            f"{source}: moe_layers {list(moe_layers)}; expected distinct increasing decoder indices in "
            f"[0, {num_layers}) (the layer axis of the routes)"
        )


def payload_rows(
    rows: npt.NDArray[Any],
    first: int,
    length: int,
    has_route: npt.NDArray[np.bool_] | None = None,
    *,
    truncated: bool = True,
) -> tuple[npt.NDArray[Any], npt.NDArray[np.bool_], int]:
    """The engine rows of a sample, which hold a captured route, and the index in ``rows`` of the first
    (``first`` unless the payload starts before the sample: a place names that index, the cell the
    user finds in the file).

    ``rows [S, L, K]`` is the sample's padded row axis; position 0 of its ``length = P+R`` tokens
    is at index ``first``. ``has_route`` marks rows the dump says were captured; without it (zero
    filler) the payload runs from position 0 to the last non-zero row. The result covers positions
    ``[0, P+R−1)``; rows the payload left empty are not captured. A payload the dump placed outside
    the sample (before position 0, or past the last token) is kept, so coverage names its row count:
    never cut to fit. A real row for the last token is dropped only where the response may have been
    truncated (``truncated``: it fills the dump's response budget), where §3.1 allows it; a response
    that ended before its budget was never forwarded past its last token, so such a row is kept and
    coverage names it (a duplicated resume row, another sample's payload). Rows not captured are
    returned as zeros, whatever filler the dump held (SkyRL after 0.3.0: ``arange(K)``).
    """
    expected = length - 1
    captured_axis: npt.NDArray[np.bool_] = (
        np.asarray(rows.reshape(rows.shape[0], -1).any(axis=1)) if has_route is None else has_route
    )
    present = np.flatnonzero(captured_axis)
    if present.size == 0:
        return np.zeros_like(rows[first : first + expected]), np.zeros(expected, dtype=bool), first
    lo, hi = min(first, int(present[0])), int(present[-1]) + 1
    if has_route is None:
        captured_axis = np.zeros(rows.shape[0], dtype=bool)
        captured_axis[lo:hi] = True
    end = max(first + expected, hi - 1 if truncated and hi == first + length else hi)
    payload, captured = rows[lo:end], captured_axis[lo:end]
    if has_route is not None and not captured.all():
        payload = np.where(captured[:, None, None], payload, 0).astype(rows.dtype)
    return payload, captured, lo


def ids_fit(
    routes: npt.NDArray[Any],
    num_experts: int,
    place: str,
    step: int,
    sample: int,
    column: int | None,
    errors: list[str] | None,
) -> bool:
    """Whether every id of one sample's ``routes [rows, L, K]`` can be stored in the run layout's dtype
    for ``num_experts``.

    Ids in ``[num_experts, 2**bits)`` are stored and reported by the audit (``ids_valid``); a negative
    id (an int16 wrap) or one past the dtype has no representation there. Such a sample is an input
    error naming its cell: ``place`` (the framework's file and the sample's index in it), the token
    column of the row where the file has a padded token axis (``column``: that of row 0), then step,
    sample, row and layer. It is raised when ``errors`` is None; else it is a line there and the
    sample is left out, so the other samples of its file are still imported and audited.
    """
    limit = int(np.iinfo(storage_dtype(num_experts)).max)
    bad = (routes < 0) | (routes > limit)
    if not bad.any():
        return True
    row, layer, slot = (int(x) for x in np.argwhere(bad)[0])
    where = place if column is None else f"{place}, token column {column + row}"
    message = (
        f"{where}: step {step} sample {sample} row {row} layer {layer}: expert id "
        f"{int(routes[row, layer, slot])}; expected an id in [0, {num_experts}) (num_experts={num_experts}; "
        f"the run layout stores ids up to {limit})"
    )
    if errors is None:
        raise LayoutError(message)
    errors.append(message)
    return False


def step_layers(
    vote: LayerVote | None,
    moe_layers: tuple[int, ...] | None,
    step: int,
    samples: Sequence[tuple[str, npt.NDArray[Any], npt.NDArray[np.bool_] | None]],
    source: str,
    num_layers: int,
) -> tuple[int, ...]:
    """The MoE layers to write one step's records with, checked against the ``num_layers`` decoder
    layers of the routes: the given ones, or the samples' votes (``vote``, a fresh one when neither
    is given) — the first step with a captured route decides the run's layout, every step after it
    votes too (for ``LayerVote.notes``). ``samples``: ``(place, routes, captured)`` of each."""
    if vote is None and moe_layers is not None:
        check_moe_layers(moe_layers, num_layers, source)
        return moe_layers
    vote = LayerVote() if vote is None else vote
    for place, routes, captured in samples:
        vote.add(step, signature(routes, captured), place)
    if vote.layers is None and vote.decide([step]) is None:
        raise LayoutError(
            f"{source}: no sample of step {step} has a captured route, so the MoE layers cannot be inferred "
            f"from it; expected {vote.flag} (or {MOE_LAYERS_ENV})"
        )
    assert vote.layers is not None
    check_moe_layers(vote.layers, num_layers, source)
    return vote.layers
