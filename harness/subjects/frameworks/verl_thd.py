"""verl's Megatron data movement on a packed (THD) micro-batch: the engine's default input.

verl's Megatron engine (``engine.use_remove_padding=True``, its default ``data_format='thd'``) packs
each micro-batch into one sequence, every sample padded to a multiple of ``tp·cp`` (``·2`` with
CP > 1), and its R2/R3 data movement (``set_router_replay_data`` / ``merge_router_topk_indices`` in
``verl/utils/megatron/router_replay_utils.py``) packs the routes with the same
``preprocess_thd_engine`` / ``postprocess_thd_engine`` (``verl/models/mcore/util.py``). The adapter of
``harness.subjects.frameworks.verl`` already drives those functions on the jagged batch the engine
holds; a packed micro-batch only adds the ``PackedSeqParams`` the model's forward receives, which
verl's functions do not take (they derive the packing from the jagged lengths themselves). So
:class:`PackedMegatronData` accepts ``packed_seq_params`` and calls the same release functions: the
suites then check verl on the model input it packs by default (``suites/test_megatron.py``,
``pp2thd`` and ``thd-tp2ep2``), not only the padded ``bshd`` input.

To be folded into ``verl.py``'s ``_MegatronData`` (the keyword on both methods) when that module's
split lands; until then :data:`VERL_0_9_1_PACKED` is the 0.9.1 subject with this data movement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from harness.subjects.frameworks.verl import VERL_0_9_0, VERL_0_9_1, _MegatronData


class PackedMegatronData(_MegatronData):
    """``_MegatronData`` that takes a packed micro-batch's ``packed_seq_params`` (verl derives the
    packing from the jagged lengths: the keyword changes nothing in what the release is given)."""

    def set_replay_data(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> None:
        super().set_replay_data(routes, attention_mask, config, model=model, vp_rank=vp_rank)

    def merge_recordings(
        self,
        attention_mask: torch.Tensor,
        config: Any,
        *,
        model: Sequence[torch.nn.Module],
        vp_rank: int | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        return super().merge_recordings(attention_mask, config, model=model, vp_rank=vp_rank)


VERL_0_9_0_PACKED = dataclasses.replace(VERL_0_9_0, megatron_data=PackedMegatronData("0.9.0"))
VERL_0_9_1_PACKED = dataclasses.replace(VERL_0_9_1, megatron_data=PackedMegatronData("0.9.1"))
