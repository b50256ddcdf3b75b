"""``rrh run``: a small real RL loop on CPU, written through the tap (``harness.audit.tap.trainer``).

- **Engine**: real vLLM or (``--engine sglang``) real SGLang, in-process adapters of
  ``harness.engines``, serves the harness's tiny Qwen3-MoE checkpoint in bf16 (``harness.engines.real``)
  and samples ``group`` responses per prompt. Each step also runs one multi-turn episode (a turn,
  tool tokens, a second turn) and one partial rollout: started at step s, stopped half-way (what a
  framework's abort returns: the rows so far; here the stop is a token budget), resumed with its
  tokens appended after the weight push, under weight version s + 1, and trained at step s + 1.
- **Splice**: the subject's ``splice`` builds each sample's engine routes from its attempts
  (``--splice latest``: the "replace with the latest payload" policy, ``reference_impl.splice``).
- **Trainer**: transformers, the same checkpoint, recomputes old log-probs with replay none, R2 or
  R3 through the subject's ``install_hf_replay`` driver (the harness's hooks by default; R2 records
  the routes of this pass and replays them in the update passes), then per mini-batch runs an
  update pass and takes an Adam step on a verifiable reward (the fraction of even token ids in
  the response, advantage against the group mean), and pushes the new weights into the running
  engine between steps (the engine adapter's ``load_weights``), so attempts of one
  sample run under different weights.
- **Tap**: the engine side records every attempt's own payload, the trainer side what the
  harness's probe saw each router dispatch, per packed row; one file per step.
- **Ranks** (``--ranks N --split cp|sp|sp-halo``, ``harness.run.ranks``): N − 1 more trainer
  processes on the run's own gloo group, each tapping its CP/SP shard of every sample into its own
  per-rank files, so ``rrh audit`` checks ``shard_union`` on them.

The loop needs the engine's tox env (``tox -e vllm-cpu``, ``tox -e sglang-cpu``); ``rrh audit DIR``
reads its output.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.audit.layout.schema import REPLAY_MODES
from harness.audit.tap.engine import EngineSample, EngineTap, TapError
from harness.audit.tap.trainer import BackgroundWriter, PackedRows, TrainerTap
from harness.engines.real import REAL_ENGINES
from harness.run.ranks import SPLITS, RankGroup, ranks_started, samples_from_json, samples_to_json, shard_mask

SPLICES = ("correct", "latest")
TOOL_TOKENS = (5, 6, 7)
"""The tool/observation tokens the multi-turn episode appends between its turns."""


@dataclass(frozen=True)
class RunConfig:
    """One run: its size, replay mode, splice policy and subject (``module:attr``; None: the reference)."""

    steps: int = 3
    prompts: int = 2
    group: int = 4
    prompt_len: int = 12
    response_len: int = 16
    replay: str = "R3"
    splice: str = "correct"
    subject: str | None = None
    lr: float = 1e-2
    minibatches: int = 2
    """Update passes (and Adam steps) per step, each on its share of the samples (PPO mini-batches)."""
    ranks: int = 1
    """Trainer ranks on gloo, each holding a ``split`` shard of every sample (``harness.run.ranks``)."""
    split: str = "cp"
    seed: int = 0
    engine_from: str | None = None
    """A tapped run's directory: its recorded engine attempts stand in for the engine (an env
    without vLLM)."""
    engine: str = "vllm"
    """The rollout engine: ``vllm`` or ``sglang`` (``harness.engines.real``)."""

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            raise TapError(f"--replay: expected one of {list(REPLAY_MODES)}, got {self.replay!r}")
        if self.engine not in REAL_ENGINES:
            raise TapError(f"--engine: expected one of {list(REAL_ENGINES)}, got {self.engine!r}")
        if self.splice not in SPLICES:
            raise TapError(f"--splice: expected one of {list(SPLICES)}, got {self.splice!r}")
        if self.split not in SPLITS:
            raise TapError(f"--split: expected one of {list(SPLITS)}, got {self.split!r}")
        for name in ("steps", "prompts", "group", "minibatches", "ranks"):
            if getattr(self, name) < 1:
                raise TapError(f"--{name}: expected a positive integer, got {getattr(self, name)}")
        if self.response_len < len(TOOL_TOKENS) + 4:
            raise TapError(
                f"--response-len: expected at least {len(TOOL_TOKENS) + 4}, got {self.response_len}"
            )


def _subject(spec: str | None) -> Any:
    from harness.subjects import load_subject
    from harness.subjects.reference import REFERENCE

    return REFERENCE if spec is None else load_subject(spec)


def _splice(cfg: RunConfig, subject: Any) -> Callable[..., torch.Tensor]:
    from reference_impl.splice import splice_replace

    return splice_replace if cfg.splice == "latest" else subject.splice  # type: ignore[no-any-return]


def _spliced(sample: EngineSample, splice: Callable[..., torch.Tensor]) -> np.ndarray:
    """The framework's engine routes of ``sample``: its attempts spliced by ``splice``."""
    from reference_impl.splice import Attempt

    attempts, before = [], 0
    for a, end in zip(sample.attempts, sample.attempt_ends(), strict=True):
        tool = len(a.context) - sample.prompt_len - before if a.kind == "turn" else 0
        attempts.append(
            Attempt(
                end - before,
                torch.from_numpy(a.routes.astype(np.int64)),
                "abort" if a is not sample.attempts[-1] else "stop",
                a.kind,
                tool,
                a.weight_version,
            )
        )
        before = end
    # Any representation a subject returns (a tensor, a numpy array): the ids are what count.
    return torch.as_tensor(np.asarray(splice(sample.prompt_len, attempts))).numpy()


