"""The bf16 mismatch lab (DESIGN §3.10, §6): the measurement that scores any engine's rollouts
against a full-forward trainer without and with R3 (``measure``, core), its run on the reference
engine (``reference``) and on a real engine through a subject's ``install_hf_replay`` (``engine``).

Layer: ``measure`` is core (numpy, torch and the metrics only); the runs sit with the subjects,
whose replay drivers they take, and may import the engines, trainers and probes below them.
"""
