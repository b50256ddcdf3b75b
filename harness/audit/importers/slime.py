"""slime / miles debug dumps → the run layout (FACTS §7).

What the dumps hold (read in THUDM/slime and radixark/miles, never imported):

- ``--save-debug-rollout-data T`` (``--dump-details D`` sets ``T = D/rollout_data/{rollout_id}.pt``,
  ``slime/utils/arguments.py``) writes, per rollout, ``torch.save({"rollout_id": id, "samples":
  [Sample.to_dict(), ...]})`` (``slime/observability/rollout_data_utils.py``; miles adds a
  ``metadata`` dict, ``miles/ray/rollout/debug_data.py``). A sample dict has ``tokens`` (prompt ⊕
  response, tool tokens included), ``response_length``, ``loss_mask`` (``None``: every response
  token is trained), ``rollout_log_probs`` (the engine's, one per response token, 0.0 on tool
  tokens), ``remove_sample`` (its loss mask is zeroed for training, ``slime/ray/rollout.py``),
  ``group_index`` and ``rollout_routed_experts`` ``[len(tokens) − 1, num_layers, top_k]`` int32 on
  the decoder axis (every hidden layer, dense layers 0): a torch tensor in slime, a numpy array in
  miles. Partial rollouts splice it in ``Sample._apply_meta_info`` (``slime/utils/types.py``:
  ``existing[:routed_experts_start_len]`` ⊕ the new rows), so it always starts at position 0.
- ``--save-debug-train-data`` (``D/train_data/{rollout_id}.pt``) writes, per rollout, format_version
  2 (``slime/observability/train_data_utils.py`` ``_build_dump_payload``): the DP shards gathered
  on the DP source rank into one ``samples`` list, each with ``rollout_position`` (its index in
  the rollout dump's ``samples``; ``sample_index`` = ``Sample.index`` where that is missing),
  ``tokens``, ``total_lengths``, ``response_lengths``, ``loss_masks``, ``rollout_log_probs`` and
  ``log_probs`` (the trainer's, CP shards reassembled). The routes are deleted before the dump
  (``slime/backends/megatron_utils/actor.py``). Older per-rank dumps (slime before #2266, miles)
  hold CP-sliced, unordered shards and are refused.

A step is a rollout id; a sample is keyed by its position in the rollout dump, the key both files
share. Files are read one rollout at a time (its rollout file and its train file), through
``safe_pickle.load_torch``: the archive's pickle read by the harness's own allowlist unpickler
(plain containers, tensors decoded into numpy, numeric numpy arrays such as miles' routes; object
arrays are never rebuilt), never by torch. A file that cannot be read is one error naming it; with
``errors=`` the other rollouts are still read.

Missing rows: slime pads the last position (which has no route) and the packing remainder with
``arange % num_experts`` *at replay* (``_pad_routed_experts`` in
``slime/backends/megatron_utils/cp_utils.py``). That filler is built from the dumped rows and
never written, so every row in the dump is a captured route: ``engine_captured`` stays null. The
filler replayed for the last position is invisible to an audit of the dump.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import pickle_values, safe_pickle
from harness.audit.importers.base import NO_ROUTES, RoutingShape
from harness.audit.importers.model_shape import ExpertVote, LayerVote, ids_fit, signature
from harness.audit.inputs import brief, check_step, glob, read_file
from harness.audit.layout import LayoutError, SampleRecord
from harness.trace import MAX_LAYERS, LayerAxis

DESCRIPTION = (
    "slime/miles debug dump: --save-debug-rollout-data (or --dump-details D: D/rollout_data/{id}.pt), "
    "joined with --save-debug-train-data format_version 2 (D/train_data/{id}.pt) where present"
)
NOTES = (
    "every dumped route row is a captured route: slime's arange % E filler for the last position and "
    "packing pads is built at replay (cp_utils._pad_routed_experts), never dumped, so it cannot be checked",
    "num_experts and the MoE layers are not in the dump: without --num-experts and --moe-layers they are "
    "inferred from what most samples agree on (1 + the largest id more than one sample uses; the layers most "
    "samples route on), so ids are checked against that bound, not the model's expert count, and a MoE "
    "layer all-zero in most samples reads as dense",
    "trainer tokens and log-probs come only from a format_version 2 train dump beside the rollout dump; "
    "no trainer routes, replay mode or attempt boundaries are dumped: replay fidelity, agreement, "
    "splice consistency and shard union are not checkable",
    "evaluation dumps (eval_{id}.pt) are skipped: they were never trained on",
)
HINTS = {
    "engine_routes": "rollout_routed_experts (--use-rollout-routing-replay with --save-debug-rollout-data)",
    "engine_logprobs": "rollout_log_probs of each sample in the rollout dump",
    "trainer_tokens": "the tokens the trainer consumed: slime --save-debug-train-data (format_version 2, "
    "D/train_data/{rollout_id}.pt beside the rollout dump)",
    "trainer_logprobs": "the trainer's log_probs: slime --save-debug-train-data (format_version 2)",
    "trainer_routes": "what the trainer dispatched: nothing in slime writes it (the train dump drops the "
    "routes); harness.audit.tap writes it",
    "replay": "the replay mode of each row: nothing in slime's dumps says it; harness.audit.tap writes it",
    "group_key": "the prompt's group: group_index of each sample",
    "attempt payloads": "each attempt's own engine payload: nothing in slime writes it "
    "(Sample._apply_meta_info splices them); harness.audit.tap writes them",
    "shard positions": "per-rank shards with their positions: nothing in slime writes them (format_version 2 "
    "reassembles CP shards); harness.audit.tap writes them",
}
"""What writes each column an invariant may miss, said for slime (``AuditResult`` lines use it)."""
SOURCE = "slime/miles --save-debug-rollout-data"
SOURCE_PREFIXES = ("slime",)
"""The ``source`` of the records this importer writes (``hints_for`` tells a re-audited import by it)."""
TRAIN_FORMAT_VERSION = 2
_ID = re.compile(r"(\d+)$")


def detect(path: Path) -> bool:
    """A ``.pt`` file, a ``--dump-details`` directory, or a directory of rollout ``.pt`` files."""
    if path.is_file():
        return path.suffix == ".pt"
    if not path.is_dir():
        return False
    if any(any((path / sub).glob("*.pt")) for sub in ("rollout_data", "train_data")):
        return True
    # A rollout file's name ends in its id; Megatron-LM's router_state_rank{r}.pt sidecar is no dump.
    return any(_ID.search(p.stem) and not p.name.startswith("router_state_rank") for p in path.glob("*.pt"))


def records(
    path: Path,
    *,
    train: str | Path | None = None,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    errors: list[str] | None = None,
    inferred: list[str] | None = None,
) -> Iterator[SampleRecord]:
    """The samples of the dump at ``path``, one rollout file at a time, joined with the train dump.

    ``path`` is a ``--dump-details`` directory (``rollout_data/`` and/or ``train_data/``), a
    directory of rollout files, or one rollout file. ``train`` is the train dump when it is not
    ``path/train_data``: a directory of ``{rollout_id}.pt`` or the ``--save-debug-train-data``
    template itself (``.../{rollout_id}.pt``). ``num_experts`` and ``moe_layers`` (decoder indices)
    are the model's; left out, they are inferred from the routes in a first pass from what most
    samples agree on (see ``NOTES``), and what was inferred is appended to ``inferred``. ``errors``:
    see ``harness.audit.importers`` (a damaged file is a line there, the others are read).
    """
    path = Path(path)
    rollout_files, template = _files(path, train, errors)
    if not rollout_files:
        train_files = _numbered(path / "train_data", errors)
        if not train_files:
            if errors:  # every file was refused: each is named there
                return
            raise LayoutError(
                f"{path}: no rollout or train dump; expected rollout_data/{{rollout_id}}.pt, "
                "train_data/{rollout_id}.pt or rollout .pt files"
            )
        yield from _train_only(train_files, errors)
        return
    bad: set[Path] = set()
    shape = _model_shape(rollout_files, num_experts, moe_layers, inferred, errors, bad)
    for step, rollout_path in rollout_files:
        if rollout_path in bad:
            continue
        train_path = Path(template.format(rollout_id=step)) if template else None
        read = read_file(
            rollout_path, errors, partial(_rollout, step, rollout_path, train_path, shape, errors)
        )
        yield from read or ()
        del read  # one rollout in memory: free this one before the next is loaded


def _rollout(
    step: int,
    rollout_path: Path,
    train_path: Path | None,
    shape: RoutingShape,
    errors: list[str] | None = None,
) -> list[SampleRecord]:
    """The records of one rollout file joined with its train file (when there is one), all or none —
    but a sample holding an id the run layout cannot store, which is a line in ``errors`` and left
    out (``model_shape.ids_fit``; raised when ``errors`` is None)."""
    check_step(step, str(rollout_path))
    samples = _samples(_load(rollout_path), rollout_path, step)
    trained = _train_samples(train_path, step, samples) if train_path and _exists(train_path) else {}
    records = (
        _record(step, position, sample, trained.get(position), shape, rollout_path, train_path, errors)
        for position, sample in enumerate(samples)
    )
    return [record for record in records if record is not None]


def _exists(path: Path) -> bool:
    """Whether anything is at ``path``: a FIFO, a directory or a dangling link there is read, and refused."""
    try:
        return path.is_symlink() or path.exists()
    except OSError:
        return True


def _files(
    path: Path, train: str | Path | None, errors: list[str] | None = None
) -> tuple[list[tuple[int, Path]], str | None]:
    """``(rollout id, file)`` of every rollout file, in id order, and the train dump's template."""
    if path.is_file():
        found = [path]
    elif (path / "rollout_data").is_dir() or (path / "train_data").is_dir():
        found = glob(path / "rollout_data", "*.pt") if (path / "rollout_data").is_dir() else []
        train = path / "train_data" if train is None else train
    elif path.is_dir():
        found = [p for p in glob(path, "*.pt") if not p.name.startswith("router_state_rank")]
    else:
        raise LayoutError(f"{path}: no such file or directory; expected a slime debug dump")
    files = []
    for file in found:
        if "eval_" in file.stem:
            continue
        match = _ID.search(file.stem)
        if match is None:
            message = (
                f"{file}: the file name holds no rollout id; expected a name ending in it "
                "(--save-debug-rollout-data .../{rollout_id}.pt)"
            )
            if errors is None:
                raise LayoutError(message)
            errors.append(message)
            continue
        files.append((int(match.group(1)), file))
    if len({step for step, _ in files}) != len(files):
        raise LayoutError(f"{path}: two rollout files carry one rollout id; expected one file per rollout")
    template = None
    if train is not None:
        text = str(train)
        template = text if "{" in text else str(Path(text) / "{rollout_id}.pt")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError:
            fields = {"?"}
        if fields != {"rollout_id"}:
            raise LayoutError(
                f"train={text!r}: template fields {sorted(fields)}; expected only {{rollout_id}} (one train "
                "file per rollout, as slime's --dump-details writes)"
            )
    return sorted(files), template


