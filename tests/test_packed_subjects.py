"""Which release subjects take packed (THD) Megatron micro-batches, and which layouts a release refuses.

Signatures and declared refusals only (no release installed): the suites skip a packed layout for a
data movement without ``packed_seq_params`` and a layout the driver's ``refusal`` names, so these
decide which verdicts the packed layouts can give. What the releases do on packed input is judged in
their envs (``tests/test_skyrl_packed.py``, ``suites/test_megatron.py``).
"""

from __future__ import annotations

import inspect

import pytest

from harness.subjects import Subject
from harness.subjects.frameworks.mcore import MCORE_0_16_1, MCORE_0_19_2, MCORE_0_19_2_STATIC
from harness.subjects.frameworks.skyrl import SKYRL_0_2_0, SKYRL_0_3_0, SKYRL_0_4_0
from harness.subjects.megatron_core import MEGATRON_CORE
from suites.test_megatron import LAYOUTS

PACKED = [
    SKYRL_0_2_0,
    SKYRL_0_3_0,
    SKYRL_0_4_0,
    MEGATRON_CORE,
    MCORE_0_16_1,
    MCORE_0_19_2,
    MCORE_0_19_2_STATIC,
]


@pytest.mark.parametrize("subject", PACKED, ids=lambda s: s.name)
def test_data_movement_takes_packed_seq_params(subject: Subject) -> None:
    data = subject.megatron_data
    for method in ("set_replay_data", "merge_recordings"):
        fn = getattr(data, method, None)
        if fn is not None:
            assert "packed_seq_params" in inspect.signature(fn).parameters, f"{subject.name}.{method}"


def test_only_skyrl_0_4_0_refuses_virtual_pipeline_stages() -> None:
    refused = {
        name: [
            s.name for s in PACKED if getattr(s.install_megatron_replay, "refusal", lambda _: None)(layout)
        ]
        for name, layout in LAYOUTS.items()
    }
    assert refused == {name: ["skyrl-0.4.0"] if LAYOUTS[name].vpp > 1 else [] for name in LAYOUTS}
    reason = SKYRL_0_4_0.install_megatron_replay.refusal(LAYOUTS["pp2vpp2thd"])
    assert "virtual_pipeline_model_parallel_size=2" in reason and "megatron_worker.py" in reason


def test_releases_that_pack_by_themselves_skip_an_alignment_they_never_build() -> None:
    """verl and SkyRL pad each packed sample to their own alignment (``tp`` at CP = 1): the
    ``thd-align4`` layout (TP = 1, samples padded to 4) is one they never build, so the suite skips
    it for them; the data movements that follow ``cu_seqlens_padded`` (the reference, Megatron-core
    alone) run it."""
    from harness.subjects.frameworks.verl import VERL_0_9_1
    from harness.trainers.megatron.subject import MEGATRON_DATA

    layout = LAYOUTS["thd-align4"]
    assert layout.packing_align == 4 and layout.tp == 1 and layout.packed_rows == 16
    for subject in (SKYRL_0_2_0, SKYRL_0_3_0, SKYRL_0_4_0, VERL_0_9_1):
        assert subject.megatron_data.packing_align(layout.tp) == 1
    for data in (MEGATRON_DATA, MEGATRON_CORE.megatron_data):
        assert not hasattr(data, "packing_align")
