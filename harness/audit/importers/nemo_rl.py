"""NeMo-RL's per-step training data and its R3 trace → the run layout and hash-level checks (FACTS §7).

What NeMo-RL writes (read in NVIDIA-NeMo/RL, never imported):

- every step, unless ``env.should_log_nemo_gym_responses`` is set, ``{log_dir}/train_data_step{N}.jsonl``
  (``nemo_rl/algorithms/grpo.py``; ``N`` = the step + 1) through
  ``Logger.log_batched_dict_as_jsonl`` (``nemo_rl/utils/logger.py``): one line per sample, each
  column a batch of one — ``token_ids`` ``[[ids…]]`` right-padded to the batch's longest
  sequence, ``input_lengths`` ``[L]``, ``token_loss_mask`` ``[[0/1…]]`` (1 on tokens the model
  generated; prompt, tool and padding 0), ``sample_loss_mask`` ``[m]``, ``generation_logprobs``
  (the engine's) and ``prev_logprobs`` (the trainer's old-log-prob pass), both aligned with the
  tokens (entry t is log p(token t | tokens < t); entry 0 is 0), plus ``idx``, the line number.
- with ``NRL_R3_TRACE=1``, ``$NRL_R3_TRACE_DIR/r3_trace_{host}_pid{pid}.jsonl``
  (``nemo_rl/utils/r3_trace.py``, default 1 step): per sample, SHA-256 hashes of the valid rows of
  ``routed_experts`` and ``input_ids`` where the rollout produced them (``rollout_payload_sample``)
  and where the trainer fetched them (``tq_fetch_sample``, stage ``prev_lp`` and ``train``), and the
  replay's assignments, actions and forward-verify records. ``tools/check_r3_trace.py`` is
  NeMo-RL's own checker of those records; ``trace_violations`` checks the same rules and names
  each violation at its trace step, sample and key.

The routes themselves are never dumped (missing rows would be all −1,
``R3_MISSING_ROUTE_SENTINEL``, int8 when E ≤ 128 else int16, ``nemo_rl/models/generation/vllm/utils.py``),
so the records carry no routes and the route invariants are not checkable: the trace's hashes say
*that* routes changed between producer and trainer, never at which row or layer.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.importers.base import NO_ROUTES
from harness.audit.layout.inputs import brief, check_step, glob, lines, parse_json, read_file
from harness.audit.layout.schema import LayoutError, SampleRecord

DESCRIPTION = "NeMo-RL {log_dir}/train_data_step{N}.jsonl (tokens, masks, generation and prev log-probs)"
NOTES = (
    "hash-level checks only: NeMo-RL dumps no routes, so row coverage, id validity, agreement and replay "
    "fidelity are not checkable from this dump; harness.audit.importers.nemo_rl.trace_violations checks the "
    "NRL_R3_TRACE JSONL (producer vs prev_lp/train SHA-256 of routed_experts and input_ids, replay set), "
    "which names a sample whose routes changed but never the row or layer",
    "the prompt is everything before the first token with token_loss_mask 1; tool and environment "
    "tokens after it are response tokens with mask 0",
    "the trainer's tokens are not dumped apart from the engine's (one token_ids column): tokens_match is "
    "not checkable",
)
HINTS = {
    "engine_routes": "the engine's routes: nothing in NeMo-RL writes them (NRL_R3_TRACE* logs SHA-256 hashes "
    "only: harness.audit.importers.nemo_rl.trace_violations checks those)",
    "trainer_tokens": "the tokens the trainer consumed apart from the engine's: nothing in NeMo-RL writes "
    "them (train_data_step{N}.jsonl has one token_ids column); harness.audit.tap writes them",
    "engine_logprobs": "generation_logprobs of train_data_step{N}.jsonl",
    "trainer_logprobs": "prev_logprobs of train_data_step{N}.jsonl",
    "trainer_routes": "what the trainer dispatched: nothing in NeMo-RL writes it (hashes only in "
    "NRL_R3_TRACE); harness.audit.tap writes it",
    "replay": "the replay mode of each row: nothing in NeMo-RL's data dump says it; harness.audit.tap "
    "writes it",
    "group_key": "the prompt's group: nothing in train_data_step{N}.jsonl names it",
    "attempt payloads": "each attempt's own engine payload: nothing in NeMo-RL writes it; "
    "harness.audit.tap writes them",
    "shard positions": "per-rank shards with their positions: nothing in NeMo-RL writes them; "
    "harness.audit.tap writes them",
}
"""What writes each column an invariant may miss, said for NeMo-RL (``AuditResult`` lines use it)."""
SOURCE = "NeMo-RL train_data_step{N}.jsonl"
SOURCE_PREFIXES = ("NeMo-RL ",)
"""The ``source`` of the records this importer writes (``hints_for`` tells a re-audited import by it)."""
FETCH_STAGES = ("prev_lp", "train")
"""The trainer's fetches whose hashes must equal the producer's (``tools/check_r3_trace.py``)."""
REPLAY_STAGES = ("prev-logprob", "train")
"""The stages whose routers must be assigned replay targets and replay forward."""
_STEP_FILE = re.compile(r"train_data_step(\d+)\.jsonl")


def detect(path: Path) -> bool:
    """A ``train_data_step{N}.jsonl`` file or a log directory holding them."""
    if path.is_file():
        return _STEP_FILE.fullmatch(path.name) is not None
    return path.is_dir() and any(_STEP_FILE.fullmatch(p.name) for p in glob(path, "train_data_step*.jsonl"))


def records(path: Path, *, errors: list[str] | None = None) -> Iterator[SampleRecord]:
    """The samples of every ``train_data_step{N}.jsonl`` at ``path``, step by step, line by line.

    ``errors``: see ``harness.audit.importers``: a file that cannot be read, and a line that is not
    a sample, are lines there, and the other files and lines are read.
    """
    path = Path(path)
    # Every entry of that name, a FIFO or a directory too: reading it says what it is.
    files = [path] if path.is_file() else glob(path, "train_data_step*.jsonl")
    steps = sorted((int(m.group(1)), p) for p in files if (m := _STEP_FILE.fullmatch(p.name)))
    if not steps:
        raise LayoutError(f"{path}: no train_data_step{{N}}.jsonl; expected NeMo-RL's log directory")
    for step, file in steps:
        yield from read_file(file, errors, partial(_file_records, step, file, errors)) or ()


def _file_records(step: int, file: Path, errors: list[str] | None) -> list[SampleRecord]:
    check_step(step, str(file))
    out = []
    for line_no, text in lines(file):
        try:
            row = _row(text, f"{file}:{line_no}")
            if row is not None:
                out.append(_record(step, row, f"{file}:{line_no}"))
        except LayoutError as err:
            if errors is None:
                raise
            errors.append(str(err))
    return out


def _row(text: str, where: str) -> dict[str, Any] | None:
    """The JSON object of one line (``None`` for a blank line); anything else is one error."""
    if not text.strip():
        return None
    row = parse_json(text, where)
    if not isinstance(row, dict):
        raise LayoutError(f"{where}: a JSON {type(row).__name__}; expected an object")
    return row


def _lines(file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-empty line; a line that is not a JSON object is one error."""
    for line_no, text in lines(file):
        row = _row(text, f"{file}:{line_no}")
        if row is not None:
            yield line_no, row