def _load(path: Path) -> dict[str, Any]:
    """The dict ``torch.save`` wrote to ``path``, read by ``safe_pickle.load_torch`` (never by torch)."""
    payload = safe_pickle.load_torch(path)
    if not isinstance(payload, dict):
        raise LayoutError(f"{path}: holds a {type(payload).__name__}; expected a dict with 'samples'")
    return payload


def _samples(payload: dict[str, Any], path: Path, step: int | None) -> list[dict[str, Any]]:
    """The ``samples`` list of a dump, its ``rollout_id`` checked against the file name."""
    samples = payload.get("samples")
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise LayoutError(f"{path}: field 'samples' is {type(samples).__name__}; expected a list of dicts")
    rollout_id = _scalar(payload.get("rollout_id"))
    if step is not None and (not _is_int(rollout_id) or rollout_id != step):
        raise LayoutError(
            f"{path}: field 'rollout_id' is {brief(rollout_id)}; expected {step} (from the file name)"
        )
    return samples


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _scalar(value: Any) -> Any:
    """A one-element array (a 0-d tensor) as its Python value; anything else as it is."""
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "biuf":
        return value.reshape(()).item()
    return value


def _array(value: Any, where: str, field: str, kind: str) -> npt.NDArray[Any]:
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
        raise LayoutError(f"{where}: field {field!r} holds {array.dtype} values; expected {what}")
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


