"""Importer for verl's RolloutSkip dumps (verl 0.9.1; FACTS §7).

With ``skip.rollout.enable=True`` verl writes, per step, the agent loop's output batch to
``{dump_dir}/{exp}_{project}/GBS{g}_N{n}_in{p}_out{r}/{step}/gen_batch.dp`` with ``meta.json``
(``{"global_steps": step}``) beside it (``RolloutSkip.prepare_data``,
verl/utils/skip/rollout_skip.py:95–103; ``dump_dir`` defaults to ``~/.verl/rollout_dump``). The file
is ``DataProto.save_to_disk`` (verl/protocol.py:423): a pickle of the ``DataProto`` whose state
(protocol.py:377–399) is the ``TensorDict`` batch as ``torch.save`` bytes of a consolidated
TensorDict (or, under ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``, ``(batch_size, device,
{key: (dtype, shape, bytes)})``), the ``non_tensor_batch`` dict of numpy arrays and ``meta_info``.
It is read through ``safe_pickle``: verl, tensordict and torch never unpickle anything.

The batch (``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``,
verl/experimental/agent_loop/agent_loop.py:728–856, 1057–1148): ``prompts [B, P_max]`` left-padded,
``responses [B, R_max]`` right-padded, ``input_ids``/``attention_mask [B, P_max+R_max]`` their
concatenation, ``response_mask [B, R_max]`` (1 on LLM tokens, 0 on tool tokens and padding),
``rollout_log_probs [B, R_max]`` zero-padded, and ``routed_experts [B, P_max+R_max, L, K]`` int16
zeros with the engine payload written at ``start_pos = P_max − P`` (agent_loop.py:797–809): the row
of position j at index ``P_max − P + j``. The payload is the engine's routes of the last turn
(``single_turn_agent_loop.py:99``, ``tool_agent_loop.py:286``), a prefix of ``[0, P+R−1)``;
trailing zero rows are read as "no route captured", never as routes. The dump is taken before
``compute_log_prob``: it holds no trainer log-probs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from harness.audit.importers import base, pickle_values, safe_pickle, torch_format
from harness.audit.importers.model_shape import LayerVote
from harness.audit.layout.inputs import (
    brief,
    check_ints,
    check_mask,
    check_step,
    entries,
    kind_name,
    read_file,
    read_json,
)
from harness.audit.layout.schema import LayoutError, SampleRecord

DESCRIPTION = (
    "verl 0.9.1 RolloutSkip (skip.rollout.enable=True): {dump_dir}/{exp}_{project}/GBS{g}_N{n}_in{p}_out{r}/"
    "{step}/gen_batch.dp + meta.json (DataProto.save_to_disk of the agent loop's output)"
)
FACT_NOTES = {
    "num_experts": "num_experts is not in the dump: give it (--num-experts, RRH_NUM_EXPERTS)",
    "moe_layers": "moe_layers is not in the dump: without --moe-layers (RRH_MOE_LAYERS) it is inferred as "
    "the layers most samples route on; a MoE layer all zero in most samples reads as dense",
}
"""What the dump does not record, said only when the caller did not give it (``importers.notes``)."""
FACTS_FROM_ENV = True
"""``$RRH_NUM_EXPERTS`` and ``$RRH_MOE_LAYERS`` give the facts ``FACT_NOTES`` names, as the flags do."""
NOTES = (
    "dumped before compute_log_prob: no trainer log-probs, so logprob_gap is not checkable",
    "verl fills rows outside the payload with zeros: trailing all-zero rows, and a sample whose routes are "
    "all zero, are read as not captured (fallback metric), never as routes",
    "no trainer routes and no replay mode: replay_fidelity and agreement are not checkable",
)
HINTS = {
    "engine_routes": "routed_experts (actor_rollout_ref.rollout.enable_rollout_routing_replay=True)",
    "engine_logprobs": "rollout_log_probs (actor_rollout_ref.rollout.calculate_log_probs=True)",
    "trainer_tokens": "the tokens the trainer consumed: nothing in verl writes them apart from the rollout's "
    "(RolloutSkip dumps the batch before the trainer reads it); harness.audit.tap writes them",
    "trainer_logprobs": "the old-log-prob pass: nothing in verl writes it to disk (RolloutSkip dumps before "
    "compute_log_prob); harness.audit.tap writes it",
    "trainer_routes": "what the trainer dispatched: nothing in verl writes it (router_replay_patch keeps it "
    "in memory); harness.audit.tap writes it",
    "replay": "the replay mode of each row: nothing in verl's dump says it; harness.audit.tap writes it",
    "group_key": "the prompt's group: non_tensor_batch['uid'], or rollout.n from the GBS{g}_N{n}_… directory",
    "attempt payloads": "each attempt's own engine payload: nothing in verl writes it (the agent loop keeps "
    "the last turn's); harness.audit.tap writes them",
    "shard positions": "per-rank shards with their positions: nothing in verl writes them; harness.audit.tap "
    "writes them",
}
"""What writes each column an invariant may miss, said for verl (``AuditResult`` lines use it)."""

SOURCE = "verl RolloutSkip gen_batch.dp, read by rrh audit's verl importer (rrh audit DUMP --from verl)"
SOURCE_PREFIXES = ("verl ",)
"""The ``source`` of the records this importer writes (``hints_for`` tells a re-audited import by it)."""
FILE_NAME = "gen_batch.dp"
DATAPROTO = "verl.protocol.DataProto"
_STAND_INS = dict([pickle_values.stand_in("verl.protocol", "DataProto")])
_GROUP_SIZE = re.compile(r"^GBS\d+_N(\d+)_in\d+_out\d+$")


def dump_files(path: Path, loops: list[tuple[Path, Path]] | None = None) -> list[Path]:
    """Every ``gen_batch.dp`` at ``path`` (the file, a step directory, or up to the dump root), sorted.

    Folders are walked three levels down ({step}/, GBS…/{step}/, {exp}_{project}/GBS…/{step}/),
    following symlinks, but never into a folder already on the path walked to it (the same device
    and inode: a symlink to ``.`` or to a parent): a loop would show one run again under each of its
    names (``GBS…``, ``GBS…/loop``, ``GBS…/loop/loop``) and none could be audited. Each such link,
    and the folder it leads back to, is appended to ``loops``."""
    path = Path(path)
    if path.is_file():
        return [path] if path.name == FILE_NAME else []
    root = _identity(path) if path.is_dir() else None
    if root is None:
        return []
    found: list[Path] = []
    level = [(path, frozenset([root]))]
    for depth in range(4):
        below: list[tuple[Path, frozenset[tuple[int, int]]]] = []
        for folder, above in level:
            # Every entry of that name, a FIFO or a directory too: reading it says what it is.
            if os.path.lexists(folder / FILE_NAME):
                found.append(folder / FILE_NAME)
            if depth == 3:
                continue
            for entry in _listed(folder):
                identity = _identity(entry) if entry.name != FILE_NAME and _is_dir(entry) else None
                if identity is None:
                    continue
                if identity in above:
                    if loops is not None:
                        loops.append((entry, entry.resolve()))
                    continue
                below.append((entry, above | {identity}))
        level = below
    return sorted(found)


def _identity(folder: Path) -> tuple[int, int] | None:
    """A folder as the file system knows it, whatever name reaches it: ``(device, inode)``
    (``None``: it cannot be looked at, and is passed over as ``Path.glob`` passes it over)."""
    try:
        stat = folder.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _is_dir(entry: Path) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a link into a folder that cannot be searched
        return False


def _listed(folder: Path) -> list[Path]:
    """The entries of ``folder``; one that cannot be listed is passed over, as ``Path.glob`` does."""
    try:
        return entries(folder)
    except LayoutError:
        return []


def loop_note(loops: list[tuple[Path, Path]], runs: int) -> str:
    """What an audit says of the symlink loops ``dump_files`` did not follow."""
    link, target = loops[0]
    more = f" (and {len(loops) - 1} more)" if len(loops) > 1 else ""
    return (
        f"symlink loop not followed: {link} leads back to {target}, a folder above it{more}; "
        f"{runs} verl run{'s' if runs != 1 else ''} found, each read once"
    )


def detect(path: Path) -> bool:
    """Whether ``path`` holds a verl RolloutSkip dump (a ``gen_batch.dp`` file or directories of them)."""
    return bool(dump_files(path))


def step_of(file: Path) -> int:
    """The step of a dump: ``meta.json``'s ``global_steps``, else its directory's name."""
    meta = file.parent / "meta.json"
    if os.path.lexists(meta):  # a FIFO, a directory or a dangling link there is refused, not skipped
        doc = read_json(meta)
        if not isinstance(doc, dict):
            raise LayoutError(f'{meta}: a JSON {type(doc).__name__}; expected {{"global_steps": <step>}}')
        step = doc.get("global_steps")
        if isinstance(step, bool) or not isinstance(step, int):
            raise LayoutError(f"{meta}: global_steps is {brief(step)}; expected an integer step")
        return check_step(step, str(meta))
    if not file.parent.name.isdigit():
        raise LayoutError(f"{file}: no meta.json and directory {file.parent.name!r} is not a step number")
    return check_step(int(file.parent.name), str(file))


def group_size_of(file: Path) -> int | None:
    """``rollout.n`` from the dump directory ``GBS{g}_N{n}_in{p}_out{r}`` above the step, if named so."""
    match = _GROUP_SIZE.match(file.parent.parent.name)
    return int(match.group(1)) if match and 0 < len(match.group(1)) < 10 and int(match.group(1)) > 0 else None


def read_batch(file: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors (numpy arrays) and the ``non_tensor_batch`` of one ``gen_batch.dp``."""
    source = str(file)
    proto = safe_pickle.load(file, _STAND_INS)
    if not isinstance(proto, pickle_values.Pickled) or proto.qualname != DATAPROTO:
        raise LayoutError(
            f"{source}: the pickle holds {getattr(proto, 'qualname', type(proto).__name__)}; "
            "expected a DataProto written by DataProto.save_to_disk"
        )
    state = safe_pickle.expect(proto.state, tuple, source, "state", "(batch, non_tensor_batch, meta_info)")
    if len(state) != 3:
        raise LayoutError(
            f"{source}: field 'state' has {len(state)} entries; expected (batch, non_tensor_batch, meta_info)"
        )
    batch, non_tensor, _meta = state
    if isinstance(batch, bytes):
        tensors = safe_pickle.load_torch_bytes(batch, f"{source} field 'batch'")
    elif isinstance(batch, tuple) and len(batch) == 3 and isinstance(batch[2], dict):
        tensors = {}
        for key, entry in batch[2].items():
            if not (isinstance(entry, tuple) and len(entry) == 3):
                raise LayoutError(
                    f"{source}: batch field {brief(key)} is {brief(entry)}; expected (dtype, shape, bytes)"
                )
            shape = tuple(entry[1]) if isinstance(entry[1], (tuple, list)) else entry[1]
            field = key if isinstance(key, str) else brief(key)  # quoted once, by the message
            tensors[key] = torch_format.view_bytes(entry[2], entry[0], shape, source, field)
    else:
        raise LayoutError(
            f"{source}: field 'batch' is {kind_name(batch)}; expected torch.save bytes of a TensorDict "
            "(or verl's numpy serialization)"
        )
    safe_pickle.expect(tensors, dict, source, "batch", "a TensorDict of tensors")
    safe_pickle.expect(non_tensor, dict, source, "non_tensor_batch", "a dict of numpy arrays")
    return tensors, non_tensor


