"""Reading slime's debug dumps (``harness.audit.importers.slime``) before they are joined: the dict
each ``torch.save`` file holds, read through ``safe_pickle`` (never by torch), each field of a sample
checked as it is read, and the run's routing shape from a first pass over the rollout files.

Imports ``harness.audit``'s inputs and layout, the importers' ``base``, ``model_shape``,
``pickle_values`` and ``safe_pickle``, and ``harness.trace``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import pickle_values, safe_pickle
from harness.audit.importers.base import NO_ROUTES, RoutingShape
from harness.audit.importers.model_shape import ExpertVote, LayerVote, signature
from harness.audit.layout.inputs import brief, dtype_name, kind_name, read_file
from harness.audit.layout.schema import LayoutError
from harness.trace import MAX_LAYERS


def load_dump(path: Path) -> dict[str, Any]:
    """The dict ``torch.save`` wrote to ``path``, read by ``safe_pickle.load_torch`` (never by torch)."""
    payload = safe_pickle.load_torch(path)
    if not isinstance(payload, dict):
        raise LayoutError(f"{path}: holds {brief(payload)}; expected a dict with 'samples'")
    return payload


def dump_samples(payload: dict[str, Any], path: Path, step: int | None) -> list[dict[str, Any]]:
    """The ``samples`` list of a dump, its ``rollout_id`` checked against the file name."""
    samples = payload.get("samples")
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise LayoutError(f"{path}: field 'samples' is {kind_name(samples)}; expected a list of dicts")
    rollout_id = scalar(payload.get("rollout_id"))
    if step is not None and (not is_int(rollout_id) or rollout_id != step):
        raise LayoutError(
            f"{path}: field 'rollout_id' is {brief(rollout_id)}; expected {step} (from the file name)"
        )
    return samples


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def scalar(value: Any) -> Any:
    """A one-element array (a 0-d tensor) as its Python value; anything else as it is."""
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "biuf":
        return value.reshape(()).item()
    return value


def number_array(value: Any, where: str, field: str, kind: str) -> npt.NDArray[Any]:
    """``value`` (a tensor or numpy array, read as numpy, or nested lists of numbers) as int64
    (``kind`` ``"i"``) or float64 (``"f"``)."""
    allowed, what = ("iub", "integers") if kind == "i" else ("iuf", "numbers")
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        array = _from_lists(value, where, field)
    elif isinstance(value, (int, float)) and not (isinstance(value, int) and not -(2**63) <= value < 2**63):
        array = np.asarray(value)
    else:
        raise LayoutError(f"{where}: field {field!r} is {brief(value)}; expected {what} (a tensor or a list)")
    if array.dtype.kind not in allowed:
        raise LayoutError(f"{where}: field {field!r} holds {dtype_name(array)} values; expected {what}")
    return array.astype(np.int64 if kind == "i" else np.float64, copy=False)


def _from_lists(value: list[Any] | tuple[Any, ...], where: str, field: str) -> npt.NDArray[Any]:
    """Nested lists of numbers as an array, checked level by level before anything is allocated:
    rectangular, at most ``MAX_DIMS`` deep, numbers that fit 64 bits, and no list appearing twice (a
    pickle can repeat one list a million times in a few bytes; a dump's lists are all distinct)."""
    seen: set[int] = set()
    shape: list[int] = []
    level: list[Any] = [value]
    while level and isinstance(level[0], (list, tuple)):
        width = len(level[0])
        for item in level:
            if not isinstance(item, (list, tuple)) or len(item) != width:
                raise LayoutError(f"{where}: field {field!r} is ragged; expected a rectangular array")
            if id(item) in seen:
                raise LayoutError(f"{where}: field {field!r} repeats one list; expected distinct rows")
            seen.add(id(item))
        shape.append(width)
        if len(shape) > pickle_values.MAX_DIMS:
            raise LayoutError(f"{where}: field {field!r} is nested past {pickle_values.MAX_DIMS} levels")
        level = [x for item in level for x in item]
    for x in level:
        if isinstance(x, (list, tuple)):
            raise LayoutError(f"{where}: field {field!r} is ragged; expected a rectangular array")
        if not isinstance(x, (int, float)) or (isinstance(x, int) and not -(2**63) <= x < 2**63):
            raise LayoutError(f"{where}: field {field!r} holds {brief(x)}; expected numbers")
    return np.asarray(level).reshape(shape)


def vector(sample: dict[str, Any], field: str, where: str, kind: str, length: int | None) -> Any:
    """A 1-D field of ``length`` entries, ``None`` where the dump has none."""
    value = sample.get(field)
    if value is None:
        return None
    array = number_array(value, where, field, kind)
    if array.ndim != 1 or (length is not None and array.size != length):
        expected = "n" if length is None else length
        raise LayoutError(f"{where}: field {field!r} has shape {list(array.shape)}; expected [{expected}]")
    return array


def nonnegative(sample: dict[str, Any], field: str, where: str) -> int:
    value: Any = scalar(sample.get(field))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise LayoutError(f"{where}: field {field!r} is {brief(value)}; expected a non-negative integer")
    return value


def sequence(sample: dict[str, Any], response_field: str, where: str) -> tuple[npt.NDArray[np.int64], int]:
    """``tokens`` (prompt ⊕ response) and the response length, with a prompt of at least one token."""
    tokens = vector(sample, "tokens", where, "i", None)
    if tokens is None:
        raise LayoutError(f"{where}: field 'tokens' is missing; expected prompt ⊕ response token ids")
    if tokens.size and (int(tokens.min()) < -(2**31) or int(tokens.max()) >= 2**31):
        raise LayoutError(f"{where}: field 'tokens' holds an id outside int32; expected token ids")
    response = nonnegative(sample, response_field, where)
    if response >= tokens.size:
        raise LayoutError(
            f"{where}: field {response_field!r} is {response}; expected less than len(tokens) = {tokens.size}"
        )
    return tokens, response


def sample_routes(sample: dict[str, Any], where: str) -> npt.NDArray[np.int64] | None:
    value = sample.get("rollout_routed_experts")
    if value is None:
        return None
    routes = number_array(value, where, "rollout_routed_experts", "i")
    if routes.ndim != 3 or not 1 <= routes.shape[1] <= MAX_LAYERS or routes.shape[2] > 65536:
        raise LayoutError(
            f"{where}: field 'rollout_routed_experts' has shape {list(routes.shape)}; "
            "expected [len(tokens) − 1, num_layers, top_k]"
        )
    return routes


def routing_shape(
    files: list[tuple[int, Path]],
    num_experts: int | None,
    moe_layers: Sequence[int] | None,
    inferred: list[str] | None = None,
    errors: list[str] | None = None,
    bad: set[Path] | None = None,
) -> RoutingShape:
    """The routing shape: layers and top-k those of most rollout files (a damaged file cannot impose
    its own on the others); the rest given, or inferred in a full pass from what most samples agree
    on (``model_shape.LayerVote``, ``ExpertVote``), noted in ``inferred``. A file that cannot be
    read, or whose routes have another shape, goes to ``errors`` and ``bad`` (when given) and is left
    out."""
    known = num_experts is not None and moe_layers is not None
    scans: dict[Path, tuple[tuple[int, int], LayerVote, ExpertVote]] = {}
    for step, path in files:
        scanned = read_file(path, errors, partial(_scan, step, path, known))
        if scanned is None:
            if bad is not None:
                bad.add(path)
        elif scanned[0] is not None:
            scans[path] = scanned  # type: ignore[assignment]
    if not scans:
        return NO_ROUTES
    widths = Counter(width for width, _, _ in scans.values())  # insertion-ordered: ties go to the first
    layers, top_k = max(widths, key=lambda w: widths[w])
    vote, experts = LayerVote(step_name="rollout id"), ExpertVote()
    for path, (width, file_vote, file_experts) in scans.items():
        if width != (layers, top_k):
            message = (
                f"{path}: field 'rollout_routed_experts' has [rows, {width[0]}, {width[1]}]; expected "
                f"[rows, {layers}, {top_k}] like most rollout files"
            )
            if errors is None:
                raise LayoutError(message)
            errors.append(message)
            if bad is not None:
                bad.add(path)
            continue
        vote.merge(file_vote)
        experts.merge(file_experts)
    notes: list[str] = []
    if moe_layers is None:
        chosen = vote.decide() if vote.steps else None
        chosen = chosen or tuple(range(layers))  # every layer all-zero: moe_layer_nonzero names them
        notes += vote.notes()
    else:
        chosen = tuple(int(x) for x in moe_layers)
    if num_experts is None:
        num_experts = experts.decide(top_k)
        notes += experts.notes(num_experts)
    if inferred is not None:
        inferred.extend(notes)
    if list(chosen) != sorted(set(chosen)) or chosen[0] < 0 or chosen[-1] >= layers:
        raise LayoutError(
            f"moe_layers: {list(chosen)}; expected distinct increasing decoder indices in [0, {layers})"
        )
    if not top_k <= num_experts <= 65536:
        raise LayoutError(f"num_experts: {num_experts}; expected an integer in [top_k={top_k}, 65536]")
    return RoutingShape(int(num_experts), top_k, layers, chosen)


def _scan(step: int, path: Path, first_only: bool) -> tuple[tuple[int, int] | None, LayerVote, ExpertVote]:
    """One rollout file's routes: their ``(layers, top_k)``, the same for all its samples, and its
    samples' votes on the MoE layers and the expert count (``first_only``: the shape alone)."""
    width = None
    vote, experts = LayerVote(step_name="rollout id"), ExpertVote()
    for i, sample in enumerate(dump_samples(load_dump(path), path, None)):
        routes = sample_routes(sample, f"{path}: samples[{i}]")
        if routes is None:
            continue
        if width is None:
            width = (int(routes.shape[1]), int(routes.shape[2]))
            if first_only:
                break
        if routes.shape[1:] != width:
            raise LayoutError(
                f"{path}: samples[{i}] field 'rollout_routed_experts' has shape {list(routes.shape)}; "
                f"expected [rows, {width[0]}, {width[1]}] like the samples before it"
            )
        place = f"{path} samples[{i}]"
        vote.add(step, signature(routes), place)
        experts.add(routes, place)
    return width, vote, experts