def _vector(sample: dict[str, Any], field: str, where: str, kind: str, length: int | None) -> Any:
    """A 1-D field of ``length`` entries, ``None`` where the dump has none."""
    value = sample.get(field)
    if value is None:
        return None
    array = _array(value, where, field, kind)
    if array.ndim != 1 or (length is not None and array.size != length):
        expected = "n" if length is None else length
        raise LayoutError(f"{where}: field {field!r} has shape {list(array.shape)}; expected [{expected}]")
    return array


def _count(sample: dict[str, Any], field: str, where: str) -> int:
    value: Any = _scalar(sample.get(field))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise LayoutError(f"{where}: field {field!r} is {brief(value)}; expected a non-negative integer")
    return value


def _sequence(sample: dict[str, Any], response_field: str, where: str) -> tuple[npt.NDArray[np.int64], int]:
    """``tokens`` (prompt ⊕ response) and the response length, with a prompt of at least one token."""
    tokens = _vector(sample, "tokens", where, "i", None)
    if tokens is None:
        raise LayoutError(f"{where}: field 'tokens' is missing; expected prompt ⊕ response token ids")
    if tokens.size and (int(tokens.min()) < -(2**31) or int(tokens.max()) >= 2**31):
        raise LayoutError(f"{where}: field 'tokens' holds an id outside int32; expected token ids")
    response = _count(sample, response_field, where)
    if response >= tokens.size:
        raise LayoutError(
            f"{where}: field {response_field!r} is {response}; expected less than len(tokens) = {tokens.size}"
        )
    return tokens, response


