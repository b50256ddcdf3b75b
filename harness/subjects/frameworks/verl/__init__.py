"""verl releases under test (PyPI ``verl`` 0.8.0, 0.9.0, 0.9.1), one ``Subject`` per release line.

Each capability is a thin adapter over the release's own code, one module each (its docstring names
the release code it wraps and what stands in for the services around it):

- ``splice`` (``splice.py``): the partial-rollout resume loop and the multi-turn agent loop;
- ``truncate`` (``truncation.py``, 0.9.1 only): the multi-turn agent loop's response budget, cut mid-turn;
- ``layouts.place_left_padded`` (``placement.py``): the agent loop's padded batch and R3 replay mask;
- ``layouts.pack`` / ``layouts.unplace`` (``no_padding.py``, 0.9.1 only): the trainer's no-padding layout;
- ``install_megatron_replay`` / ``megatron_data`` (``megatron.py``): Megatron R2/R3;
- ``install_hf_replay`` (``veomni.py``): the VeOmni engine's router replay on a transformers model.

``payload.py`` holds what they share: the type an engine hands ``routed_experts`` over in, and the
jagged form of verl's trainer.
"""

from __future__ import annotations

from functools import partial

from harness.subjects import Subject
from harness.subjects.frameworks.verl.megatron import MegatronData, MegatronDriver
from harness.subjects.frameworks.verl.no_padding import NoPaddingLayouts
from harness.subjects.frameworks.verl.payload import Payload
from harness.subjects.frameworks.verl.placement import Layouts, place_left_padded
from harness.subjects.frameworks.verl.splice import splice
from harness.subjects.frameworks.verl.truncation import truncate
from harness.subjects.frameworks.verl.veomni import VeOmniDriver

__all__ = [
    "VERL_0_8_0",
    "VERL_0_8_0_SGLANG",
    "VERL_0_9_0",
    "VERL_0_9_1",
    "Payload",
    "place_left_padded",
    "splice",
]


def _subject(version: str, payload: Payload) -> Subject:
    return Subject(
        name=f"verl-{version} ({'vLLM numpy' if payload == 'numpy' else 'SGLang tensor'} payloads)",
        splice=partial(splice, version, payload),
        truncate=partial(truncate, version, payload) if version == "0.9.1" else None,
        layouts=(NoPaddingLayouts if version == "0.9.1" else Layouts)(version, payload),
        install_megatron_replay=MegatronDriver(version),
        megatron_data=MegatronData(version),
        install_hf_replay=VeOmniDriver(version),
    )


VERL_0_8_0 = _subject("0.8.0", "numpy")
"""verl 0.8.0 with vLLM (the default backend): payloads are numpy arrays."""
VERL_0_8_0_SGLANG = _subject("0.8.0", "tensor")
"""verl 0.8.0 with SGLang and ``skip_tokenizer_init``: payloads are torch tensors."""
VERL_0_9_0 = _subject("0.9.0", "numpy")
VERL_0_9_1 = _subject("0.9.1", "numpy")
