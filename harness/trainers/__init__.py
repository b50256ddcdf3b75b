"""Trainer backends: record/replay on the models real training engines run (DESIGN §4).

``harness.trainers.hf``: transformers models (FSDP / HF trainers), through module hooks. Each backend
imports its engine lazily, so the harness core never needs it installed.
"""