def _one(row: dict[str, Any], field: str, where: str) -> Any:
    """The single entry of a batch-of-one column (``log_batched_dict_as_jsonl`` slices batches of 1)."""
    value = row.get(field)
    if not isinstance(value, list) or len(value) != 1:
        got = "missing" if value is None else brief(value)
        raise LayoutError(f"{where}: field {field!r} is {got}; expected a list of one row (a batch of one)")
    return value[0]


def _sequence(row: dict[str, Any], field: str, where: str, length: int, kind: str) -> Any:
    """The first ``length`` entries of a per-token column, ``None`` where the line has no such column.

    ``kind``: ``"i"`` integers (token ids), ``"f"`` numbers (log-probs), ``"m"`` a mask (numbers or
    booleans, non-zero meaning trained).
    """
    if field not in row:
        return None
    value = _one(row, field, where)
    if not isinstance(value, list) or len(value) < length:
        size = len(value) if isinstance(value, list) else type(value).__name__
        raise LayoutError(
            f"{where}: field {field!r} has {size} entries; expected at least input_lengths {length}"
        )
    head = value[:length]
    numeric, what = ((int,), "integers") if kind == "i" else ((int, float), "numbers")
    low, high = (-(2**31), 2**31) if kind == "i" else (-(2**63), 2**63)  # token ids: the layout's int32

    def fits(x: Any) -> bool:
        if not isinstance(x, numeric) or (kind != "m" and isinstance(x, bool)):
            return False
        return not isinstance(x, int) or low <= x < high

    if not all(fits(x) for x in head):
        bad = next(x for x in head if not fits(x))
        raise LayoutError(f"{where}: field {field!r} holds {brief(bad)}; expected {what}")
    return np.asarray(head, dtype=np.int64 if kind == "i" else np.float64)


