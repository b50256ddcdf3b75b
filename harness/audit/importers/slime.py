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
``errors=`` the other rollouts are still read. Reading a file's dict and its fields, and the first
pass that finds the run's routing shape, are in ``slime_dump``; the join of the two dumps is here.

Missing rows: slime pads the last position (which has no route) and the packing remainder with
``arange % num_experts`` *at replay* (``_pad_routed_experts`` in
``slime/backends/megatron_utils/cp_utils.py``). That filler is built from the dumped rows and
never written, so every row in the dump is a captured route: ``engine_captured`` stays null. The
filler replayed for the last position is invisible to an audit of the dump.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers.base import NO_ROUTES, RoutingShape
from harness.audit.importers.model_shape import ids_fit
from harness.audit.importers.slime_dump import (
    dump_samples,
    is_int,
    load_dump,
    nonnegative,
    routing_shape,
    sample_routes,
    scalar,
    sequence,
    vector,
)
from harness.audit.layout.inputs import brief, check_step, glob, read_file
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.trace import LayerAxis

DESCRIPTION = (
    "slime/miles debug dump: --save-debug-rollout-data (or --dump-details D: D/rollout_data/{id}.pt), "
    "joined with --save-debug-train-data format_version 2 (D/train_data/{id}.pt) where present"
)
FACT_NOTES = {
    "num_experts": "num_experts is not in the dump: without --num-experts it is inferred from what most "
    "samples agree on (1 + the largest id more than one sample uses), so ids are checked against that bound, "
    "not the model's expert count",
    "moe_layers": "the MoE layers are not in the dump: without --moe-layers they are inferred as the layers "
    "most samples route on; a MoE layer all-zero in most samples reads as dense",
}
"""What the dump does not record, said only when the caller did not give it (``importers.notes``)."""
NOTES = (
    "every dumped route row is a captured route: slime's arange % E filler for the last position and "
    "packing pads is built at replay (cp_utils._pad_routed_experts), never dumped, so it cannot be checked",
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
STEP_NAME = "rollout id"
"""A slime dump's step is the rollout id of its ``rollout_data/{id}.pt`` (the report says so)."""
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
    shape = routing_shape(rollout_files, num_experts, moe_layers, inferred, errors, bad)
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
    samples = dump_samples(load_dump(rollout_path), rollout_path, step)
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


def _train_payload(path: Path) -> dict[str, Any]:
    """A train dump of format_version 2, the only one whose samples are whole and in rollout order."""
    payload = load_dump(path)
    version = scalar(payload.get("format_version"))
    if not is_int(version) or version != TRAIN_FORMAT_VERSION:
        raise LayoutError(
            f"{path}: field 'format_version' is {brief(version)}; expected {TRAIN_FORMAT_VERSION} "
            "(slime ≥ #2266; per-rank train dumps of older slime and of miles hold CP-sliced shards and are "
            "not read)"
        )
    return payload


def _train_samples(path: Path, step: int, rollout: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The train dump's samples by their position in the rollout dump (``rollout_position``)."""
    samples = dump_samples(_train_payload(path), path, step)
    by_index = {index: i for i, s in enumerate(rollout) if is_int(index := scalar(s.get("index")))}
    out: dict[int, dict[str, Any]] = {}
    for i, sample in enumerate(samples):
        where = f"{path}: samples[{i}]"
        if sample.get("rollout_position") is not None:
            position = nonnegative(sample, "rollout_position", where)
        elif is_int(index := scalar(sample.get("sample_index"))) and index in by_index:
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
    tokens, response = sequence(sample, "response_length", where)
    mask = vector(sample, "loss_mask", where, "i", response)
    mask = np.ones(response, dtype=bool) if mask is None else mask != 0
    removed = scalar(sample.get("remove_sample"))
    if not isinstance(removed, (bool, int, type(None))):
        raise LayoutError(f"{where}: field 'remove_sample' is {brief(removed)}; expected a boolean")
    if removed:
        mask[:] = False  # slime/ray/rollout.py zeroes a removed sample's loss mask
    engine_lp = vector(sample, "rollout_log_probs", where, "f", response)
    routes = sample_routes(sample, where)
    if routes is not None:
        _check_shape(routes, shape, where)
        if not ids_fit(
            routes, shape.num_experts, f"{path} samples[{position}]", step, position, None, errors
        ):
            return None
    trainer_tokens = trainer_lp = None
    if trained is not None:
        twhere = f"{train_path}: samples[rollout_position={position}]"
        trainer_tokens, trained_response = sequence(trained, "response_lengths", twhere)
        if trainer_tokens.size != tokens.size or trained_response != response:
            raise LayoutError(
                f"{twhere}: fields 'tokens', 'response_lengths' describe {trainer_tokens.size} tokens with "
                f"{trained_response} in the response; expected {tokens.size} with {response} (the rollout "
                "dump's sample)"
            )
        trained_mask = vector(trained, "loss_masks", twhere, "i", response)
        mask = mask if trained_mask is None else trained_mask != 0
        trainer_lp = vector(trained, "log_probs", twhere, "f", response)
    group = scalar(sample.get("group_index"))
    if not (group is None or is_int(group) or (isinstance(group, str) and len(group) <= 256)):
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
    for i, sample in enumerate(dump_samples(_train_payload(path), path, step)):
        where = f"{path}: samples[{i}]"
        tokens, response = sequence(sample, "response_lengths", where)
        mask = vector(sample, "loss_masks", where, "i", response)
        position = (
            None if sample.get("rollout_position") is None else nonnegative(sample, "rollout_position", where)
        )
        yield SampleRecord(
            step=step,
            sample_key=str(i if position is None else position),
            prompt_len=int(tokens.size - response),
            response_len=response,
            tokens=tokens,
            loss_mask=None if mask is None else mask != 0,
            engine_logprobs=vector(sample, "rollout_log_probs", where, "f", response),
            trainer_logprobs=vector(sample, "log_probs", where, "f", response),
            **NO_ROUTES.fields(),
            source="slime --save-debug-train-data",
            origin=f"{path} samples[{i}]",
        )
