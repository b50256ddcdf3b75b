"""Importer for SkyRL's ``trainer.dump_data_batch=true`` dumps (SkyRL 0.3.0; FACTS §7).

Each training step SkyRL writes ``{export_path}/dumped_data/global_step_{N}_training_input.pkl``
(``RayPPOTrainer.dump_data``, skyrl/train/trainer.py:1222, called at trainer.py:439 after the
old-log-prob pass and the advantages): ``TrainingInputBatch.save``, a pickle of
``_rebuild_tensor_batch(TrainingInputBatch, state)`` whose ``state["batch_dict"]`` holds every
tensor as numpy bytes (``_serialize_tensor``, skyrl/backends/skyrl_train/training_batch.py:15).
It is read through ``safe_pickle`` with stand-ins for those two names: SkyRL need not be installed.

The layout of the batch (``convert_prompts_responses_to_batch_tensors``,
skyrl/train/dataset/preprocess.py:32): ``sequences``/``attention_mask`` ``[B, S]`` hold prompt ⊕
response left-padded to ``S = max(P+R)``; response tensors ``[B, R_max]`` (``response_mask``,
``loss_mask``, ``rollout_logprobs``, ``action_log_probs``) are right-aligned;
``rollout_expert_indices`` ``[B, S, L, K]`` (uint8 when every id < 256, else int16) holds the
engine payload row for position j of a sample at sequence index ``left_pad + j`` (preprocess.py,
``padded[i, left_pad : left_pad + n] = sample_indices[:n]``) and zeros elsewhere. The payload is
vLLM's ``routed_experts`` of the sample's last turn (skyrl_gym_generator.py:1121–1125), cut to
``P+R`` rows (skyrl_gym_generator.py:791), so it covers a prefix of positions ``[0, P+R−1)`` (one
more real row when a response was truncated, §3.1), followed by zero rows for an appended EOS
(skyrl_gym_generator.py:577–580) or tokens no turn fed to the engine. SkyRL 0.3.0 has no mask,
so trailing zero rows are read as "no route captured"; a ``router_padding_mask`` ``[B, S]`` (SkyRL
after 0.3.0: True where no route was captured) is used instead when the dump has one. The last
``metadata["pad_size"]`` samples are copies of sample 0 added for DP divisibility
(``pad_training_input_batch``) and are dropped.

What it shares with the verl importer, whose dump uses the same zero-filled padded route tensor,
is in ``base`` (``padded_samples``, ``model_inputs``, ``dump_records``, …) and ``model_shape``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers import base, pickle_values, safe_pickle
from harness.audit.importers.model_shape import LayerVote
from harness.audit.layout.inputs import brief, check_ints, check_mask, check_step, entries, kind_name
from harness.audit.layout.schema import LayoutError, SampleRecord

DESCRIPTION = (
    "SkyRL 0.3.0 trainer.dump_data_batch=true: {export_path}/dumped_data/"
    "global_step_{N}_training_input.pkl (TrainingInputBatch.save, written after the old-log-prob pass)"
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
    "SkyRL 0.3.0 fills missing rows with zeros and has no mask: trailing all-zero rows, and a sample whose "
    "routes are all zero, are read as not captured (fallback metric), never as routes",
    "no trainer routes and no replay mode: replay_fidelity and agreement are not checkable",
)
HINTS = {
    "engine_routes": "rollout_expert_indices (generator.inference_engine.enable_return_routed_experts=true)",
    "engine_logprobs": "rollout_logprobs (the generator's sampled-token log-probs)",
    "trainer_tokens": "the tokens the trainer consumed apart from the engine's: nothing in SkyRL writes them "
    "(its dump holds one token tensor, sequences); harness.audit.tap writes them",
    "trainer_logprobs": "action_log_probs (trainer.dump_data_batch=true writes them after the old-log-prob "
    "pass)",
    "trainer_routes": "what the trainer dispatched: nothing in SkyRL writes it (hf_router_replay keeps it in "
    "memory); harness.audit.tap writes it",
    "replay": "the replay mode of each row: nothing in SkyRL's dump says it; harness.audit.tap writes it",
    "group_key": "the prompt's group: metadata['policy_prompt_boundaries'] of the dump",
    "attempt payloads": "each attempt's own engine payload: nothing in SkyRL writes it (the generator keeps "
    "the last turn's); harness.audit.tap writes them",
    "shard positions": "per-rank shards with their positions: nothing in SkyRL writes them; "
    "harness.audit.tap writes them",
}
"""What writes each column an invariant may miss, said for SkyRL (``AuditResult`` lines use it)."""

SOURCE = "SkyRL trainer.dump_data_batch, read by rrh audit's SkyRL importer (rrh audit DUMP --from skyrl)"
SOURCE_PREFIXES = ("SkyRL ",)
"""The ``source`` of the records this importer writes (``hints_for`` tells a re-audited import by it)."""
FILE_PATTERN = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
MODULE = "skyrl.backends.skyrl_train.training_batch"
BATCH_CLASS = f"{MODULE}.TrainingInputBatch"

_STAND_INS = dict(
    [
        pickle_values.stand_in(MODULE, "TrainingInputBatch"),
        pickle_values.stand_in_function(MODULE, "_rebuild_tensor_batch"),
    ]
)


# --- reading the dump ----------------------------------------------------------------------------


def dump_files(path: Path) -> list[tuple[int, Path]]:
    """``(step, file)`` of every dump at ``path`` (a file, ``dumped_data/`` or the export path), by step."""
    path = Path(path)
    if path.is_file():
        candidates = [path]
    elif (path / "dumped_data").is_dir():
        candidates = entries(path / "dumped_data")
    elif path.is_dir():
        candidates = entries(path)
    else:
        candidates = []
    # Every entry named like a dump, a FIFO or a directory too: reading it says what it is.
    found = [(int(m.group(1)), p) for p in candidates if (m := FILE_PATTERN.match(p.name))]
    return sorted(found)


def detect(path: Path) -> bool:
    """Whether ``path`` is a SkyRL dump file, its ``dumped_data`` directory or the export path above it."""
    return bool(dump_files(path))


def _tensor(entry: Any, source: str, field: str) -> npt.NDArray[Any]:
    """One ``_serialize_tensor`` entry as an array: numpy bytes, or ``torch.save`` bytes (bfloat16)."""
    safe_pickle.expect(entry, dict, source, field, "a serialized tensor dict")
    kind = entry.get("format", "numpy")
    if not isinstance(kind, str) or kind not in ("numpy", "torch"):
        raise LayoutError(f"{source}: field {field!r} has format {brief(kind)}; expected 'numpy' or 'torch'")
    if kind == "torch":
        data = safe_pickle.expect(entry.get("data"), bytes, source, f"{field}.data", "torch.save bytes")
        array = safe_pickle.load_torch_bytes(data, f"{source} field {field!r}")
        return safe_pickle.expect(array, np.ndarray, source, field, "a tensor")
    data = safe_pickle.expect(entry.get("data"), bytes, source, f"{field}.data", "bytes")
    shape = safe_pickle.expect(entry.get("shape"), tuple, source, f"{field}.shape", "a shape tuple")
    name = entry.get("dtype")
    try:
        dtype = np.dtype(name) if isinstance(name, str) and len(name) <= 16 else None
    except Exception:
        dtype = None
    if (
        dtype is None
        or dtype.kind not in "biuf"
        or len(shape) > pickle_values.MAX_DIMS
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape)
    ):
        raise LayoutError(
            f"{source}: field {field!r} is {brief(name)} {brief(shape)}; expected a numeric dtype and a shape"
        )
    pickle_values.shape_of(shape, f"{source}: field {field!r}", dtype.itemsize)  # one numpy can make
    size = math.prod(shape) * dtype.itemsize
    if len(data) != size:
        raise LayoutError(
            f"{source}: field {field!r} holds {len(data)} bytes; expected {size} for {dtype} {shape}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def read_batch(file: Path) -> tuple[dict[str, npt.NDArray[Any] | None], dict[str, Any]]:
    """The tensors (numpy arrays, ``None`` where the batch holds ``None``) and metadata of one dump."""
    source = str(file)
    batch = safe_pickle.load(file, _STAND_INS)
    if not isinstance(batch, pickle_values.Pickled) or batch.qualname != BATCH_CLASS:
        raise LayoutError(
            f"{source}: the pickle holds {getattr(batch, 'qualname', kind_name(batch))}; "
            "expected a TrainingInputBatch written by TrainingInputBatch.save"
        )
    state = safe_pickle.expect(batch.state, dict, source, "state", "the TrainingInputBatch state dict")
    fields = safe_pickle.expect(state.get("batch_dict"), dict, source, "batch_dict", "a dict of tensors")
    metadata = state.get("metadata")
    metadata = {} if metadata is None else safe_pickle.expect(metadata, dict, source, "metadata", "a dict")
    tensors: dict[str, npt.NDArray[Any] | None] = {}
    for name in (
        "sequences", "attention_mask", "response_mask", "loss_mask", "rollout_logprobs",
        "action_log_probs", "rollout_expert_indices", "router_padding_mask",
    ):  # fmt: skip
        entry = fields.get(name)
        tensors[name] = None if entry is None else _tensor(entry, source, name)
    return tensors, metadata


def _require(tensors: dict[str, Any], name: str, ndim: int, source: str, what: str) -> npt.NDArray[Any]:
    array = tensors.get(name)
    if array is None:
        raise LayoutError(f"{source}: field {name!r} missing; expected {what}")
    if array.ndim != ndim:
        raise LayoutError(f"{source}: field {name!r} has shape {array.shape}; expected {what}")
    return array  # type: ignore[no-any-return]


def _shape_check(
    array: npt.NDArray[Any] | None, shape: tuple[int, ...], source: str, name: str, what: str
) -> None:
    if array is not None and array.shape != shape:
        raise LayoutError(f"{source}: field {name!r} has shape {array.shape}; expected {what} {list(shape)}")


def _row(array: npt.NDArray[Any] | None, where: Any, dtype: Any) -> npt.NDArray[Any] | None:
    """``array[where]`` as ``dtype`` (a mask: non-zero), or ``None`` for a field the dump does not hold."""
    if array is None:
        return None
    values = array[where]
    return values != 0 if dtype is bool else values.astype(dtype)


def _groups(metadata: dict[str, Any], size: int, source: str) -> list[str | None]:
    """Each sample's GRPO group from ``metadata["policy_prompt_boundaries"]`` ``[(start, end)]``:
    consecutive, non-overlapping spans of the batch (``compute_prompt_boundaries``), read in one pass;
    named by the samples' indices (``samples 0-3``): the dump has no other name for it."""
    keys: list[str | None] = [None] * size
    bounds_list = metadata.get("policy_prompt_boundaries")
    if bounds_list is None:
        return keys
    safe_pickle.expect(bounds_list, (list, tuple), source, "metadata.policy_prompt_boundaries", "a list")
    end = 0
    for index, bounds in enumerate(bounds_list):
        if not (
            isinstance(bounds, (tuple, list))
            and len(bounds) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
            and end <= bounds[0] <= bounds[1]
        ):
            raise LayoutError(
                f"{source}: metadata 'policy_prompt_boundaries'[{index}] is {brief(bounds)}; expected "
                f"(start, end) with {end} <= start <= end (increasing, non-overlapping spans)"
            )
        start, end = bounds
        if start >= size:
            break  # spans of the DP padding samples, which are dropped
        end = min(end, size)
        keys[start:end] = [base.samples_label(start, end)] * (end - start)
    return keys


