"""The SkyRL and verl importers, on dumps written by the released frameworks' own code.

One rollout of two steps (GRPO groups sharing their prompt routes, a sample whose last rows were
never fed to the engine, a truncated sample whose payload keeps the last token's real row) is
written as each framework writes it, then imported and audited (``audit_run``, serial):

- a clean dump has no strict violation, and what the dump cannot support is "not checkable"
  (replay fidelity and live agreement for both, the log-prob gap for verl);
- planted faults (an all-zero MoE layer, a wrapped id, a NaN log-prob, a payload one row off) are
  named at their exact step, sample, row and layer (every fault class, one at a time, with and
  without the model's facts: ``tests/test_audit_planted_faults.py``, on these writers).

``test_*_release_*`` build the dump with the release: SkyRL 0.3.0's
``convert_prompts_responses_to_batch_tensors``, ``TrainingInputBatch``, ``pad_training_input_batch``
and ``.save`` at the trainer's path; verl 0.9.1's ``AgentLoopWorker._agent_loop_postprocess`` /
``_postprocess`` and ``RolloutSkip.prepare_data``. They skip, naming the tox env, where the release
is not installed (``tox -e skyrl-0.3.0``, ``tox -e verl-0.9.1``), and check that the release's
files import exactly as the synthetic ones. The other tests write the same dumps without the
frameworks (``_skyrl_synthetic``, ``_verl_synthetic``: the formats and field names, in plain
numpy and torch), so the converters are covered in the default run.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from harness.audit.execution.executors import audit_run
from harness.audit.importers import detect, import_dump
from harness.audit.importers import skyrl as skyrl_importer
from harness.audit.importers import verl as verl_importer
from harness.audit.layout.schema import LayoutError, SampleRecord
from harness.audit.result.audit_result import AuditResult
from harness.subjects.frameworks import installed_version
from tests.audit_transcript import check, transcript
from tests.test_audit_safe_pickle import dumps_named, named, torch_bytes

E, L, K = 16, 4, 2
"""Experts, decoder layers (layer 0 dense) and top-k of the rollout."""
GROUPS, N = 2, 2
STEPS = (1, 2)
FAULT_STEP = 2


@dataclass
class Sample:
    """One sample as the engine returned it: tokens, the routes payload and the log-probs."""

    group: int
    prompt: npt.NDArray[np.int64]
    response: npt.NDArray[np.int64]
    routes: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    trainer_logprobs: npt.NDArray[np.float32] | None = None
    """What the old-log-prob pass gives (SkyRL's ``action_log_probs``); ``None``: ``trainer()``'s default."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    def trainer(self) -> npt.NDArray[np.float32]:
        """The trainer's log-probs: ``trainer_logprobs``, else the engine's 1e-3 lower, at most 0."""
        if self.trainer_logprobs is not None:
            return self.trainer_logprobs
        return np.minimum(self.logprobs - np.float32(1e-3), np.float32(0))


def group_spans(samples: list[Sample]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of consecutive samples of one group (SkyRL's prompt boundaries)."""
    starts = [i for i, s in enumerate(samples) if i == 0 or s.group != samples[i - 1].group]
    return list(zip(starts, [*starts[1:], len(samples)], strict=True))


def _routes(rng: np.random.Generator, rows: int) -> npt.NDArray[np.int32]:
    """``rows`` routes of ``K`` distinct ids per MoE layer; the dense layer 0 is all zero."""
    start = rng.integers(0, E, size=(rows, L, 1))
    routes = ((start + np.arange(K)) % E).astype(np.int32)
    routes[:, 0] = 0
    return routes


def rollout(step: int) -> list[Sample]:
    """The samples of one step. Sample 1's last two rows were never fed to the engine (a short
    payload); sample 2 was truncated at the response budget (``R_MAX`` tokens), so its payload keeps
    the real row of its last token (§3.1: only a response that fills its budget may)."""
    rng = np.random.default_rng(step)
    samples: list[Sample] = []
    for group in range(GROUPS):
        p = int(rng.integers(3, 7))
        prompt, prompt_routes = rng.integers(2, 1000, size=p), _routes(rng, p)
        for _ in range(N):
            r = int(rng.integers(3, 7))
            routes = np.concatenate([prompt_routes, _routes(rng, r)])  # P+R rows: the last token's too
            keep = {1: p + r - 3}.get(len(samples), p + r - 1)
            logprobs = -rng.exponential(1.0, size=r).astype(np.float32)
            response = rng.integers(2, 1000, size=r)
            if len(samples) == 2:  # the rest of its budget, from its own stream (the others stay put)
                more, extra = R_MAX - r, np.random.default_rng(100 + step)
                response = np.concatenate([response, extra.integers(2, 1000, size=more)])
                routes = np.concatenate([routes, _routes(extra, more)])
                logprobs = np.concatenate([logprobs, -extra.exponential(1.0, size=more).astype(np.float32)])
                keep = p + R_MAX
            samples.append(Sample(group, prompt, response, routes[:keep].copy(), logprobs))
    return samples


def plant(samples: list[Sample], long_payload: bool) -> list[tuple[str, str, int, int | None]]:
    """Plant the faults the engine side can produce; ``(invariant, sample, row, layer)`` of each.

    With ``long_payload`` sample 1 gets two rows past its last token (verl #6027: a truncated
    response whose rows were not truncated); the SkyRL test shifts a row in the collated tensor.
    """
    samples[0].routes[:, 2] = 0
    samples[3].routes[1, 3, 0] = E + 100  # wrapped into [E, 256): stored, named by ids_valid
    samples[2].logprobs[1] = np.nan
    faults = [
        ("moe_layer_nonzero", "0", 0, 2),
        ("ids_valid", "3", 1, 3),
        ("logprobs_valid", "2", len(samples[2].prompt) + 1, None),
    ]
    if long_payload:
        s = samples[1]
        extra = s.length + 1 - len(s.routes)
        s.routes = np.concatenate([s.routes, _routes(np.random.default_rng(9), extra)])
        faults.append(("coverage", "1", s.length - 1, None))
    return faults


def shift_target(samples: list[Sample]) -> int:
    """The sample whose collated rows the SkyRL fault moves one index early (a left-padded one)."""
    target = min(range(len(samples)), key=lambda i: samples[i].length)
    assert samples[target].length < max(s.length for s in samples), "the target must be left-padded"
    return target


# --- SkyRL: TrainingInputBatch.save ---------------------------------------------------------------


def _skyrl_fields(
    samples: list[Sample], shift: int | None, padding_mask: bool = False
) -> dict[str, npt.NDArray[Any]]:
    """The tensors ``convert_prompts_responses_to_batch_tensors`` makes, padded with one copy of
    sample 0 (``pad_training_input_batch``), plus the old-log-prob pass's ``action_log_probs``
    (``Sample.trainer``). The routes are uint8 when every id is below 256, else int16 (as SkyRL casts).

    ``padding_mask``: SkyRL after 0.3.0's convention instead, rows without a captured route hold
    ``arange(K)`` and ``router_padding_mask [B, S]`` is True there (``make_router_padding_mask``)."""
    width, r_max, b = max(s.length for s in samples), max(len(s.response) for s in samples), len(samples)
    f: dict[str, npt.NDArray[Any]] = {
        "sequences": np.zeros((b, width), np.int64),
        "attention_mask": np.zeros((b, width), np.int64),
        "response_mask": np.zeros((b, r_max), np.int64),
        "loss_mask": np.zeros((b, r_max), np.float32),
        "rollout_logprobs": np.zeros((b, r_max), np.float32),
        "action_log_probs": np.zeros((b, r_max), np.float32),
        "rollout_expert_indices": np.zeros((b, width, *samples[0].routes.shape[1:]), np.int32),
    }
    for i, s in enumerate(samples):
        left, r = width - s.length, len(s.response)
        f["sequences"][i, left:] = np.concatenate([s.prompt, s.response])
        f["attention_mask"][i, left:] = 1
        f["response_mask"][i, r_max - r :] = 1
        f["loss_mask"][i, r_max - r :] = 1
        f["rollout_logprobs"][i, r_max - r :] = s.logprobs
        f["action_log_probs"][i, r_max - r :] = s.trainer()
        rows = min(len(s.routes), s.length)
        f["rollout_expert_indices"][i, left : left + rows] = s.routes[:rows]
    if padding_mask:
        f["router_padding_mask"] = np.ones((b, width), bool)
        for i, s in enumerate(samples):
            left = width - s.length
            f["router_padding_mask"][i, left : left + min(len(s.routes), s.length)] = False
        f["rollout_expert_indices"][f["router_padding_mask"]] = np.arange(
            f["rollout_expert_indices"].shape[-1]
        )
    wide = f["rollout_expert_indices"].max() >= 2**8
    f["rollout_expert_indices"] = f["rollout_expert_indices"].astype(np.int16 if wide else np.uint8)
    if shift is not None:
        routes = f["rollout_expert_indices"][shift]
        routes[:-1] = routes[1:].copy()
        routes[-1] = 0
    f = {k: np.concatenate([v, v[:1]]) for k, v in f.items()}
    f["loss_mask"][-1] = 0
    return f


def _skyrl_metadata(samples: list[Sample]) -> dict[str, Any]:
    bounds = group_spans(samples)
    return {"policy_mini_batch_boundaries": bounds, "policy_prompt_boundaries": bounds, "pad_size": 1}


def _skyrl_synthetic(
    export: Path, steps: dict[int, list[Sample]], shift: dict[int, int], padding_mask: bool = False
) -> None:
    """The dumps as ``TrainingInputBatch.save`` writes them, without SkyRL."""

    class TrainingInputBatch:
        pass

    def _rebuild_tensor_batch(cls: Any, state: Any) -> Any:
        raise AssertionError("never called")

    cls = named(skyrl_importer.MODULE, "TrainingInputBatch", TrainingInputBatch)
    rebuild = named(skyrl_importer.MODULE, "_rebuild_tensor_batch", _rebuild_tensor_batch)
    (export / "dumped_data").mkdir(parents=True)
    for step, samples in steps.items():
        fields = _skyrl_fields(samples, shift.get(step), padding_mask)
        state = {
            "batch_dict": {
                k: {"format": "numpy", "data": v.tobytes(), "shape": v.shape, "dtype": str(v.dtype)}
                for k, v in fields.items()
            }
            | {"values": None},
            "batch_size": len(samples) + 1,
            "device": torch.device("cpu"),
            "metadata": _skyrl_metadata(samples) | {"response_length": fields["response_mask"].shape[1]},
        }
        data = dumps_named(_Call(rebuild, cls, state))
        (export / "dumped_data" / f"global_step_{step}_training_input.pkl").write_bytes(data)


class _Call:
    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _skyrl_release(export: Path, steps: dict[int, list[Sample]], shift: dict[int, int]) -> None:
    """The dumps written by SkyRL 0.3.0's own code, the way its trainer does at dump time."""
    tb, pre = _skyrl_modules()
    for step, samples in steps.items():
        seq, att, act, rew, lm, lp, ei = pre.convert_prompts_responses_to_batch_tensors(
            types.SimpleNamespace(pad_token_id=0),
            [s.prompt.tolist() for s in samples],
            [s.response.tolist() for s in samples],
            [[0.0] * len(s.response) for s in samples],
            [[1] * len(s.response) for s in samples],
            [s.logprobs.tolist() for s in samples],
            [s.routes.tolist() for s in samples],
        )
        if step in shift:  # a collation bug: the sample's rows one index early
            routes = ei[shift[step]]
            routes[:-1] = routes[1:].clone()
            routes[-1] = 0
        # RayPPOTrainer.convert_to_training_input (skyrl/train/trainer.py:848-966)
        batch = tb.TrainingInputBatch(
            {"sequences": seq, "attention_mask": att, "response_mask": act, "rewards": rew,
             "loss_mask": lm, "rollout_logprobs": lp, "rollout_expert_indices": ei, "pixel_values": None,
             "image_grid_thw": None}
        )  # fmt: skip
        uids = [f"g{s.group}" for s in samples]
        groups = len(group_spans(samples))
        batch.metadata = {
            "uids": uids,
            "policy_mini_batch_boundaries": pre.compute_prompt_mini_batch_boundaries(
                uids, groups, groups, False, len(samples) // groups
            ),
            "policy_prompt_boundaries": pre.compute_prompt_boundaries(uids),
            "response_length": act.shape[1],
            "avg_response_length": float(np.mean([len(s.response) for s in samples])),
        }
        batch = tb.pad_training_input_batch(batch, 1)
        # fwd_logprobs_values_reward, compute_advantages_and_returns (trainer.py:419-437): the
        # old-log-prob pass's log-probs, right-aligned like every response tensor (the pad: sample 0's)
        batch["base_action_log_probs"] = None
        trainer = torch.zeros_like(batch["rollout_logprobs"])
        for i, s in enumerate([*samples, samples[0]]):
            trainer[i, trainer.shape[1] - len(s.response) :] = torch.from_numpy(s.trainer())
        batch["action_log_probs"] = trainer
        batch["values"] = None
        batch["advantages"] = torch.zeros_like(batch["loss_mask"])
        batch["returns"] = torch.zeros_like(batch["loss_mask"])
        batch.pop("rewards")
        batch.metadata.pop("uids")
        batch.metadata["metrics"] = {"avg_final_rewards": 0.0, "avg_advantages": 0.0}
        # RayPPOTrainer.dump_data (trainer.py:1222-1228)
        (export / "dumped_data").mkdir(parents=True, exist_ok=True)
        batch.save(export / "dumped_data" / f"global_step_{step}_training_input.pkl")


def _skyrl_modules() -> tuple[Any, Any]:
    """SkyRL's ``training_batch`` and ``preprocess``, imported past the ``skyrl.backends`` package
    ``__init__`` (it pulls the inference stack this CPU env does not install)."""
    if installed_version("skyrl") != "0.3.0":
        pytest.skip(
            f"SkyRL 0.3.0 is not installed (found {installed_version('skyrl')}); run tox -e skyrl-0.3.0"
        )
    if "skyrl.backends" not in sys.modules:
        spec = importlib.util.find_spec("skyrl.backends")
        assert spec is not None and spec.submodule_search_locations is not None
        bare = types.ModuleType("skyrl.backends")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["skyrl.backends"] = bare
    return (
        importlib.import_module("skyrl.backends.skyrl_train.training_batch"),
        importlib.import_module("skyrl.train.dataset.preprocess"),
    )


# --- verl: RolloutSkip's gen_batch.dp -------------------------------------------------------------

P_MAX, R_MAX = 8, 9


@dataclass(frozen=True)
class VerlRun:
    """What a verl run's config fixes for its dumps: the padded widths (``prompt_length``,
    ``response_length``) and the group shape (``train_batch_size`` prompts, ``rollout.n`` each)."""

    p_max: int
    r_max: int
    groups: int
    n: int

    @property
    def directory(self) -> str:
        """``RolloutSkip``'s directory of the run under its dump root."""
        return f"exp_proj/GBS{self.groups}_N{self.n}_in{self.p_max}_out{self.r_max}"


def verl_run(steps: dict[int, list[Sample]]) -> VerlRun:
    """The config of a run whose widths fit every sample of ``steps`` (at least ``P_MAX``, ``R_MAX``)."""
    samples = [s for batch in steps.values() for s in batch]
    first = next(iter(steps.values()))
    groups = len(group_spans(first))
    return VerlRun(
        max(P_MAX, *(len(s.prompt) for s in samples)),
        max(R_MAX, *(len(s.response) for s in samples)),
        groups,
        len(first) // groups,
    )


DUMP_DIR = VerlRun(P_MAX, R_MAX, GROUPS, N).directory


def _verl_fields(samples: list[Sample], run: VerlRun | None = None) -> dict[str, npt.NDArray[Any]]:
    """The agent loop's padded batch: prompts left-padded, responses right-padded, routes at
    ``p_max − P`` in int16 zeros (verl/experimental/agent_loop/agent_loop.py:728-856)."""
    run = run or verl_run({0: samples})
    p_max, r_max = run.p_max, run.r_max
    b, width = len(samples), p_max + r_max
    f: dict[str, npt.NDArray[Any]] = {
        "prompts": np.zeros((b, p_max), np.int64),
        "responses": np.zeros((b, r_max), np.int64),
        "response_mask": np.zeros((b, r_max), np.int64),
        "input_ids": np.zeros((b, width), np.int64),
        "attention_mask": np.zeros((b, width), np.int64),
        "position_ids": np.zeros((b, width), np.int64),
        "rollout_log_probs": np.zeros((b, r_max), np.float32),
        "routed_experts": np.zeros((b, width, *samples[0].routes.shape[1:]), np.int16),
    }
    for i, s in enumerate(samples):
        p, r = len(s.prompt), len(s.response)
        f["prompts"][i, p_max - p :] = s.prompt
        f["responses"][i, :r] = s.response
        f["response_mask"][i, :r] = 1
        f["input_ids"][i] = np.concatenate([f["prompts"][i], f["responses"][i]])
        f["attention_mask"][i, p_max - p : p_max + r] = 1
        f["position_ids"][i, p_max - p :] = np.arange(width - p_max + p)
        f["rollout_log_probs"][i, :r] = s.logprobs
        f["routed_experts"][i, p_max - p : p_max - p + len(s.routes)] = s.routes
    return f


def _consolidated(fields: dict[str, npt.NDArray[Any]]) -> Any:
    """A consolidated TensorDict as ``torch.save`` pickles it: one byte storage, per-leaf spans."""

    def _rebuild_tensordict_files_consolidated(metadata: Any, storage: Any) -> Any:
        raise AssertionError("never called")

    rebuild = named("tensordict._reductions", "_rebuild_tensordict_files_consolidated",
                    _rebuild_tensordict_files_consolidated)  # fmt: skip
    leaves, chunks, offset = {}, [], 0
    for key, value in fields.items():
        data = value.tobytes()
        leaves[key] = (f"torch.{value.dtype}", list(value.shape), offset, offset + len(data), 0)
        chunks.append(data)
        offset += len(data)
    batch = len(next(iter(fields.values())))
    metadata = {
        "cls": "TensorDict", "non_tensors": {}, "leaves": leaves,
        "cls_metadata": {"device": None, "names": [None], "batch_size": [batch], "is_locked": False},
    }  # fmt: skip
    storage = torch.from_numpy(np.frombuffer(b"".join(chunks), dtype=np.uint8).copy())
    return _Call(rebuild, metadata, storage)


def _verl_synthetic(root: Path, steps: dict[int, list[Sample]], numpy_batch: bool = False) -> None:
    """The dumps as ``RolloutSkip.prepare_data`` writes them, without verl or tensordict."""

    class DataProto:
        def __init__(self, state: tuple[Any, ...]) -> None:
            self.state = state

        def __getstate__(self) -> tuple[Any, ...]:
            return self.state

    named("verl.protocol", "DataProto", DataProto)
    run = verl_run(steps)
    for step, samples in steps.items():
        fields = _verl_fields(samples, run)
        if numpy_batch:  # VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
            batch: Any = (
                (len(samples),), None,
                {k: (str(v.dtype), torch.Size(v.shape), v.reshape(-1).view(np.uint8))
                 for k, v in fields.items()},
            )  # fmt: skip
        else:
            batch = torch_bytes(_consolidated(fields))
        non_tensor = {
            "uid": np.array([f"uid-{s.group}" for s in samples], dtype=object),
            "__num_turns__": np.full(len(samples), 2, dtype=np.int32),
        }
        meta = {"timing": {"agent_loop/generate_sequences/mean": np.float64(0.5)}}
        directory = root / run.directory / str(step)
        directory.mkdir(parents=True)
        (directory / "gen_batch.dp").write_bytes(dumps_named(DataProto((batch, non_tensor, meta))))
        (directory / "meta.json").write_text(json.dumps({"global_steps": step}))


def _verl_release(root: Path, steps: dict[int, list[Sample]]) -> None:
    """The dumps written by verl 0.9.1's own code: the agent loop's postprocess of each sample, its
    batch ``_postprocess``, the manager's ``meta_info`` and ``RolloutSkip.prepare_data``."""
    if installed_version("verl") != "0.9.1":
        pytest.skip(f"verl 0.9.1 is not installed (found {installed_version('verl')}); run tox -e verl-0.9.1")
    from omegaconf import OmegaConf
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
    from verl.utils.skip.config import RolloutSkipConfig
    from verl.utils.skip.rollout_skip import RolloutSkip

    worker: Any = object.__new__(AgentLoopWorker)  # only what the postprocess reads
    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    worker.tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")
    worker.processor = worker.mm_processor_kwargs = worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    run = verl_run(steps)
    worker.rollout_config = types.SimpleNamespace(prompt_length=run.p_max, response_length=run.r_max)
    config = OmegaConf.create(
        {"trainer": {"experiment_name": "exp", "project_name": "proj"},
         "data": {"train_batch_size": run.groups, "max_prompt_length": run.p_max,
                  "max_response_length": run.r_max},
         "actor_rollout_ref": {"rollout": {"n": run.n}}}
    )  # fmt: skip
    skip = RolloutSkip(RolloutSkipConfig(enable=True, dump_dir=str(root)), config)
    for step, samples in steps.items():
        padded = [
            asyncio.run(
                worker._agent_loop_postprocess(
                    AgentLoopOutput(
                        prompt_ids=s.prompt.tolist(), response_ids=s.response.tolist(),
                        response_mask=[1] * len(s.response), response_logprobs=s.logprobs.tolist(),
                        routed_experts=s.routes, metrics=AgentLoopMetrics(),
                    ),
                    False, raw_prompt=None,
                )
            )
            for s in samples
        ]  # fmt: skip
        uids = np.array([f"uid-{s.group}" for s in samples], dtype=object)
        output = worker._postprocess(padded, input_non_tensor_batch={"uid": uids})
        output.meta_info.pop("metrics")  # AgentLoopManager.generate_sequences (agent_loop.py:1231-1260)
        output.meta_info = {
            "timing": {"agent_loop/generate_sequences/mean": np.float64(0.5)},
            **output.meta_info,
        }
        skip.prepare_data(step, output)
        assert (root / run.directory / str(step) / "gen_batch.dp").is_file(), (
            "RolloutSkip.prepare_data did not dump"
        )


# --- importing and auditing -----------------------------------------------------------------------


def _steps(faulty: bool, long_payload: bool) -> tuple[dict[int, list[Sample]], list[tuple[Any, ...]]]:
    steps = {step: rollout(step) for step in STEPS}
    faults = plant(steps[FAULT_STEP], long_payload) if faulty else []
    return steps, [(inv, FAULT_STEP, key, row, layer) for inv, key, row, layer in faults]


def _import(name: str, dump: Path, run: Path, monkeypatch: pytest.MonkeyPatch) -> list[SampleRecord]:
    """Import through the registry (num_experts from ``$RRH_NUM_EXPERTS``) and return the records."""
    monkeypatch.setenv("RRH_NUM_EXPERTS", str(E))
    monkeypatch.delenv("RRH_MOE_LAYERS", raising=False)
    assert detect(dump) == name
    import_dump(name, dump, run)
    return list({"skyrl": skyrl_importer, "verl": verl_importer}[name].records(dump))


def _check(result: AuditResult, faults: list[tuple[Any, ...]], not_checkable: set[str]) -> None:
    """No strict violation but the planted ones, each named at its cell; ``not_checkable`` so."""
    by_name = {r.name: r for r in result.invariants}
    assert not result.input_errors
    assert {r.name for r in result.violated} == {f[0] for f in faults}, [r.line() for r in result.violated]
    for invariant, step, key, row, layer in faults:
        cells = [(o["step"], o["sample_key"], o["row"], o["layer"]) for o in by_name[invariant].offenders]
        assert (step, key, row, layer) in cells, (invariant, cells)
    assert {n for n, r in by_name.items() if r.status == "not checkable"} >= not_checkable
    for name in ("coverage", "ids_valid", "dense_empty", "moe_layer_nonzero", "logprobs_valid"):
        assert by_name[name].status != "not checkable", name
    # Sample 1's two rows never fed to the engine are "no route captured" (the first step is clean).
    uncaptured = {(s.step, s.sample_key): s.uncaptured_rows for s in result.samples}
    assert uncaptured[(STEPS[0], "1")] == 2


SKYRL_NOT_CHECKABLE = {"replay_fidelity", "agreement", "tokens_match"}
VERL_NOT_CHECKABLE = SKYRL_NOT_CHECKABLE | {"logprob_gap"}


def _skyrl_dump(export: Path, write: Any, faulty: bool) -> list[tuple[Any, ...]]:
    """The two steps written as SkyRL writes them (``write``) at ``export``; the faults planted."""
    steps, faults = _steps(faulty, long_payload=False)
    shift = {}
    if faulty:
        target = shift_target(steps[FAULT_STEP])
        shift = {FAULT_STEP: target}
        s = steps[FAULT_STEP][target]
        faults.append(("coverage", FAULT_STEP, str(target), s.length - 1, None))
    write(export, steps, shift)
    return faults


def _verl_dump(root: Path, write: Any, faulty: bool) -> list[tuple[Any, ...]]:
    """The two steps written as verl's RolloutSkip writes them (``write``) under ``root``; the faults."""
    steps, faults = _steps(faulty, long_payload=True)
    write(root, steps)
    return faults


def _audit_skyrl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Any, faulty: bool
) -> list[SampleRecord]:
    faults = _skyrl_dump(tmp_path / "export", write, faulty)
    records = _import("skyrl", tmp_path / "export", tmp_path / "run", monkeypatch)
    _check(audit_run(tmp_path / "run", executor="serial"), faults, SKYRL_NOT_CHECKABLE)
    return records


def _audit_verl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Any, faulty: bool
) -> list[SampleRecord]:
    faults = _verl_dump(tmp_path / "dump", write, faulty)
    records = _import("verl", tmp_path / "dump", tmp_path / "run", monkeypatch)
    _check(audit_run(tmp_path / "run", executor="serial"), faults, VERL_NOT_CHECKABLE)
    return records


# --- what the CLI prints: golden transcripts (tests/transcripts/), synthetic and release-written ---


def _transcript(
    name: str, write: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """``rrh audit EXPERIMENT --num-experts 16`` of the faulty dump written by ``write``, found one folder
    below the experiment folder (verl: ``rollout_dump/``, SkyRL: ``export/``), MoE layers inferred."""
    monkeypatch.delenv("RRH_NUM_EXPERTS", raising=False)
    monkeypatch.delenv("RRH_MOE_LAYERS", raising=False)
    experiment = tmp_path / "experiment"
    if name == "skyrl":
        _skyrl_dump(experiment / "export", write, faulty=True)
    else:
        _verl_dump(experiment / "rollout_dump", write, faulty=True)
    (tmp_path / "scratch").mkdir()
    return transcript(capsys, [str(experiment), "--num-experts", str(E)], experiment, tmp_path / "scratch")


def _same(a: list[SampleRecord], b: list[SampleRecord], roots: tuple[Path, Path]) -> None:
    """Two imports (of dumps under ``roots``) hold the same records, field by field; places the same
    within their dump."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name, value in vars(x).items():
            other = getattr(y, name)
            if name == "origin":
                value, other = value.replace(str(roots[0]), "<DUMP>"), other.replace(str(roots[1]), "<DUMP>")
            if isinstance(value, np.ndarray) or isinstance(other, np.ndarray):
                mine, theirs = np.asarray(value), np.asarray(other)
                assert np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f"), name
            else:
                assert value == other, name


# --- default run: synthetic dumps in the frameworks' formats -------------------------------------


@pytest.mark.parametrize("padding_mask", [False, True], ids=["zero-filler", "router_padding_mask"])
def test_skyrl_dump_converts_field_by_field(tmp_path: Path, padding_mask: bool) -> None:
    samples = rollout(1)
    _skyrl_synthetic(tmp_path, {7: samples}, {}, padding_mask)
    records = list(skyrl_importer.records(tmp_path, num_experts=E))
    assert len(records) == len(samples)  # the DP padding copy of sample 0 is dropped
    for i, (record, s) in enumerate(zip(records, samples, strict=True)):
        p, r = len(s.prompt), len(s.response)
        group = f"samples {N * s.group}-{N * s.group + N - 1}"
        assert (record.step, record.sample_key, record.group_key) == (7, str(i), group)
        assert (record.prompt_len, record.response_len) == (p, r)
        assert np.array_equal(record.tokens, np.concatenate([s.prompt, s.response]))
        assert np.array_equal(record.engine_logprobs, s.logprobs)
        assert np.allclose(record.trainer_logprobs, s.logprobs - 1e-3)
        assert record.loss_mask.all() and record.replay is None and record.trainer_routes is None
        rows = min(len(s.routes), p + r - 1)
        assert record.engine_routes.shape == (p + r - 1, L, K)
        assert np.array_equal(record.engine_routes[:rows], s.routes[:rows])
        assert not record.engine_routes[rows:].any()  # filler is never a route
        assert record.engine_captured.tolist() == [True] * rows + [False] * (p + r - 1 - rows)
        assert (record.num_experts, record.top_k, record.num_layers, record.moe_layers) == (
            E,
            K,
            L,
            (1, 2, 3),
        )


@pytest.mark.parametrize("numpy_batch", [False, True], ids=["tensordict", "numpy-serialization"])
def test_verl_dump_converts_field_by_field(tmp_path: Path, numpy_batch: bool) -> None:
    samples = rollout(1)
    _verl_synthetic(tmp_path, {5: samples}, numpy_batch)
    records = list(verl_importer.records(tmp_path, num_experts=E))
    for i, (record, s) in enumerate(zip(records, samples, strict=True)):
        p, r = len(s.prompt), len(s.response)
        assert (record.step, record.sample_key, record.group_key) == (5, str(i), f"uid-{s.group}")
        assert (record.prompt_len, record.response_len) == (p, r)
        assert np.array_equal(record.tokens, np.concatenate([s.prompt, s.response]))
        assert np.array_equal(record.engine_logprobs, s.logprobs) and record.trainer_logprobs is None
        rows = min(len(s.routes), p + r - 1)
        assert np.array_equal(record.engine_routes[:rows], s.routes[:rows])
        assert record.engine_captured.tolist() == [True] * rows + [False] * (p + r - 1 - rows)
        assert record.moe_layers == (1, 2, 3)


def test_verl_groups_come_from_the_dump_directory_without_uids(tmp_path: Path) -> None:
    _verl_synthetic(tmp_path, {5: rollout(1)})
    file = tmp_path / DUMP_DIR / "5" / "gen_batch.dp"
    assert verl_importer.group_size_of(file) == N
    groups = verl_importer._groups({}, 4, verl_importer.group_size_of(file))
    assert groups == ["samples 0-1", "samples 0-1", "samples 2-3", "samples 2-3"]


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "faults"])
def test_skyrl_synthetic_dump_audits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    _audit_skyrl(tmp_path, monkeypatch, _skyrl_synthetic, faulty)


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "faults"])
def test_verl_synthetic_dump_audits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    _audit_verl(tmp_path, monkeypatch, _verl_synthetic, faulty)


def test_num_experts_is_an_explicit_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skyrl_synthetic(tmp_path, {1: rollout(1)}, {})
    monkeypatch.delenv("RRH_NUM_EXPERTS", raising=False)
    with pytest.raises(LayoutError, match="num_experts: a SkyRL dump does not record it; expected"):
        next(skyrl_importer.records(tmp_path))
    monkeypatch.setenv("RRH_NUM_EXPERTS", "sixteen")
    with pytest.raises(LayoutError, match="RRH_NUM_EXPERTS='sixteen': expected an integer"):
        next(skyrl_importer.records(tmp_path))
    monkeypatch.setenv("RRH_NUM_EXPERTS", str(E))
    monkeypatch.setenv("RRH_MOE_LAYERS", "1-2,3")
    assert next(skyrl_importer.records(tmp_path)).moe_layers == (1, 2, 3)
    monkeypatch.setenv("RRH_MOE_LAYERS", "0-4")
    with pytest.raises(LayoutError, match=r"moe_layers \[0, 1, 2, 3, 4\]; expected .* in \[0, 4\)"):
        next(skyrl_importer.records(tmp_path))


def test_an_id_the_layout_cannot_store_is_named_and_leaves_the_other_samples_audited(tmp_path: Path) -> None:
    samples = rollout(1)
    samples[2].routes[4, 1, 1] = -3  # an int16 wrap
    _verl_synthetic(tmp_path, {5: samples})
    column = P_MAX - len(samples[2].prompt) + 4
    message = (
        rf"gen_batch.dp batch row 2, token column {column}: step 5 sample 2 row 4 layer 1: expert id -3; "
        r"expected an id in \[0, 16\)"
    )
    with pytest.raises(LayoutError, match=message):
        list(verl_importer.records(tmp_path, num_experts=E))
    errors: list[str] = []
    kept = [r.sample_key for r in verl_importer.records(tmp_path, num_experts=E, errors=errors)]
    assert kept == ["0", "1", "3"] and len(errors) == 1 and "expert id -3" in errors[0], (kept, errors)


def test_each_importer_detects_only_its_own_dump(tmp_path: Path) -> None:
    _skyrl_synthetic(tmp_path / "sky", {1: rollout(1)}, {})
    _verl_synthetic(tmp_path / "verl", {1: rollout(1)})
    assert skyrl_importer.detect(tmp_path / "sky") and not verl_importer.detect(tmp_path / "sky")
    assert verl_importer.detect(tmp_path / "verl") and not skyrl_importer.detect(tmp_path / "verl")
    assert skyrl_importer.detect(tmp_path / "sky" / "dumped_data" / "global_step_1_training_input.pkl")
    assert verl_importer.detect(tmp_path / "verl" / DUMP_DIR / "1")
    assert not skyrl_importer.detect(tmp_path / "nothing") and not verl_importer.detect(tmp_path / "nothing")


# --- the released frameworks' own code -------------------------------------------------------------


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "faults"])
def test_skyrl_release_dump_audits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    _skyrl_modules()
    released = _audit_skyrl(tmp_path / "release", monkeypatch, _skyrl_release, faulty)
    synthetic = _audit_skyrl(tmp_path / "synthetic", monkeypatch, _skyrl_synthetic, faulty)
    _same(released, synthetic, (tmp_path / "release", tmp_path / "synthetic"))


@pytest.mark.parametrize("faulty", [False, True], ids=["clean", "faults"])
def test_verl_release_dump_audits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty: bool) -> None:
    released = _audit_verl(tmp_path / "release", monkeypatch, _verl_release, faulty)
    synthetic = _audit_verl(tmp_path / "synthetic", monkeypatch, _verl_synthetic, faulty)
    _same(released, synthetic, (tmp_path / "release", tmp_path / "synthetic"))


def test_skyrl_audit_prints_the_committed_transcript(tmp_path: Path, capsys, monkeypatch) -> None:
    check("skyrl", _transcript("skyrl", _skyrl_synthetic, tmp_path, capsys, monkeypatch))


def test_verl_audit_prints_the_committed_transcript(tmp_path: Path, capsys, monkeypatch) -> None:
    check("verl", _transcript("verl", _verl_synthetic, tmp_path, capsys, monkeypatch))


def test_skyrl_release_dump_prints_the_committed_transcript(tmp_path: Path, capsys, monkeypatch) -> None:
    _skyrl_modules()
    check("skyrl", _transcript("skyrl", _skyrl_release, tmp_path, capsys, monkeypatch))


def test_verl_release_dump_prints_the_committed_transcript(tmp_path: Path, capsys, monkeypatch) -> None:
    check("verl", _transcript("verl", _verl_release, tmp_path, capsys, monkeypatch))


def resumed_twice_skyrl(export: Path) -> None:
    """A SkyRL dump (one step, two groups of two) whose sample 3 holds rows a resume appended twice,
    cut back to ``P + R`` (``repeated_rows``' fault: a detector names it, nothing strict can)."""
    rng = np.random.default_rng(9)
    samples = []
    for group in range(2):
        prompt = rng.integers(2, 1000, size=8)
        for _ in range(2):
            routes = _routes(rng, 8 + 40 - 1)
            samples.append(
                Sample(group, prompt, rng.integers(2, 1000, size=40), routes, -np.ones(40, np.float32))
            )
    samples[3].routes[20:26] = samples[3].routes[14:20]
    _skyrl_synthetic(export, {1: samples}, {})
