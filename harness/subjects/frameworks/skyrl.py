"""SkyRL releases under test (PyPI ``skyrl`` 0.2.0, 0.3.0, 0.4.0): thin adapters over their own functions.

- ``install_megatron_replay`` / ``megatron_data``: R3 on Megatron-core through
  ``skyrl/backends/skyrl_train/utils/replay_utils.py``: ``patch_topk_router_layer_number`` is the
  once-per-process patch, ``setup_per_microbatch_replay_forward`` gives every router its targets
  in the mode of the micro-batch the harness's model takes: a padded ``[B, S]`` micro-batch with
  ``remove_microbatch_padding=False`` (0.2.0: ``use_sample_packing=False``), a packed (THD) one —
  the forward's ``packed_seq_params`` — with ``True``, SkyRL's default: 0.2.0 / 0.3.0
  ``_pack_replay_indices`` and 0.4.0 ``build_token_metadata_layout(…, packed=True)`` pack each
  sample's real tokens padded to ``get_packed_seq_align_size(tp, cp)`` (``tp`` at CP = 1, no FP8:
  the harness's alignment), then slice the ``[1, T]`` rows over TP. The adapter first checks that
  the release's own ``preprocess_packed_seqs`` packs the samples at the forward's ``cu_seqlens``.
  ``setup_per_microbatch_replay_backward`` and ``clear_router_replay`` drive recompute and
  teardown. SkyRL records nothing (it has R3 only), so the controller's ``record`` is
  Megatron-core's own ``RECORD`` action and ``merge_recordings`` is absent (a skip). 0.4.0 refuses
  routing replay with virtual pipeline stages at setup (the driver's ``refusal``: a skip).
- ``layouts.place_left_padded``: the trainer's batch placement,
  ``skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors(...,
  rollout_expert_indices=…)``. The generator hands it per-sample routes as nested lists (what the
  inference client returns), ``len(tokens) − 1`` rows each; the release left-pads every sample to
  the batch's longest one and writes the rows at the same columns as the tokens. SkyRL has no
  replay mask: Megatron-core's ``RouterReplay`` (which ``replay_utils`` feeds) replays every token it
  is given, so the placement's effective replay mask is its attention mask. The other layout
  functions are not SkyRL's (a skip names each).

Importing ``skyrl.backends.…`` on Python 3.11 fails in the Tinker backend's pydantic model; the
package's ``__init__`` is not needed for ``replay_utils`` (FACTS §6), so it is skipped by
registering a bare package with the real ``__path__`` first.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from harness.errors import MegatronReplayError
from harness.subjects import Subject
from harness.subjects.frameworks import check_placement_arguments, require_release
from reference_impl.layouts import Placed


def _bare_backends(version: str) -> None:
    """Register ``skyrl.backends`` as a bare package (its real ``__path__``) so that importing a
    module under it skips the package ``__init__``, which fails on Python 3.11 (FACTS §6)."""
    require_release("skyrl", version, f"skyrl-{version}")
    import importlib.util
    import sys

    if "skyrl.backends" not in sys.modules:
        import skyrl

        spec = importlib.util.find_spec("skyrl.backends")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("skyrl.backends is not part of this SkyRL release")
        bare = types.ModuleType("skyrl.backends")
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules["skyrl.backends"] = bare
        skyrl.backends = bare  # type: ignore[attr-defined]


def replay_utils(version: str) -> Any:
    """The release's ``skyrl/backends/skyrl_train/utils/replay_utils.py`` (Megatron R3 over
    Megatron-core's ``RouterReplay``), imported past the ``skyrl.backends`` package ``__init__``."""
    import importlib

    _bare_backends(version)
    return importlib.import_module("skyrl.backends.skyrl_train.utils.replay_utils")


def _preprocess(version: str) -> Any:
    """``skyrl.train.dataset.preprocess`` (0.4.0 imports ``skyrl.backends`` modules from it)."""
    _bare_backends(version)
    from skyrl.train.dataset import preprocess

    return preprocess


