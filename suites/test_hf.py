"""Routing replay on real transformers MoE models (DESIGN §3.1, §3.5–3.8, §3.10), the ``hf`` backend.

Every model family transformers ships with a supported router (``harness.trainers.hf.MODEL_TYPES``)
is built tiny at random init, in fp32 and bf16, and checked through ``install_replay``: replaying
its own recording is bit-exact, the experts receive the targets whatever the live logits say, the
router gets gradients at targets its live top-k would not pick, targets placed into a left-padded
batch land on their tokens, activation recompute replays each forward's targets, KV-cache rollouts
cover ``[0, P + R − 1)``, and the mismatch lab on a bf16 Qwen3-MoE shows R3 removing the routing
disagreement and shrinking the gap where routing had flipped.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.subjects import Subject
from harness.trainers.hf import MODEL_TYPES, HFReplay, tiny_model
from reference_impl.layouts import place_left_padded
from suites.conftest import require

pytestmark = pytest.mark.hf

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BATCH, SEQ = 2, 6

family_dtype = pytest.mark.parametrize(
    ("model_type", "dtype"),
    [pytest.param(m, d, id=f"{m}-{d}") for m in MODEL_TYPES for d in DTYPES],
)


@functools.cache
def _base(model_type: str, dtype: str) -> torch.nn.Module:
    return tiny_model(model_type, DTYPES[dtype])


def _fresh(model_type: str, dtype: str = "fp32") -> torch.nn.Module:
    """A private copy of the cached model (copied before any hook is installed on it)."""
    return copy.deepcopy(_base(model_type, dtype))


def _tokens(seed: int, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    vocab = 128
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _random_targets(handle: HFReplay, rows: int, seed: int) -> torch.Tensor:
    """Valid targets ``[rows, n_moe, k]``: distinct uniformly random ids per route."""
    gen = torch.Generator().manual_seed(seed)
    n = rows * len(handle.moe_layers)
    ids = torch.argsort(torch.rand(n, handle.num_experts, generator=gen), dim=-1)[:, : handle.top_k]
    return ids.reshape(rows, len(handle.moe_layers), handle.top_k)


def _sets(routes: torch.Tensor) -> torch.Tensor:
    return routes.sort(dim=-1).values


def _forward(model: torch.nn.Module, tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return model(input_ids=tokens, use_cache=False, **kwargs).logits


@family_dtype
def test_replaying_own_recording_is_bit_exact(subject: Subject, model_type: str, dtype: str) -> None:
    """Replaying a model's own recording reproduces its un-replayed logits bit for bit (§3.7)."""
    model = _fresh(model_type, dtype)
    handle = require(subject, "install_hf_replay")(model)
    tokens = _tokens(1)
    with torch.no_grad():
        handle.record()
        native = _forward(model, tokens)
        recording = handle.recording()
        handle.replay(recording)
        replayed = _forward(model, tokens)
        dispatched = handle.dispatched()
    handle.disarm()
    expected_shape = (BATCH * SEQ, len(handle.moe_layers), handle.top_k)
    assert recording.shape == expected_shape, (
        f"{model_type} {dtype}: recording {tuple(recording.shape)}, expected {expected_shape}"
    )
    differs = int((_sets(dispatched) != _sets(recording)).any(-1).sum())
    assert differs == 0, (
        f"{model_type} {dtype}: replay dispatched other experts than the recording at {differs} routes"
    )
    diff = (native - replayed).float().abs().max().item()
    assert torch.equal(native, replayed), f"{model_type} {dtype}: replayed logits differ by {diff:.3e}"


@family_dtype
@settings(max_examples=3)
@given(seed=st.integers(0, 2**31 - 1))
def test_dispatched_experts_equal_targets_under_perturbed_logits(
    subject: Subject, model_type: str, dtype: str, seed: int
) -> None:
    """With the router weights negated (live logits prefer other experts), the experts receive the targets."""
    model = _fresh(model_type, dtype)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(("mlp.gate", "mlp.router", "feed_forward.router")):
                module.weight.neg_()
    handle = require(subject, "install_hf_replay")(model)
    targets = _random_targets(handle, BATCH * SEQ, seed)
    handle.replay(targets)
    with torch.no_grad():
        _forward(model, _tokens(seed))
    dispatched = handle.dispatched()
    handle.disarm()
    differs = (_sets(dispatched) != _sets(targets)).any(-1)
    assert not differs.any(), (
        f"{model_type} {dtype}: {int(differs.sum())} of {differs.numel()} (token, layer) routes dispatched "
        f"other experts than their targets, first at (token, MoE ordinal) "
        f"{tuple(differs.nonzero()[0].tolist())}"
    )


@family_dtype
def test_router_gets_gradient_at_targets_live_top_k_would_not_pick(
    subject: Subject, model_type: str, dtype: str
) -> None:
    """Gate weights come from the live logits at the targets, so the router weight gets a gradient there."""
    model = _fresh(model_type, dtype)
    handle = require(subject, "install_hf_replay")(model)
    tokens = _tokens(0)
    handle.record()
    with torch.no_grad():
        _forward(model, tokens)
    natural = handle.recording()
    unpicked = next(e for e in range(handle.num_experts) if e not in natural[0, 0].tolist())
    targets = natural.clone()
    targets[0, 0, -1] = unpicked  # token 0, first MoE layer: an expert its live top-k did not pick
    handle.replay(targets)
    _forward(model, tokens).float().logsumexp(-1).sum().backward()
    handle.disarm()
    grad = handle.routers[0].module.weight.grad
    assert grad is not None, f"{model_type} {dtype}: the router weight received no gradient"
    assert grad[unpicked].abs().sum() > 0, f"{model_type} {dtype}: no gradient for replayed expert {unpicked}"


