"""Mutants of SkyRL 0.4.0's packed (THD) Megatron data movement, killed in its env (``tox -e skyrl-0.4.0``).

Each is the release's subject with one step of its packed path undone, to prove that the layout which
passes the release would catch it. They stay out of the registry (``harness.mutants.registry``),
whose kills run without the release installed; ``tests/test_skyrl_packed.py`` proves each kill in
the release's env.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness.subjects.frameworks.skyrl import SKYRL_0_4_0, SkyrlMegatronData


class _SeqMajorPackedRoutes(SkyrlMegatronData):
    """The ``PackedTensor`` values gathered sequence-major over the real tokens (position by
    position across the samples, the padded batch's ``s·B + b`` order) while ``cu_seqlens`` still
    say sample after sample: well-formed rows, each real token's route at another token's row."""

    @staticmethod
    def real_token_routes(routes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(routes).transpose(0, 1)[mask.transpose(0, 1)].long()


PACKED_SEQ_MAJOR = replace(
    SKYRL_0_4_0, name="mutant:skyrl-0.4.0-packed-seq-major", megatron_data=_SeqMajorPackedRoutes("0.4.0")
)
"""``--rr-subject harness.mutants.skyrl:PACKED_SEQ_MAJOR``: killed by ``test_megatron[pp2thd]``."""