def _batch(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]], width: int, prompt_lens: Sequence[int] | None
) -> tuple[list[list[int]], list[list[int]], list[Any]]:
    """The samples as the release's arguments: prompts, responses, per-sample routes; one more
    sample of exactly ``width`` tokens is appended when ``width`` exceeds the longest (the release
    pads to the longest sample; a wider batch is asked of it the way it happens in a run)."""
    check_placement_arguments(samples, width, prompt_lens)
    lens = [int(t.shape[0]) for t, _ in samples]
    splits = list(prompt_lens) if prompt_lens is not None else [min(1, n) for n in lens]
    prompts = [t[:p].tolist() for (t, _), p in zip(samples, splits, strict=True)]
    responses = [t[p:].tolist() for (t, _), p in zip(samples, splits, strict=True)]
    routes: list[Any] = [r for _, r in samples]
    if width > max(lens):  # a sample of exactly `width` tokens with rows shaped like the others
        prompts.append([1] * width)
        responses.append([])
        routes.append(torch.ones((width - 1, *samples[0][1].shape[1:]), dtype=torch.long))
    return prompts, responses, routes


def _placed(
    count: int,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    routes: torch.Tensor,
    replay_mask: torch.Tensor,
    prompt_lens: Sequence[int] | None,
) -> Placed:
    """The release's batch tensors, the appended widening sample dropped, as a ``Placed``."""
    attention_mask, action_mask = attention_mask[:count].bool(), action_mask[:count].bool()
    width = attention_mask.shape[1]
    response_mask = None
    if prompt_lens is not None:
        response_mask = torch.zeros_like(attention_mask)
        response_mask[:, width - action_mask.shape[1] :] = action_mask  # right-aligned response columns
    return Placed(sequences[:count], attention_mask, routes[:count], replay_mask[:count], response_mask)


