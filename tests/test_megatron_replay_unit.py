"""Megatron RouterReplay control and the CPU test-support patches, in process (needs megatron-core)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.errors import MegatronReplayError
from harness.trainers.megatron.replay import check_no_bypass

pytestmark = pytest.mark.megatron


def _config(**kw: object) -> SimpleNamespace:
    base = dict(
        moe_enable_routing_replay=True,
        moe_router_fusion=False,
        moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"moe_router_fusion": True}, "moe_router_fusion"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, "sinkhorn"),
        ({"moe_router_load_balancing_type": ["aux_loss", "sinkhorn"]}, "sinkhorn"),
        ({"moe_router_quantile_balancing": True}, "quantile"),
        ({"moe_expert_capacity_factor": 1.0}, "token dropping"),
        ({"moe_enable_routing_replay": False}, "moe_enable_routing_replay"),
    ],
)
def test_silent_bypasses_are_errors(change: dict[str, object], message: str) -> None:
    check_no_bypass(_config())
    with pytest.raises(MegatronReplayError, match=message):
        check_no_bypass(_config(**change))


def test_patches_are_reverted_and_leave_torch_cuda_alone() -> None:
    from harness.testing import megatron_cpu

    before = (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.Event)
    with megatron_cpu.patched(force_cpu=True) as patches:
        assert "torch.cuda.current_device" in patches.names
        assert torch.cuda.current_device() == torch.device("cpu")
        from megatron.core.transformer.moe import moe_utils

        assert hasattr(moe_utils, "te_general_gemm")
    assert (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.Event) == before


def test_router_replay_instances_are_checked_against_the_class_list(tmp_path: Path) -> None:
    """One MoELayer on a one-rank gloo world, in process: orphans are refused, targets are forced."""
    import warnings

    import torch.distributed as dist

    from harness.testing import megatron_cpu
    from harness.trainers.megatron.layout import MegatronLayout, ids_to_map
    from harness.trainers.megatron.replay import MegatronReplay

    warnings.simplefilter("ignore", UserWarning)  # megatron-core: no TE / Apex; pytest restores filters
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with megatron_cpu.patched(force_cpu=True):
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.moe.moe_layer import MoELayer
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from harness.trainers.megatron.model import tiny_config

        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        try:
            ps.initialize_model_parallel(1, 1)
            model_parallel_cuda_manual_seed(0)
            layout = MegatronLayout(
                num_layers=1, moe_layers=(0,), num_experts=4, top_k=2, seq_len=4, micro_batch=2
            )
            config = tiny_config(layout, recompute=False)
            RouterReplay.clear_global_router_replay_instances()
            mlp = get_gpt_layer_local_spec(num_experts=4).submodules.mlp
            # megatron-core 0.16 gives a ModuleSpec, 0.19 a functools.partial(MoELayer, submodules=…)
            spec = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
            stale = MoELayer(config, spec)  # noqa: F841 - its RouterReplay is an orphan for `layer`
            layer = MoELayer(config, spec)
            with pytest.raises(MegatronReplayError, match="orphans"):
                MegatronReplay.install(layer, config=config)
            RouterReplay.clear_global_router_replay_instances()
            layer = MoELayer(config, spec)
            replay = MegatronReplay.install(layer, config=config)
            targets = torch.tensor([[0, 1], [2, 3], [3, 0], [1, 2], [0, 2], [1, 3], [2, 0], [3, 1]])
            with pytest.raises(MegatronReplayError, match="repeats"):
                replay.feed([torch.tensor([[0, 0]] * 8)], layout.local_tokens)
            replay.feed([targets], layout.local_tokens)
            replay.replay_forward()
            seen = []
            handle = layer.router.register_forward_hook(lambda m, a, out: seen.append(out[1]))
            layer(torch.randn(4, 2, 16))
            handle.remove()
            assert torch.equal(seen[0], ids_to_map(targets, 4))
            assert replay.pending() == [1]
            with pytest.raises(MegatronReplayError, match="not drained"):
                replay.check_drained()
            replay.disarm()
            replay.check_drained()
        finally:
            RouterReplay.clear_global_router_replay_instances()
            ps.destroy_model_parallel()
            dist.destroy_process_group()