def _routes(sample: dict[str, Any], where: str) -> npt.NDArray[np.int64] | None:
    value = sample.get("rollout_routed_experts")
    if value is None:
        return None
    routes = _array(value, where, "rollout_routed_experts", "i")
    if routes.ndim != 3 or not 1 <= routes.shape[1] <= MAX_LAYERS or routes.shape[2] > 65536:
        raise LayoutError(
            f"{where}: field 'rollout_routed_experts' has shape {list(routes.shape)}; "
            "expected [len(tokens) − 1, num_layers, top_k]"
        )
    return routes


def _model_shape(
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
    vote, experts = LayerVote(), ExpertVote()
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
    vote, experts = LayerVote(), ExpertVote()
    for i, sample in enumerate(_samples(_load(path), path, None)):
        routes = _routes(sample, f"{path}: samples[{i}]")
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


def _train_payload(path: Path) -> dict[str, Any]:
    """A train dump of format_version 2, the only one whose samples are whole and in rollout order."""
    payload = _load(path)
    version = _scalar(payload.get("format_version"))
    if not _is_int(version) or version != TRAIN_FORMAT_VERSION:
        raise LayoutError(
            f"{path}: field 'format_version' is {brief(version)}; expected {TRAIN_FORMAT_VERSION} "
            "(slime ≥ #2266; per-rank train dumps of older slime and of miles hold CP-sliced shards and are "
            "not read)"
        )
    return payload


def _train_samples(path: Path, step: int, rollout: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The train dump's samples by their position in the rollout dump (``rollout_position``)."""
    samples = _samples(_train_payload(path), path, step)
    by_index = {index: i for i, s in enumerate(rollout) if _is_int(index := _scalar(s.get("index")))}
    out: dict[int, dict[str, Any]] = {}
    for i, sample in enumerate(samples):
        where = f"{path}: samples[{i}]"
        if sample.get("rollout_position") is not None:
            position = _count(sample, "rollout_position", where)
        elif _is_int(index := _scalar(sample.get("sample_index"))) and index in by_index:
            position = by_index[index]
        else:
            raise LayoutError(
                f"{where}: fields 'rollout_position' and 'sample_index' are missing or unknown; expected "
                "one of them to join the sample with the rollout dump"
            )
        if position >= len(rollout) or position in out:
            raise LayoutError(
                f"{where}: field 'rollout_position' is {position}; expected a distinct index below "
                f"{len(rollout)} (the rollout dump's samples)"
            )
        out[position] = sample
    return out


def _record(
    step: int,
    position: int,
    sample: dict[str, Any],
    trained: dict[str, Any] | None,
    shape: RoutingShape,
    path: Path,
    train_path: Path | None,
    errors: list[str] | None = None,
) -> SampleRecord | None:
    """One layout record from a rollout sample and, where it was trained, its train sample; ``None``
    for a sample whose routes hold an id the layout cannot store (a line in ``errors``)."""
    where = f"{path}: samples[{position}]"
    tokens, response = _sequence(sample, "response_length", where)
    mask = _vector(sample, "loss_mask", where, "i", response)
    mask = np.ones(response, dtype=bool) if mask is None else mask != 0
    removed = _scalar(sample.get("remove_sample"))
    if not isinstance(removed, (bool, int, type(None))):
        raise LayoutError(f"{where}: field 'remove_sample' is {brief(removed)}; expected a boolean")
    if removed:
        mask[:] = False  # slime/ray/rollout.py zeroes a removed sample's loss mask
    engine_lp = _vector(sample, "rollout_log_probs", where, "f", response)
    routes = _routes(sample, where)
    if routes is not None:
        _check_shape(routes, shape, where)
        if not ids_fit(
            routes, shape.num_experts, f"{path} samples[{position}]", step, position, None, errors
        ):
            return None
    trainer_tokens = trainer_lp = None
    if trained is not None:
        twhere = f"{train_path}: samples[rollout_position={position}]"
        trainer_tokens, trained_response = _sequence(trained, "response_lengths", twhere)
        if trainer_tokens.size != tokens.size or trained_response != response:
            raise LayoutError(
                f"{twhere}: fields 'tokens', 'response_lengths' describe {trainer_tokens.size} tokens with "
                f"{trained_response} in the response; expected {tokens.size} with {response} (the rollout "
                "dump's sample)"
            )
        trained_mask = _vector(trained, "loss_masks", twhere, "i", response)
        mask = mask if trained_mask is None else trained_mask != 0
        trainer_lp = _vector(trained, "log_probs", twhere, "f", response)
    group = _scalar(sample.get("group_index"))
    if not (group is None or _is_int(group) or (isinstance(group, str) and len(group) <= 256)):
        raise LayoutError(f"{where}: field 'group_index' is {brief(group)}; expected an integer")
    return SampleRecord(
        step=step,
        sample_key=str(position),
        group_key=None if group is None else str(group),
        prompt_len=int(tokens.size - response),
        response_len=response,
        tokens=tokens,
        trainer_tokens=trainer_tokens,
        loss_mask=mask,
        engine_logprobs=engine_lp,
        trainer_logprobs=trainer_lp,
        **shape.fields(),
        layer_axis=LayerAxis.DECODER.value,
        engine_routes=routes,
        source=SOURCE if trained is None else f"{SOURCE} + --save-debug-train-data",
        origin=f"{path} samples[{position}]",
    )


def _check_shape(routes: npt.NDArray[np.int64], shape: RoutingShape, where: str) -> None:
    """Routes of the run's layer and top-k widths (the ids are checked by ``model_shape.ids_fit``)."""
    if routes.shape[1:] != (shape.num_layers, shape.top_k):
        raise LayoutError(
            f"{where}: field 'rollout_routed_experts' has shape {list(routes.shape)}; expected "
            f"[rows, {shape.num_layers}, {shape.top_k}] like the samples before it"
        )


def _numbered(directory: Path, errors: list[str] | None = None) -> list[tuple[int, Path]]:
    """``(rollout id, file)`` of the ``{rollout_id}.pt`` files of ``directory``, in id order."""
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in glob(directory, "*.pt") if (m := _ID.fullmatch(p.stem)))


def _train_only(files: list[tuple[int, Path]], errors: list[str] | None = None) -> Iterator[SampleRecord]:
    """Records from a train dump alone (no rollout dump): tokens, masks and both log-probs, no routes."""
    for step, path in files:
        yield from read_file(path, errors, partial(_train_file, step, path)) or ()


def _train_file(step: int, path: Path) -> list[SampleRecord]:
    """The records of one train file read alone, all or none."""
    check_step(step, str(path))
    return list(_train_records(step, path))


def _train_records(step: int, path: Path) -> Iterator[SampleRecord]:
    for i, sample in enumerate(_samples(_train_payload(path), path, step)):
        where = f"{path}: samples[{i}]"
        tokens, response = _sequence(sample, "response_lengths", where)
        mask = _vector(sample, "loss_masks", where, "i", response)
        position = (
            None if sample.get("rollout_position") is None else _count(sample, "rollout_position", where)
        )
        yield SampleRecord(
            step=step,
            sample_key=str(i if position is None else position),
            prompt_len=int(tokens.size - response),
            response_len=response,
            tokens=tokens,
            loss_mask=None if mask is None else mask != 0,
            engine_logprobs=_vector(sample, "rollout_log_probs", where, "f", response),
            trainer_logprobs=_vector(sample, "log_probs", where, "f", response),
            **NO_ROUTES.fields(),
            source="slime --save-debug-train-data",
            origin=f"{path} samples[{i}]",
        )