def _record(step: int, row: dict[str, Any], where: str) -> SampleRecord:
    """One layout record from one line: the prompt ends where the first trained token starts."""
    length = _one(row, "input_lengths", where)
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length < 2**31:
        raise LayoutError(
            f"{where}: field 'input_lengths' is [{brief(length)}]; expected [a positive integer]"
        )
    tokens = _sequence(row, "token_ids", where, length, "i")
    token_mask = _sequence(row, "token_loss_mask", where, length, "m")
    if tokens is None or token_mask is None:
        missing = "token_ids" if tokens is None else "token_loss_mask"
        raise LayoutError(f"{where}: field {missing!r} is missing; expected a batch of one row")
    generated: npt.NDArray[np.intp] = np.flatnonzero(token_mask)
    if generated.size and generated[0] == 0:
        raise LayoutError(
            f"{where}: field 'token_loss_mask' is 1 at position 0; expected 0 (no token 0 is generated)"
        )
    prompt = int(generated[0]) if generated.size else length
    sample_mask = _one(row, "sample_loss_mask", where) if "sample_loss_mask" in row else 1
    if (
        isinstance(sample_mask, bool)
        or not isinstance(sample_mask, (int, float))
        or (isinstance(sample_mask, float) and math.isnan(sample_mask))
    ):
        raise LayoutError(f"{where}: field 'sample_loss_mask' is [{brief(sample_mask)}]; expected [a number]")
    engine = _sequence(row, "generation_logprobs", where, length, "f")
    trainer = _sequence(row, "prev_logprobs", where, length, "f")
    index = row.get("idx")
    if isinstance(index, bool) or not isinstance(index, int) or not -(2**63) <= index < 2**63:
        raise LayoutError(f"{where}: field 'idx' is {brief(index)}; expected the sample's integer index")
    return SampleRecord(
        step=step,
        sample_key=str(index),
        prompt_len=prompt,
        response_len=length - prompt,
        tokens=tokens,
        loss_mask=(token_mask[prompt:] != 0) & (sample_mask != 0),
        engine_logprobs=None if engine is None else engine[prompt:],
        trainer_logprobs=None if trainer is None else trainer[prompt:],
        **NO_ROUTES.fields(),
        source=SOURCE,
        origin=where,
    )


@dataclass(frozen=True)
class R3TraceViolation:
    """One failed rule of NeMo-RL's R3 trace, at its trace step, sample and key where it has them.

    ``trace_step`` is r3_trace.py's count of traced calls of that stage (1: the first traced step),
    not the training step; ``sample_idx`` is the sample's index in that call's batch and ``key``
    its transfer-queue sample id, the same at every stage.
    """

    check: str
    """``producer_missing``, ``fetch_missing``, ``routed_experts_hash``, ``input_ids_hash``,
    ``replay_assignment``, ``replay_action`` or ``forward_verify``."""
    expected: str
    actual: str
    stage: str | None = None
    key: str | None = None
    trace_step: int | None = None
    sample_idx: int | None = None
    layer: int | None = None
    where: str = ""
    """``file:line`` of the record that shows it (empty when a record is missing)."""

    def line(self) -> str:
        at = ", ".join(
            f"{name} {value}"
            for name, value in (
                ("stage", self.stage), ("trace_step", self.trace_step), ("sample", self.sample_idx),
                ("key", self.key), ("layer", self.layer),
            )
            if value is not None
        )  # fmt: skip
        return f"{self.check}: {at or 'run'}: expected {self.expected}, got {self.actual}" + (
            f" ({self.where})" if self.where else ""
        )


@dataclass(frozen=True)
class _Digest:
    """A sample's hashes as one trace record gives them."""

    trace_step: int | None
    sample_idx: int | None
    routed: str
    routed_shape: Any
    routed_dtype: Any
    inputs: str
    where: str


def _digest(record: dict[str, Any], where: str) -> _Digest:
    routed = record.get("routed_experts")
    if not isinstance(routed, dict) or not isinstance(routed.get("valid_sha256"), str):
        raise LayoutError(
            f"{where}: field 'routed_experts.valid_sha256' is missing; expected a SHA-256 digest"
        )
    inputs = record.get("input_ids")
    return _Digest(
        record.get("trace_step"),
        record.get("sample_idx"),
        routed["valid_sha256"],
        routed.get("valid_shape"),
        routed.get("dtype"),
        inputs.get("valid_sha256", "") if isinstance(inputs, dict) else "",
        where,
    )