def _field(tensors: dict[str, Any], name: str, shape: Sequence[int | None], source: str, what: str) -> Any:
    array = tensors.get(name)
    if array is None:
        raise LayoutError(f"{source}: field {name!r} missing; expected {what}")
    if (
        not isinstance(array, np.ndarray)
        or array.ndim != len(shape)
        or any(want is not None and got != want for got, want in zip(array.shape, shape, strict=True))
    ):
        got = array.shape if isinstance(array, np.ndarray) else kind_name(array)
        raise LayoutError(f"{source}: field {name!r} has shape {got}; expected {what}")
    return array


def _groups(
    non_tensor: dict[str, Any], size: int, group_size: int | None, source: str = "gen_batch.dp"
) -> list[str | None]:
    """Each sample's GRPO group: its ``uid`` when the dump kept it, else ``i // rollout.n`` (samples of
    a prompt are consecutive: ``gen_batch.repeat(interleave=True)``), else unknown."""
    uids = non_tensor.get("uid")
    if isinstance(uids, (np.ndarray, pickle_values.ObjectArray)) and uids.shape == (size,):
        values = uids.tolist()
        if all(isinstance(u, (str, int)) and not isinstance(u, bool) for u in values):
            return [str(u)[:256] for u in values]
        bad = next(u for u in values if not isinstance(u, (str, int)) or isinstance(u, bool))
        raise LayoutError(f"{source}: non_tensor_batch field 'uid' holds {brief(bad)}; expected string uids")
    if group_size:  # named by the samples' indices: the dump has no other name for the group
        starts = [i - i % group_size for i in range(size)]
        return [base.samples_label(start, min(size, start + group_size)) for start in starts]
    return [None] * size


