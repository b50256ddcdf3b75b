"""The mismatch lab run on the reference engine (DESIGN §3.10, §6): rollouts through the reference
model's KV cache, the trainer's full-forward recompute without replay and with R3 through a
subject's ``install_replay``. The measurement itself (configuration, scoring, table) is
``harness.lab.measure``.
"""

from __future__ import annotations

import torch

from harness.lab.measure import LabConfig, LabResult, build_model, lab_result
from harness.probes.reference import attach
from harness.subjects.reference import install_replay as reference_install
from harness.subjects.replay import controlled, prepare
from reference_impl import RolloutEngine, training
from reference_impl.layouts import place_left_padded

_RESULTS: dict[tuple[LabConfig, int], tuple[object, LabResult]] = {}
"""Each lab run of this process by (configuration, ``id`` of the driver), with the driver itself: held,
its ``id`` is never reused (capability objects need not be hashable)."""


def run_mismatch_lab(cfg: LabConfig | None = None, install_replay: object | None = None) -> LabResult:
    """Roll out with the KV cache, recompute with a full forward, without and with R3.

    ``install_replay`` is the subject's driver (or ``model -> ReplayController`` callable; the
    reference's by default). It controls a model of its own, used only for the R3 pass: rollouts and
    the native pass run on the harness's copy of the same weights, so a subject that takes a router's
    forward over for good cannot disturb them. Both passes' routes are what the harness's probe saw.

    The lab is seeded, so a second call with the same configuration and the same driver object
    returns the first call's result instead of running it again: ``rrh check`` reports the lab its
    mismatch-lab suite ran (a second run was 7% of the default run's CPU time).
    """
    cfg = cfg or LabConfig()
    key = (cfg, id(install_replay))
    if key not in _RESULTS:
        _RESULTS[key] = (install_replay, _run(cfg, install_replay))
    return _RESULTS[key][1]


def _run(cfg: LabConfig, install_replay: object | None) -> LabResult:
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = torch.randint(0, model.cfg.vocab_size, (cfg.batch, cfg.prompt_len), generator=gen)
    rollouts = RolloutEngine(model).generate(list(prompts), cfg.response_len, greedy=False, generator=gen)

    width = cfg.prompt_len + cfg.response_len
    samples = []
    for prompt, rollout in zip(prompts, rollouts, strict=True):
        assert rollout.routes is not None  # every rollout generated response_len ≥ 1 tokens
        samples.append((torch.cat([prompt, rollout.tokens]), rollout.routes))
    placed = place_left_padded(samples, width)
    moe_layers = model.cfg.moe_layers
    targets, mask = training.replay_targets(placed, moe_layers, "decoder")

    native_probe = attach(model)
    with torch.no_grad():
        lp_native = training.token_logprobs(model, placed.tokens, placed.attention_mask)
    native_routes = native_probe.last().ids
    native_probe.remove()

    driver = prepare(install_replay or reference_install)  # patch before building the model it controls
    subject_model = build_model(cfg)
    with controlled(driver, subject_model) as controller:
        r3_probe = attach(subject_model)
        controller.replay(targets, mask)
        with torch.no_grad():
            lp_r3 = training.token_logprobs(subject_model, placed.tokens, placed.attention_mask)
        r3_routes = r3_probe.last().ids
        r3_probe.remove()

    infer = torch.stack([r.logprobs for r in rollouts])
    return lab_result(
        cfg, tuple(moe_layers), targets, mask, (native_routes, lp_native), (r3_routes, lp_r3), infer
    )