def _keyed(record: dict[str, Any], field: str, where: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        raise LayoutError(f"{where}: field {field!r} is {brief(value)}; expected a string")
    return value


def trace_violations(trace_dir: Path) -> list[R3TraceViolation]:
    """Check NeMo-RL's R3 trace (``r3_trace_*.jsonl``) as its ``tools/check_r3_trace.py`` does, by name.

    Rules (each from ``tools/check_r3_trace.py``): there are producer records; every producer
    sample has a trainer fetch at ``prev_lp`` and at ``train`` whose ``routed_experts`` hash equals
    the producer's, and whose ``input_ids`` hash does where the fetch has one; the stages
    ``prev-logprob`` and ``train`` have replay assignments and ``replay_forward`` actions, ``train``
    a ``replay_backward``; no forward-verify record has ``matches_expected`` false. A record missing
    a field these rules read is a ``LayoutError`` naming file, line and field.
    """
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise LayoutError(f"{trace_dir}: not a directory; expected NRL_R3_TRACE_DIR (r3_trace_*.jsonl)")
    producers: dict[str, _Digest] = {}
    fetches: dict[tuple[str, str], list[_Digest]] = defaultdict(list)
    assignments: set[str] = set()
    actions: set[tuple[str, str]] = set()
    found: list[R3TraceViolation] = []
    for file in glob(trace_dir, "*.jsonl"):
        for line_no, record in _lines(file):
            where = f"{file}:{line_no}"
            event = record.get("event")
            if event == "rollout_payload_sample":
                producers.setdefault(_keyed(record, "key", where), _digest(record, where))
            elif event == "tq_fetch_sample":
                stage, key = _keyed(record, "stage", where), _keyed(record, "key", where)
                fetches[(stage, key)].append(_digest(record, where))
            elif event == "router_replay_assignment":
                assignments.add(_keyed(record, "stage", where))
            elif event == "router_replay_action":
                actions.add((_keyed(record, "stage", where), _keyed(record, "action", where)))
            elif event == "router_replay_forward_verify" and not record.get("matches_expected"):
                found.append(
                    R3TraceViolation(
                        "forward_verify", "replayed top-k equal to the installed targets",
                        f"a mismatch in action {record.get('action')}", stage=record.get("stage"),
                        trace_step=record.get("trace_step"), layer=record.get("layer_number"), where=where,
                    )
                )  # fmt: skip
    if not producers:
        found.append(R3TraceViolation("producer_missing", "rollout_payload_sample records", "none"))
    for key, producer in producers.items():
        for stage in FETCH_STAGES:
            if not fetches.get((stage, key)):
                found.append(
                    R3TraceViolation(
                        "fetch_missing", f"a tq_fetch_sample of the sample produced at {producer.where}",
                        "none", stage=stage, key=key, trace_step=producer.trace_step,
                        sample_idx=producer.sample_idx,
                    )
                )  # fmt: skip
            for fetch in fetches.get((stage, key), []):
                found.extend(_hash_violations(stage, key, producer, fetch))
    for stage in REPLAY_STAGES:
        if stage not in assignments:
            found.append(R3TraceViolation("replay_assignment", "replay assignments", "none", stage))
        if (stage, "replay_forward") not in actions:
            found.append(R3TraceViolation("replay_action", "a replay_forward action", "none", stage))
    if ("train", "replay_backward") not in actions:
        found.append(R3TraceViolation("replay_action", "a replay_backward action", "none", "train"))
    return found


def _hash_violations(stage: str, key: str, producer: _Digest, fetch: _Digest) -> list[R3TraceViolation]:
    """The fetch's hashes against the producer's (shape and dtype said too: they tell a layout bug)."""

    def violation(check: str, expected: str, actual: str) -> R3TraceViolation:
        return R3TraceViolation(
            check, expected, actual, stage=stage, key=key, trace_step=fetch.trace_step,
            sample_idx=fetch.sample_idx, where=fetch.where,
        )  # fmt: skip

    out = []
    if producer.routed != fetch.routed:
        out.append(
            violation(
                "routed_experts_hash",
                f"producer's sha256 {producer.routed[:16]}… {producer.routed_shape} {producer.routed_dtype} "
                f"({producer.where})",
                f"sha256 {fetch.routed[:16]}… {fetch.routed_shape} {fetch.routed_dtype}",
            )
        )
    if fetch.inputs and producer.inputs != fetch.inputs:
        out.append(
            violation(
                "input_ids_hash",
                f"producer's sha256 {producer.inputs[:16]}… ({producer.where})",
                f"sha256 {fetch.inputs[:16]}…",
            )
        )
    return out