@pytest.mark.parametrize("model_type", list(MODEL_TYPES))
def test_targets_placed_left_padded_land_on_their_tokens(subject: Subject, model_type: str) -> None:
    """Each sample's solo routes, left-padded like its tokens, are dispatched at its tokens (§3.5–3.6).

    Padding and each sample's last token have no row: they route natively, never with the zero filler.
    """
    model = _fresh(model_type)
    handle = require(subject, "install_hf_replay")(model)
    lengths = (4, 7)
    samples = []
    with torch.no_grad():
        for i, n in enumerate(lengths):
            tokens = _tokens(10 + i, batch=1, seq=n)
            handle.record()
            _forward(model, tokens)
            samples.append((tokens[0], handle.recording()[:-1]))  # rows [0, n − 1)
        width = max(lengths) + 2
        placed = place_left_padded(samples, width)
        mask = placed.attention_mask.long()
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        targets = placed.routes.reshape(-1, len(handle.moe_layers), handle.top_k)
        replayed = placed.replay_mask.reshape(-1)
        handle.record()
        _forward(model, placed.tokens, attention_mask=mask, position_ids=position_ids)
        native = handle.recording()
        handle.replay(targets, replayed)
        _forward(model, placed.tokens, attention_mask=mask, position_ids=position_ids)
        dispatched = handle.dispatched()
    handle.disarm()
    assert torch.equal(_sets(dispatched[replayed]), _sets(targets[replayed])), (
        "replayed rows off their tokens"
    )
    assert torch.equal(_sets(dispatched[~replayed]), _sets(native[~replayed])), (
        "rows without a target (padding, last tokens) did not route natively"
    )


def test_recompute_replays_each_forwards_targets(subject: Subject) -> None:
    """Under HF gradient checkpointing, backward recompute replays its own forward's targets (FIFO, §3.7)."""
    model = _fresh("qwen3_moe")
    handle = require(subject, "install_hf_replay")(model)
    model.train()
    first, second = _tokens(1), _tokens(2)
    rows = BATCH * SEQ
    targets_first, targets_second = _random_targets(handle, rows, 1), _random_targets(handle, rows, 2)

    handle.replay(targets_first)
    _forward(model, first).float().logsumexp(-1).sum().backward()
    handle.disarm()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers ≥ 5.x; older name below
    enable() if enable is not None else model.gradient_checkpointing_enable()
    handle.replay(targets_first)
    loss_first = _forward(model, first).float().logsumexp(-1).sum()
    handle.replay(targets_second)
    _forward(model, second)
    handle.prepare_backward()
    loss_first.backward()
    handle.disarm()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys(), (
        f"recompute saw layers {sorted(got)}, the forward {sorted(expected)}"
    )
    for name, grad in got.items():
        assert torch.equal(grad, expected[name]), f"{name}: recompute replayed other targets than the forward"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "llama4_text"])
def test_kv_cache_rollout_covers_all_but_the_last_token(subject: Subject, model_type: str) -> None:
    """Rollout routes cover [0, P + R − 1) and, in fp32, equal a full forward's routing (§3.1, §6)."""
    from harness.engines.hf import generate_rollouts

    model = _fresh(model_type)
    handle = require(subject, "install_hf_replay")(model)
    prompt_len, response_len = 5, 4
    rollouts = generate_rollouts(
        model, handle, _tokens(3, seq=prompt_len), response_len, generator=torch.Generator().manual_seed(0)
    )
    tokens = torch.stack([torch.cat([r.prompt, r.tokens]) for r in rollouts])
    with torch.no_grad():
        handle.record()
        logits = _forward(model, tokens)
        full = handle.recording().reshape(BATCH, prompt_len + response_len, len(handle.moe_layers), -1)
    handle.disarm()
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), -1)
    for b, rollout in enumerate(rollouts):
        rows = rollout.routes.shape[0]
        assert rows == prompt_len + response_len - 1, (
            f"{model_type}: rollout has {rows} rows, expected P + R − 1 = {prompt_len + response_len - 1}"
        )
        rollout.trace(handle).check_coverage(prompt_len, response_len)
        assert torch.equal(_sets(rollout.routes), _sets(full[b, :-1])), (
            "decode routing differs from a full forward"
        )
        picked = logp[b].gather(-1, rollout.tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(picked, rollout.logprobs, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "size",
    [
        pytest.param({"batch": 4, "response_len": 32}, id="4x32"),
        pytest.param({"batch": 16, "response_len": 64}, id="16x64", marks=pytest.mark.slow),
    ],
)
def test_mismatch_lab_on_a_real_qwen3_moe(size: dict[str, int]) -> None:
    """bf16 SDPA Qwen3-MoE, 64 experts top-8: routing flips without replay, none with R3, smaller gap."""
    from harness.engines.hf import run_hf_mismatch_lab
    from harness.lab import LabConfig, format_lab

    result = run_hf_mismatch_lab(LabConfig(family="qwen3_moe", **size))
    print(format_lab(result))
    without, r3 = result.without_replay, result.with_r3
    assert without.routing.disagreement > 0, "no route flipped between decode and full forward: no test"
    assert r3.routing.disagreement == 0.0, f"R3 left {r3.routing.disagreement:.4f} of routes disagreeing"
    assert result.flipped_tokens > 0, "no response token had flipped routing: the lab cannot test the gap"
    assert r3.gap_on_flipped.mean_abs_diff < without.gap_on_flipped.mean_abs_diff, (
        f"R3 did not shrink the gap on flipped tokens: {r3.gap_on_flipped.mean_abs_diff:.3e} vs "
        f"{without.gap_on_flipped.mean_abs_diff:.3e} without replay"
    )