def _push_weights(engine: Any, model: Any, scratch: Path) -> None:
    """Push the trainer's new weights into the running engine: saved in the checkpoint layout every
    engine reads (with the served config) and loaded in place by the engine's own weight loading
    (``load_weights``: vLLM's ``reload_weights``, the CPU experts re-prepacked; SGLang's
    ``update_weights_from_disk``)."""
    import shutil

    model.save_pretrained(scratch, safe_serialization=True)
    shutil.copy(engine.checkpoint.path / "config.json", scratch / "config.json")
    engine.load_weights(scratch)


def _reward(tokens: tuple[int, ...]) -> float:
    """The verifiable reward: the fraction of even token ids."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


class _Trainer:
    """The transformers trainer of the loop: batches, replay through the subject's driver, the tap."""

    def __init__(
        self,
        cfg: RunConfig,
        ckpt: Any,
        subject: Any,
        writer: BackgroundWriter,
        source: str,
        group: RankGroup | None = None,
    ) -> None:
        from harness.engines.checkpoint import load_checkpoint
        from harness.subjects.replay import install, prepare

        prepare(subject.install_hf_replay, "install_hf_replay")  # patch before building the model
        self.model = load_checkpoint(ckpt)
        self.model.train()
        self.handle = install(subject.install_hf_replay, self.model, "install_hf_replay")
        spec = ckpt.spec
        self.moe_layers = tuple(spec.moe_layers or range(spec.num_layers))
        self.top_k = spec.top_k
        shape = dict(num_layers=spec.num_layers, moe_layers=self.moe_layers, num_experts=spec.num_experts,
                     top_k=spec.top_k, source=source)  # fmt: skip
        # Rank 0 taps whole samples; with ranks, every rank also taps its shard's rows.
        rank = 0 if group is None else group.rank
        self.tap = TrainerTap(self.model, writer, **shape) if rank == 0 else None  # type: ignore[arg-type]
        self.shard_tap = (
            None if group is None else TrainerTap(self.model, writer, shard=rank, shards=group.world, **shape)  # type: ignore[arg-type]
        )
        self.group = group
        self.cfg = cfg
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)

    def _batch(
        self, samples: list[EngineSample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids, attention mask, R3 targets ``[B·S, n_moe, k]`` and their mask."""
        width = max(len(s.tokens) for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.int64)
        mask = torch.zeros(len(samples), width, dtype=torch.bool)
        targets = torch.zeros(len(samples), width, len(self.moe_layers), self.top_k, dtype=torch.int64)
        replayed = torch.zeros(len(samples), width, dtype=torch.bool)
        for i, s in enumerate(samples):
            n = len(s.tokens)
            ids[i, :n] = torch.tensor(s.tokens)
            mask[i, :n] = True
            assert s.spliced is not None
            routes = torch.from_numpy(s.spliced.astype(np.int64))[:, list(self.moe_layers)]
            targets[i, : routes.shape[0]] = routes
            replayed[i, : routes.shape[0]] = True  # the last token has no row: it routes natively
        return ids, mask, targets.reshape(-1, *targets.shape[2:]), replayed.reshape(-1)

    @contextmanager
    def _tapped(
        self, kind: str, keys: list[str], ids: torch.Tensor, mask: torch.Tensor, held: torch.Tensor
    ) -> Iterator[None]:
        """The forward inside, tapped: whole samples (rank 0) and this rank's shard rows (``held``)."""
        with ExitStack() as stack:
            if self.tap is not None:
                stack.enter_context(self.tap.forward(kind, PackedRows.padded(keys, mask.numpy()), ids))
            if self.shard_tap is not None:
                rows = PackedRows.padded(keys, held.numpy())
                position = np.where(held.numpy(), np.arange(ids.shape[1]), -1).reshape(-1)
                rows = PackedRows(rows.keys, rows.sample, position)
                stack.enter_context(self.shard_tap.forward(kind, rows, ids))
            yield

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits
        picked = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return torch.cat([picked.new_zeros(ids.shape[0], 1), picked], dim=1)

    def step(self, step: int, samples: list[EngineSample]) -> dict[str, float]:
        """Old log-probs of ``samples`` (recorded under R2, replayed under R3), then one update pass
        and Adam step per mini-batch: from the second mini-batch on the weights differ from the
        old-log-prob pass's, so native routing would no longer give the recorded routes."""
        cfg, handle = self.cfg, self.handle
        ids, mask, targets, replayed = self._batch(samples)
        keys = [s.key for s in samples]
        lengths = [len(s.tokens) for s in samples]
        group = self.group
        width = ids.shape[1]
        held = mask if group is None else shard_mask(cfg.split, lengths, width, group.rank, group.world)
        owns = torch.zeros_like(mask)  # the tokens this rank's rows predict: its share of the loss
        owns[:, 1:] = held[:, :-1]
        with torch.no_grad():
            if cfg.replay == "R3":
                handle.replay(targets, replayed)
            elif cfg.replay == "R2":
                handle.record()
            else:
                handle.disarm()
            with self._tapped("old_logprob", keys, ids, mask, held):
                old = self._logprobs(ids, mask)
            recorded = handle.recording() if cfg.replay == "R2" else None
            handle.disarm()
        for i, s in enumerate(samples):
            if self.tap is not None:
                self.tap.logprobs(s.key, old[i, s.prompt_len : s.prompt_len + s.response_len].numpy())
        rewards = torch.tensor([_reward(s.tokens[s.prompt_len :]) for s in samples])
        groups: dict[str | None, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_key, []).append(i)
        advantage = torch.zeros(len(samples))
        for members in groups.values():
            advantage[members] = rewards[members] - rewards[members].mean()
        response = torch.zeros_like(mask)
        for i, s in enumerate(samples):
            response[i, s.prompt_len : s.prompt_len + s.response_len] = True
        losses = []
        for chunk in torch.arange(len(samples)).chunk(cfg.minibatches):
            flat = (chunk[:, None] * width + torch.arange(width)).reshape(-1)  # the chunk's rows
            if cfg.replay == "R3":
                handle.replay(targets[flat], replayed[flat])
            elif recorded is not None:
                handle.replay(recorded[flat], mask.reshape(-1)[flat])
            sub = [keys[i] for i in chunk.tolist()]
            with self._tapped("update", sub, ids[chunk], mask[chunk], held[chunk]):
                new = self._logprobs(ids[chunk], mask[chunk])
            handle.disarm()
            ratio = torch.exp(new - old[chunk].detach())
            weight = advantage[chunk][:, None] * (response[chunk] & owns[chunk])
            loss = -(weight * ratio).sum() / response[chunk].sum()
            self.optimizer.zero_grad()
            loss.backward()
            if group is not None:
                group.sum_gradients(self.model)
            self.optimizer.step()
            losses.append(float(loss.detach()))
        for tap in (self.tap, self.shard_tap):
            if tap is not None:
                tap.write(step, samples, replay=cfg.replay)
        return {"loss": float(np.mean(losses)), "reward": float(rewards.mean())}


def run_loop(
    directory: str | Path, cfg: RunConfig = RunConfig(), log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run the loop (see the module docstring), writing the tapped run into ``directory``."""
    from harness.engines.real import engine_checkpoint, engine_class

    start = time.perf_counter()
    subject = _subject(cfg.subject)
    splice = _splice(cfg, subject)
    out = Path(directory)
    figures: list[dict[str, float]] = []
    recorded = None if cfg.engine_from is None else recorded_samples(cfg.engine_from)
    with tempfile.TemporaryDirectory(prefix="rrh-run-") as tmp:
        ckpt = engine_checkpoint(cfg.engine, Path(tmp) / "ckpt", dtype=torch.bfloat16, seed=cfg.seed)
        engine = engine_class(cfg.engine)(ckpt, seed=cfg.seed) if recorded is None else None
        engine_name = (
            f"{cfg.engine} {engine.version}"
            if engine is not None
            else f"recorded engine payloads of {cfg.engine_from}"
        )
        source = f"{engine_name} + transformers ({subject.name}, splice {cfg.splice}), rrh run"
        engine_tap = EngineTap()
        gen = torch.Generator().manual_seed(cfg.seed)
        ranks = ranks_started(
            cfg.ranks, Path(tmp), _rank_main, str(out), json.dumps(asdict(cfg)), str(ckpt.path), source
        )
        try:
            with ranks as group, BackgroundWriter(out, world_size=cfg.ranks) as writer:
                trainer = _Trainer(cfg, ckpt, subject, writer, source, group)
                carried: str | None = None
                for step in range(cfg.steps):
                    if recorded is not None:
                        samples = recorded.get(step, [])
                    else:
                        keys = _rollouts(engine, engine_tap, cfg, step, gen, carried)
                        carried = (
                            _start_partial(engine, engine_tap, cfg, step, gen)
                            if step + 1 < cfg.steps
                            else None
                        )
                        samples = [engine_tap.pop(k) for k in keys]
                    if not samples:
                        raise TapError(f"--engine-from: no sample of step {step} in {cfg.engine_from}; "
                                       "expected --steps "
                                       f"at most the recorded run's")  # fmt: skip
                    for s in samples:
                        s.spliced = _spliced(s, splice)
                    if group is not None:
                        group.broadcast_bytes(samples_to_json(samples))
                    figures.append({"step": step, **trainer.step(step, samples)})
                    if engine is not None:
                        _push_weights(engine, trainer.model, Path(tmp) / f"push-{step}")
                    log(f"step {step}: {len(samples)} samples, reward {figures[-1]['reward']:.3f}, "
                        f"loss {figures[-1]['loss']:.4f}"
                        + ("; weights pushed" if engine is not None else ""))  # fmt: skip
        finally:
            if engine is not None:
                engine.close()
    seconds = time.perf_counter() - start
    summary = {"config": asdict(cfg), "seconds": seconds, "steps": figures, "directory": str(out)}
    (out / "run.json").write_text(json.dumps(summary, indent=1))
    return summary


def _rank_main(rank: int, rendezvous: str, out: str, cfg_json: str, checkpoint: str, source: str) -> None:
    """Trainer rank ``rank`` ≥ 1 of a ``--ranks`` run (a spawned process, ``ranks_started``): each
    step, the samples rank 0 sends over the gloo group, trained on this rank's shard of each."""
    from harness.engines.checkpoint import TinyCheckpoint, model_spec

    cfg = RunConfig(**json.loads(cfg_json))
    group = RankGroup(Path(rendezvous), rank, cfg.ranks)
    checkpoint_path = Path(checkpoint)
    config = json.loads((checkpoint_path / "config.json").read_text())
    ckpt = TinyCheckpoint(checkpoint_path, config["model_type"], config["torch_dtype"], model_spec(config),
                          config, cfg.seed)  # fmt: skip
    with BackgroundWriter(out, rank=group.rank, world_size=group.world) as writer:
        trainer = _Trainer(cfg, ckpt, _subject(cfg.subject), writer, source, group)
        for step in range(cfg.steps):
            trainer.step(step, samples_from_json(group.broadcast_bytes(None)))


def _prompts(cfg: RunConfig, count: int, gen: torch.Generator, vocab: int) -> list[list[int]]:
    return torch.randint(8, vocab, (count, cfg.prompt_len), generator=gen).tolist()  # type: ignore[no-any-return]


def _rollouts(
    engine: Any, tap: EngineTap, cfg: RunConfig, step: int, gen: torch.Generator, carried: str | None
) -> list[str]:
    """Step ``step``'s samples through the engine tap: groups, one multi-turn episode, the resumed partial."""
    version = step
    keys = []
    prompts = _prompts(cfg, cfg.prompts + 1, gen, engine.checkpoint.vocab_size)
    groups = engine.sample(prompts[:-1], cfg.response_len, n=cfg.group, temperature=1.0, seed=None)
    for p, group in enumerate(groups):
        for g, rollout in enumerate(group):
            key = f"s{step}-p{p}-g{g}"
            tap.attempt(key, rollout, kind="start", weight_version=version, group_key=f"s{step}-p{p}")
            keys.append(key)
    # A multi-turn episode: a turn, tool tokens, a second turn (one weight version).
    key = f"s{step}-turns"
    first = cfg.response_len // 2
    rollout = engine.generate([prompts[-1]], first, temperature=1.0, seed=None)[0]
    tap.attempt(key, rollout, kind="start", weight_version=version)
    context = list(rollout.sequence) + list(TOOL_TOKENS)
    rollout = engine.generate(
        [context], cfg.response_len - first - len(TOOL_TOKENS), temperature=1.0, seed=None
    )[0]
    tap.attempt(key, rollout, kind="turn", weight_version=version)
    keys.append(key)
    if carried is not None:  # the partial rollout of the previous step, resumed under the new weights
        sample = tap.samples[carried]
        rest = cfg.response_len - sample.response_len
        rollout = engine.generate([list(sample.tokens)], rest, temperature=1.0, seed=None)[0]
        tap.attempt(carried, rollout, kind="resume", weight_version=version)
        keys.append(carried)
    return keys


def _start_partial(engine: Any, tap: EngineTap, cfg: RunConfig, step: int, gen: torch.Generator) -> str:
    """Start a sample and stop it half-way (resumed next step, after the weight push)."""
    key = f"s{step}-partial"
    prompt = _prompts(cfg, 1, gen, engine.checkpoint.vocab_size)[0]
    rollout = engine.generate([prompt], cfg.response_len // 2, temperature=1.0, seed=None)[0]
    tap.attempt(key, rollout, kind="start", weight_version=step)
    return key


def recorded_samples(run: str | Path) -> dict[int, list[EngineSample]]:
    """The engine side of a tapped run, per step: each sample's attempts as the engine tap recorded
    them (tokens, kinds, weight versions, own payloads, log-probs), for a trainer in an env without vLLM."""
    import pyarrow.parquet as pq

    from harness.audit.layout.reader import run_files
    from harness.audit.tap.engine import TapAttempt
    from harness.trace import storage_dtype

    out: dict[int, list[EngineSample]] = {}
    for path in run_files(run):
        for row in pq.read_table(path).to_pylist():
            if row["shard"] is not None:
                continue
            if row["attempt_routes"] is None:
                raise TapError(
                    f"{path}: sample {row['sample_key']!r} has no attempt_routes; expected a tapped run"
                )
            tokens, prompt = tuple(row["tokens"]), row["prompt_len"]
            shape = (row["num_layers"], row["top_k"])
            flat = np.frombuffer(
                row["attempt_routes"], dtype=storage_dtype(row["num_experts"]).newbyteorder("<")
            )
            payloads = np.split(flat.reshape(-1, *shape), np.cumsum(row["attempt_rows"])[:-1])
            sample = EngineSample(row["sample_key"], row["group_key"], prompt)
            before = 0
            for kind, version, end, routes in zip(row["attempt_kinds"], row["weight_versions"],
                                                  row["attempt_ends"],
                                                  payloads, strict=True):  # fmt: skip
                generated = row["loss_mask"][before:end]
                tool = generated.index(True) if True in generated else end - before
                lo = prompt + before + tool
                logprobs = tuple(row["engine_logprobs"][lo - prompt : end])
                sample.attempts.append(
                    TapAttempt(kind, version, tokens[:lo], tokens[lo : prompt + end], logprobs, routes)
                )
                before = end
            out.setdefault(row["step"], []).append(sample)
    return out