def place_left_padded(
    version: str,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """0.2.0 / 0.3.0: ``convert_prompts_responses_to_batch_tensors`` on the samples (routes as
    nested lists, ``[B, S, L, K]`` back), as a ``Placed`` batch of ``width``; no replay mask of
    its own (Megatron-core replays every token it is given: the attention mask)."""
    convert = _preprocess(version).convert_prompts_responses_to_batch_tensors
    prompts, responses, routes = _batch(samples, width, prompt_lens)
    sequences, attention_mask, action_mask, _, _, _, placed_routes = convert(
        types.SimpleNamespace(pad_token_id=0),  # the tokenizer: only its pad id is read
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        [[1] * len(r) for r in responses],
        rollout_expert_indices=[r.tolist() for r in routes],
    )
    if placed_routes is None:  # no sample has a row: the release returns no routes
        placed_routes = torch.zeros((len(prompts), width, *samples[0][1].shape[1:]), dtype=torch.long)
    count = len(samples)
    return _placed(
        count, sequences, attention_mask, action_mask, placed_routes, attention_mask.bool(), prompt_lens
    )


def place_packed(
    version: str,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """0.4.0: ``convert_prompts_responses_to_batch_tensors(pad_token_id, …)`` takes each sample's
    routes as a NumPy array in a canonical dtype (``compact_routed_expert_indices``, what the
    inference client hands it) and returns them packed over real tokens (``PackedTensor``: a
    sample's uncaptured trailing tokens get the dummy route ``arange(top_k)``); the trainer's
    ``make_router_padding_mask(attention_mask, captured lengths)`` marks what is not replayed.
    The packed rows are laid back onto the left-padded ``[B, width]`` grid at the attention mask's
    positions (left padding keeps each sample's real tokens contiguous, which the release relies
    on); the replay mask is the negated router padding mask."""
    preprocess = _preprocess(version)  # first: it makes skyrl.backends importable on 3.11
    from skyrl.backends.skyrl_train.utils.routed_experts import compact_routed_expert_indices

    prompts, responses, routes = _batch(samples, width, prompt_lens)
    arrays = [compact_routed_expert_indices(torch.as_tensor(r).long().numpy()) for r in routes]
    sequences, attention_mask, action_mask, _, _, _, packed, _ = (
        preprocess.convert_prompts_responses_to_batch_tensors(
            0,
            prompts,
            responses,
            [[0.0] * len(r) for r in responses],
            [[1] * len(r) for r in responses],
            rollout_expert_indices=arrays,
        )
    )
    padding = preprocess.make_router_padding_mask(attention_mask, [len(a) for a in arrays])
    grid = torch.zeros((*attention_mask.shape, *packed.row_shape), dtype=torch.long)
    grid[attention_mask.bool()] = packed.values.long()
    count = len(samples)
    return _placed(count, sequences, attention_mask, action_mask, grid, ~padding, prompt_lens)


class _Layouts:
    """SkyRL's layout functions (only its own; the rest are a skip naming them)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def place_left_padded(self, samples: Any, width: int, prompt_lens: Any = None) -> Placed:
        place = place_packed if self.version in _PACKED_ROUTES else place_left_padded
        return place(self.version, samples, width, prompt_lens)


class _MegatronController:
    """Megatron-core's ``RouterReplay`` actions as SkyRL drives them (``MegatronReplayController``)."""

    def __init__(self, version: str) -> None:
        self.utils = replay_utils(version)

    @staticmethod
    def _action(name: str) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        RouterReplay.set_global_router_replay_action(getattr(RouterReplayAction, name))

    def record(self) -> None:
        self._action("RECORD")

    def replay_forward(self) -> None:
        self._action("REPLAY_FORWARD")

    def prepare_backward(self) -> None:
        self.utils.setup_per_microbatch_replay_backward()

    def disarm(self) -> None:
        self.utils.clear_router_replay()


class _MegatronDriver:
    """SkyRL's Megatron R3 driver (``MegatronReplayDriver``): its patch, Megatron-core's flag."""

    def __init__(self, version: str) -> None:
        self.version = version

    def patch(self) -> None:
        replay_utils(self.version).patch_topk_router_layer_number()

    def config_overrides(self) -> dict[str, Any]:
        return {"moe_enable_routing_replay": True}

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> _MegatronController:
        return _MegatronController(self.version)

    def refusal(self, layout: Any) -> str | None:
        """0.4.0 refuses routing replay with virtual pipeline stages before training
        (``megatron_worker.py``: ``ValueError`` "moe_enable_routing_replay is incompatible with
        virtual_pipeline_model_parallel_size"; ``train/utils/utils.py`` asserts the same on the
        config): "interleaved chunks desync the replay FIFO". 0.2.0 / 0.3.0 have no such check."""
        if self.version in _REFUSES_VPP and layout.vpp > 1:
            return (
                f"SkyRL {self.version} raises on moe_enable_routing_replay with "
                f"virtual_pipeline_model_parallel_size={layout.vpp} (megatron_worker.py, "
                "train/utils/utils.py: interleaved chunks desync the replay FIFO)"
            )
        return None


_PACKING_KEYWORD = {"0.2.0": "use_sample_packing", "0.3.0": "remove_microbatch_padding"}
"""The switch between padded and packed micro-batches, renamed in 0.3.0 (FACTS §6)."""
_PACKED_ROUTES = {"0.4.0"}
"""Releases whose routes travel packed over real tokens (``PackedTensor``) with a router padding mask."""
_REFUSES_VPP = {"0.4.0"}
"""Releases that refuse routing replay under virtual pipeline stages at setup."""


class SkyrlMegatronData:
    """SkyRL's per-micro-batch replay setup (``MegatronDataMovement``; no recordings to merge)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def packing_align(self, tp: int) -> int:
        """``PacksAtOwnAlignment``: SkyRL's ``preprocess_packed_seqs`` pads each sample to
        ``get_packed_seq_align_size(tp, cp)``: ``tp`` at CP = 1 without FP8."""
        return tp

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
        """Padded ``[B, S]`` micro-batch: the release's unpacked mode. Packed (THD, the forward's
        ``packed_seq_params``): its packed mode, after checking that the release's own packing of
        these samples (``preprocess_packed_seqs``) is the forward's, so that the routers' rows are
        the ones SkyRL's trainer would build."""
        packed = packed_seq_params is not None
        if packed:
            _check_release_packing(self.version, attention_mask, packed_seq_params)
        if self.version in _PACKED_ROUTES:
            self._set_packed_routes(routes, attention_mask, config, model, packed)
            return
        mode = {_PACKING_KEYWORD[self.version]: packed}
        replay_utils(self.version).setup_per_microbatch_replay_forward(
            torch.as_tensor(routes), attention_mask, config, **mode
        )

    def _set_packed_routes(
        self,
        routes: torch.Tensor,
        attention_mask: torch.Tensor,
        config: Any,
        model: Sequence[torch.nn.Module],
        packed: bool,
    ) -> None:
        """0.4.0's call, as its ``MegatronModelWrapper`` makes it: routes packed over real tokens in
        their canonical dtype (``PackedTensor``), the trainer's router padding mask (every real token
        has its row: nothing is padding but padding), the release's token layout
        (``build_token_metadata_layout(…, packed=…)``: per-sample alignment to
        ``get_packed_seq_align_size(tp, cp)`` and CP sharding when packed) and
        ``remove_microbatch_padding`` in the same mode. The returned ``padding_mask`` only excludes
        dummy rows from load-balancing statistics, which the suites do not train; routing is what
        the probes observe."""
        _bare_backends(self.version)
        from skyrl.backends.skyrl_train.distributed.megatron.token_metadata import build_token_metadata_layout
        from skyrl.backends.skyrl_train.utils.packed_tensor import PackedTensor, cu_seqlens_from_lengths
        from skyrl.backends.skyrl_train.utils.routed_experts import compact_routed_expert_indices

        mask = attention_mask.bool()
        values = torch.from_numpy(compact_routed_expert_indices(self.real_token_routes(routes, mask).numpy()))
        lengths = mask.sum(dim=1).tolist()
        routes_packed = PackedTensor(
            values.to(mask.device), cu_seqlens_from_lengths(lengths, device=mask.device)
        )
        padding = _preprocess(self.version).make_router_padding_mask(mask, lengths)
        layout = build_token_metadata_layout(mask, mask.device, packed=packed, fp8_enabled=False)
        replay_utils(self.version).setup_per_microbatch_replay_forward(
            routes_packed,
            padding,
            mask,
            model=model[0],
            model_config=config,
            metadata_layout=layout,
            remove_microbatch_padding=packed,
        )

    @staticmethod
    def real_token_routes(routes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The real tokens' routes ``[sum(n_b), L, k]`` int64, sample after sample (the values of the
        ``PackedTensor`` SkyRL's collator hands its trainer)."""
        return torch.as_tensor(routes)[mask].long()


def _check_release_packing(version: str, attention_mask: torch.Tensor, packed_seq_params: Any) -> None:
    """Raise unless the release's ``preprocess_packed_seqs`` starts each sample at the row the
    forward's ``packed_seq_params.cu_seqlens_q_padded`` says: the harness's model must hold the rows
    SkyRL's trainer would build, so that every real token is judged at its row and no verdict rests
    on an alignment SkyRL would not choose. SkyRL's own ``cu_seqlens_q`` is the padded one (each
    sample's filler rows count as its last tokens); under causal attention that changes no real
    token's output, so it is a representation and not compared."""
    _bare_backends(version)
    from skyrl.backends.skyrl_train.distributed.megatron.megatron_utils import preprocess_packed_seqs

    mask = attention_mask.bool()
    _, release = preprocess_packed_seqs(torch.zeros(mask.shape, dtype=torch.long, device=mask.device), mask)
    want = release.cu_seqlens_q_padded.cpu().long()
    got = packed_seq_params.cu_seqlens_q_padded
    got = None if got is None else torch.as_tensor(got).cpu().long()
    if got is None or not torch.equal(got, want):
        raise MegatronReplayError(
            f"packed_seq_params.cu_seqlens_q_padded = {None if got is None else got.tolist()}, "
            f"SkyRL {version}'s preprocess_packed_seqs starts the samples at {want.tolist()}"
        )


def _subject(version: str) -> Subject:
    return Subject(
        name=f"skyrl-{version}",
        layouts=_Layouts(version),
        install_megatron_replay=_MegatronDriver(version),
        megatron_data=SkyrlMegatronData(version),
    )


SKYRL_0_2_0 = _subject("0.2.0")
SKYRL_0_3_0 = _subject("0.3.0")
SKYRL_0_4_0 = _subject("0.4.0")
