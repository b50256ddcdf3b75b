"""Inference-engine adapters: rollouts with the routes an engine used (DESIGN §4).

``harness.engines.hf``: a transformers model sampling through its own KV cache;
``harness.engines.vllm`` and ``harness.engines.sglang``: the real engines on a tiny checkpoint
(``harness.engines.checkpoint``); ``harness.engines.http``: their servers' payloads. Each adapter
imports its engine lazily, so the harness core never needs it installed.
"""
