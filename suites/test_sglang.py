"""The subject against real SGLang (DESIGN §3.1–3.6, §3.10; FACTS §1, §6): its splice, decoder, placement
and replay driver on what a real engine returns.

One engine per session: the installed SGLang (a CUDA build on a GPU runner; 0.5.23 in its CPU engine
mode on a CPU machine, ``tox -e sglang-cpu``) serves the lab's bf16 Qwen3-MoE with 64 experts top-8
(near ties, so the trainer's recompute flips some routes), every layer MoE (SGLang's Qwen3-MoE builds
no dense layer: ``harness.engines.sglang.refuse_dense_layers``), with routed-expert capture, the
radix prefix cache and chunked prefill on. Against it:

- **splice**, **layouts**, **install_hf_replay**: the suites every engine runs
  (``suites/real_engine.py``), collected here under the ``sglang`` marker. SGLang returns every row
  of the sequence on each call (``P + R − 1``, verl #6029), so a resume that concatenates payloads
  (verl #5430) holds each earlier row twice and fails;
- **decode_payload**: the release's own ``meta_info["routed_experts"]`` (base64 of little-endian
  int32, with and without ``routed_experts_start_len``) decodes to the rows read straight off its
  bytes.

Every test is marked ``gpu`` and ``sglang``: ``pytest suites/ -m gpu`` selects them on any machine; they
run wherever SGLang can start and skip naming why elsewhere (``RRH_REQUIRE_ENGINES=sglang``: a failure).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from harness.conventions import resolve
from harness.engines.checkpoint import TinyCheckpoint
from harness.lab.engine import ENGINE_LAB, lab_checkpoint
from harness.subjects import Subject
from harness.testing.suite import require

# the suites every engine runs, collected here under the sglang marker
from suites.real_engine import (  # noqa: F401
    check_decoded,
    lab_rollouts,
    prompts,
    test_layouts_place_real_rollouts_with_every_row_on_its_token,
    test_r3_through_the_subjects_driver_dispatches_the_engines_experts,
    test_r3_through_the_subjects_driver_shrinks_the_gap_on_flipped_tokens,
    test_splice_of_a_resume_served_from_the_prefix_cache,
    test_splice_of_n_samples_each_resumed_under_new_weights,
    test_splice_of_real_episodes_keeps_the_first_computed_rows,
    test_without_replay_the_trainer_routes_some_engine_rows_differently,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sglang]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """The lab's checkpoint, every layer MoE."""
    return lab_checkpoint(tmp_path_factory.mktemp("rrh-sglang-suite"), ENGINE_LAB, mlp_only_layers=[])


@pytest.fixture(scope="session")
def engine(checkpoint: TinyCheckpoint) -> Iterator[Any]:
    from harness.engines.sglang import SGLangEngine

    started = SGLangEngine(checkpoint, seed=ENGINE_LAB.seed)
    yield started
    started.close()


@pytest.mark.capability("decode_payload")
@pytest.mark.parametrize("start", [0, 9])
def test_decode_payload_reads_the_releases_meta_info_payload(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint, start: int
) -> None:
    """``meta_info["routed_experts"]`` of the installed release (prompts of 10, 23 and 40 tokens,
    prompt rows skipped from ``start``) decodes to the rows read straight off its int32 bytes."""
    decode = require(subject, "decode_payload")
    spec = checkpoint.spec
    conv = resolve("sglang", engine.version)
    if start and conv.start_param is None:
        pytest.skip(f"{conv.name}: SGLang {engine.version} has no routed_experts_start_len")
    batch = prompts(checkpoint, (10, 23, 40), seed=23)
    for prompt, output in zip(batch, engine.raw_outputs(batch, 6, start=start), strict=True):
        payload = output["meta_info"]["routed_experts"]
        prompt_len, response_len = len(prompt), len(output["output_ids"])
        rows = np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(-1, spec.num_layers, spec.top_k)
        what = (
            f"SGLang {engine.version} meta_info payload, prompt {prompt_len}, response {response_len}, "
            f"start {start}"
        )
        trace = decode(
            "sglang",
            engine.version,
            payload,
            model=spec,
            prompt_len=prompt_len,
            response_len=response_len,
            start=start,
        )
        moe_rows = rows[:, list(spec.moe_layer_tuple)]
        check_decoded(trace, moe_rows, engine, prompt_len, response_len, start, what)