def _spans(
    attention: npt.NDArray[Any],
    response: npt.NDArray[Any],
    padding: npt.NDArray[Any] | None,
    real: int,
    source: str,
) -> Iterator[tuple[int, int, int, int, npt.NDArray[np.bool_] | None]]:
    """Each real sample's ``(batch row, prompt, response, first token column, rows with a route)``,
    checked as it comes."""
    width, r_max = attention.shape[1], response.shape[1]
    for i in range(real):
        total, resp = int(attention[i].sum()), int(response[i].sum())
        prompt = total - resp
        if prompt < 1 or resp > r_max or total > width:
            raise LayoutError(
                f"{source} sample {i}: attention_mask sums to {total}, response_mask to {resp}; expected "
                "1 <= response tokens < tokens"
            )
        yield i, prompt, resp, width - total, None if padding is None else ~padding[i].astype(bool)


def batch_records(
    file: Path,
    step: int,
    num_experts: int,
    moe_layers: tuple[int, ...] | None,
    vote: LayerVote | None = None,
    errors: list[str] | None = None,
) -> tuple[list[SampleRecord], tuple[int, ...]]:
    """The records of one dump file, and the MoE layers used: ``moe_layers``, or with ``vote`` what
    most samples agree on (``model_shape.step_layers``). ``errors``: a sample holding an id the run
    layout cannot store is a line there and left out (``model_shape.ids_fit``), else it raises."""
    source = str(file)
    check_step(step, source)
    tensors, metadata = read_batch(file)
    sequences = _require(tensors, "sequences", 2, source, "[B, S] token ids")
    check_ints(sequences, 32, source, "sequences")
    batch, width = sequences.shape
    attention = _require(tensors, "attention_mask", 2, source, "[B, S]")
    response = _require(tensors, "response_mask", 2, source, "[B, R_max]")
    routes = _require(
        tensors, "rollout_expert_indices", 4, source,
        "[B, S, layers, top_k] expert ids (generator.inference_engine.enable_return_routed_experts=true)",
    )  # fmt: skip
    r_max = response.shape[1]
    _shape_check(attention, (batch, width), source, "attention_mask", "[B, S] =")
    if routes.shape[:2] != (batch, width):
        raise LayoutError(
            f"{source}: field 'rollout_expert_indices' has shape {routes.shape}; expected [B, S, …] = "
            f"[{batch}, {width}, …]"
        )
    _shape_check(response, (batch, r_max), source, "response_mask", "[B, R_max] =")
    for name in ("loss_mask", "rollout_logprobs", "action_log_probs"):
        _shape_check(tensors[name], (batch, r_max), source, name, "[B, R_max] =")
    _shape_check(tensors["router_padding_mask"], (batch, width), source, "router_padding_mask", "[B, S] =")
    base.check_route_ids(routes, source, "rollout_expert_indices")
    for name, mask in (("attention_mask", attention), ("response_mask", response)):
        check_mask(mask, source, name)
    for name in ("rollout_logprobs", "action_log_probs"):
        base.check_logprobs(tensors[name], source, name)
    num_layers, top_k = base.route_widths(routes, num_experts, source, "rollout_expert_indices")
    pad = metadata.get("pad_size", 0)
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < batch:
        raise LayoutError(
            f"{source}: metadata 'pad_size' is {brief(pad)}; expected an integer in [0, {batch})"
        )
    real = batch - pad
    padding = tensors["router_padding_mask"]
    groups = _groups(metadata, real, source)
    spans = _spans(attention, response, padding, real, source)
    samples = base.padded_samples(routes, spans, num_experts, source, step, errors, response.shape[1])
    moe_layers = base.padded_layers(vote, moe_layers, step, samples, source, num_layers)
    shape = base.RoutingShape(num_experts, top_k, num_layers, moe_layers)
    out = []
    for s in samples:
        tail = (s.index, slice(r_max - s.response, r_max))
        out.append(
            s.record(
                source,
                step,
                shape,
                SOURCE,
                group_key=groups[s.index],
                tokens=sequences[s.index, s.first :],
                loss_mask=_row(tensors["loss_mask"], tail, bool),
                engine_logprobs=_row(tensors["rollout_logprobs"], tail, np.float32),
                trainer_logprobs=_row(tensors["action_log_probs"], tail, np.float32),
            )
        )
    return out, moe_layers


def records(
    path: Path,
    *,
    num_experts: int | None = None,
    moe_layers: Sequence[int] | None = None,
    errors: list[str] | None = None,
    inferred: list[str] | None = None,
) -> Iterator[SampleRecord]:
    """One ``SampleRecord`` per (step, sample) of the SkyRL dump at ``path``, step by step.

    ``num_experts`` (or ``$RRH_NUM_EXPERTS``) is required: the dump does not hold it. ``moe_layers``
    (or ``$RRH_MOE_LAYERS``) defaults to the layers most samples route on (``LayerVote``); what
    was inferred is appended to ``inferred`` at the end. ``errors``: see ``harness.audit.importers``
    (a damaged file is a line there, the other files are read).
    """
    files = dump_files(Path(path))
    if not files:
        raise LayoutError(f"{path}: no SkyRL dump (dumped_data/global_step_<N>_training_input.pkl)")
    experts, layers, vote = base.model_inputs(num_experts, moe_layers, "SkyRL")
    reads = (
        (file, partial(batch_records, file, step, experts, layers, vote, errors)) for step, file in files
    )
    yield from base.dump_records(reads, errors, vote, inferred)