def _spans(attention: Any, p_max: int, source: str) -> Iterator[tuple[int, int, int, int, None]]:
    """Each sample's ``(batch row, prompt, response, first token column, None)``, checked as it comes."""
    for i in range(attention.shape[0]):
        prompt, resp = int(attention[i, :p_max].sum()), int(attention[i, p_max:].sum())
        if prompt < 1:
            raise LayoutError(
                f"{source} sample {i}: attention_mask has no prompt token; expected at least one"
            )
        yield i, prompt, resp, p_max - prompt, None


def batch_records(
    file: Path,
    num_experts: int,
    moe_layers: tuple[int, ...] | None,
    vote: LayerVote | None = None,
    errors: list[str] | None = None,
    read: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> tuple[list[SampleRecord], tuple[int, ...]]:
    """The records of one ``gen_batch.dp``, and the MoE layers used: ``moe_layers``, or with ``vote``
    what most samples agree on (``model_shape.step_layers``). ``errors``: a sample holding an id the
    run layout cannot store is a line there and left out (``model_shape.ids_fit``), else it raises.
    ``read``: its ``read_batch`` already done (a caller that needs the tensors too reads the file
    once)."""
    source, step = str(file), step_of(file)
    tensors, non_tensor = read_batch(file) if read is None else read
    prompts = _field(tensors, "prompts", (None, None), source, "[B, P_max] left-padded prompt ids")
    batch, p_max = prompts.shape
    responses = _field(tensors, "responses", (batch, None), source, "[B, R_max] right-padded response ids")
    r_max = responses.shape[1]
    width = p_max + r_max
    input_ids = _field(tensors, "input_ids", (batch, width), source, f"[B, P_max+R_max] = [{batch}, {width}]")
    attention = _field(
        tensors, "attention_mask", (batch, width), source, f"[B, P_max+R_max] = [{batch}, {width}]"
    )
    response_mask = _field(
        tensors, "response_mask", (batch, r_max), source, f"[B, R_max] = [{batch}, {r_max}]"
    )
    routes = _field(
        tensors, "routed_experts", (batch, width, None, None), source,
        f"[B, P_max+R_max, layers, top_k] = [{batch}, {width}, L, K] (rollout routing replay capture)",
    )  # fmt: skip
    logprobs = None
    if tensors.get("rollout_log_probs") is not None:
        logprobs = _field(
            tensors, "rollout_log_probs", (batch, r_max), source, f"[B, R_max] = [{batch}, {r_max}]"
        )
    base.check_route_ids(routes, source, "routed_experts")
    check_ints(input_ids, 32, source, "input_ids")
    check_mask(attention, source, "attention_mask")
    check_mask(response_mask, source, "response_mask")
    base.check_logprobs(logprobs, source, "rollout_log_probs")
    num_layers, top_k = base.route_widths(routes, num_experts, source, "routed_experts")
    groups = _groups(non_tensor, batch, group_size_of(file), source)
    spans, r_max = _spans(attention, p_max, source), attention.shape[1] - p_max
    samples = base.padded_samples(routes, spans, num_experts, source, step, errors, r_max)
    moe_layers = base.padded_layers(vote, moe_layers, step, samples, source, num_layers)
    shape = base.RoutingShape(num_experts, top_k, num_layers, moe_layers)
    out = [
        s.record(
            source,
            step,
            shape,
            SOURCE,
            group_key=groups[s.index],
            tokens=input_ids[s.index, s.first : p_max + s.response],
            loss_mask=response_mask[s.index, : s.response] != 0,
            engine_logprobs=None if logprobs is None else logprobs[s.index, : s.response].astype(np.float32),
        )
        for s in samples
    ]
    return out, moe_layers


def records(
    path: Path,
    *,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    errors: list[str] | None = None,
    inferred: list[str] | None = None,
    notes: list[str] | None = None,
) -> Iterator[SampleRecord]:
    """One ``SampleRecord`` per (step, sample) of the verl RolloutSkip dump at ``path``, step by step.

    ``num_experts`` (or ``$RRH_NUM_EXPERTS``) is required: the dump does not hold it. ``moe_layers``
    (or ``$RRH_MOE_LAYERS``) defaults to the layers most samples route on (``LayerVote``); what
    was inferred is appended to ``inferred`` at the end. Point ``path`` at one run's ``GBS…``
    directory: the dump root may hold several runs, whose steps collide. ``errors``: see
    ``harness.audit.importers`` (a damaged file is a line there, the others are read). ``notes``: a
    symlink loop below ``path``, not followed (``dump_files``), is a line there.
    """
    loops: list[tuple[Path, Path]] = []
    files = dump_files(Path(path), loops)
    if not files:
        raise LayoutError(f"{path}: no verl RolloutSkip dump ({{step}}/{FILE_NAME})")
    if loops and notes is not None:
        notes.append(loop_note(loops, len({f.parent.parent for f in files})))
    experts, layers, vote = base.model_inputs(num_experts, moe_layers, "verl")
    ordered: list[tuple[int, Path]] = []
    for file in files:
        step = read_file(file.parent / "meta.json", errors, partial(step_of, file))
        if step is not None:
            ordered.append((step, file))
    reads = (
        (file, partial(batch_records, file, experts, layers, vote, errors)) for _, file in sorted(ordered)
    )
    yield from base.dump_records(reads, errors, vote, inferred)
