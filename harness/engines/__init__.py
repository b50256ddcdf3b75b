"""Inference-engine adapters: rollouts with the routes an engine used (DESIGN §4).

``harness.engines.hf``: a transformers model sampling through its own KV cache. Each adapter imports
its engine lazily, so the harness core never needs it installed.
"""
