"""What the fork server of ``harness.testing.ranks`` imports once, before it forks any rank.

Every rank imports torch, the reference model and the suites' libraries, and a megatron-core rank
megatron-core (~5 s of CPU on the CI machine, for every rank of every run); every rank of a suite
also imports the harness's subjects (the reference subject, the replay seam: numba, the trace
kernels, ~0.8 s of CPU a rank) and its asserts. Imported here once per
caller, they are already in every rank forked from the server. megatron-core is imported when it is
installed, with its import-time warnings about missing Transformer Engine and Apex silenced (each
rank silences them itself, ``harness.testing.megatron_cpu.setup_rank``). Importing starts no
thread of Python's, so forking the server stays safe.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import hypothesis  # noqa: F401
import numpy  # noqa: F401
import pytest  # noqa: F401
import torch
import torch.distributed  # noqa: F401

import harness.subjects.reference
import harness.subjects.replay
import harness.testing.asserts  # noqa: F401
import reference_impl.model  # noqa: F401

MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.moe.moe_layer",
)
"""The megatron-core modules a rank of ``suites/test_megatron.py`` imports (``harness.trainers.megatron``)."""

if importlib.util.find_spec("megatron") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MEGATRON_MODULES:
            importlib.import_module(name)
