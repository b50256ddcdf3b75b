"""A vllm-cpu release the harness says cannot capture on CPU, started with capture anyway (FACTS §1, §6).

The engine suites skip such a release, naming why (``harness.engines.installed.start_blocker``, from
``Convention.cpu_capture``). That reason is a reading of the release's source; this test keeps it
observed: it starts the installed engine through the harness's own adapter with routed-expert
capture on, past the start check, and expects the refusal the release's source gives. A release
that starts capturing on CPU fails here, naming what it returned — the convention must then say so
and the engine suites run (``tox -e vllm-cpu-0.31`` / ``vllm-cpu-0.32``; skipped elsewhere).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from harness.engines import installed

REFUSALS = {
    # vllm/config/vllm.py (0.31.0, 0.32.0) ``_verify_aux_output_compatibility``: capture goes through
    # the AuxOutput connector, which only Model Runner V2 carries; the CPU platform has no V2 runner.
    "vllm-0.31": ("Model Runner V2",),
}
"""Convention → the words of its CPU refusal (any one of them in the error)."""


def _refusing_release() -> tuple[str, object]:
    """``(version, convention)`` of an installed CPU build that should refuse capture, else skip."""
    found = installed.installed_distribution("vllm")
    if found is None or found[0] not in installed.CPU_BUILDS:
        pytest.skip("vllm-cpu is not installed (tox -e vllm-cpu-0.31 / vllm-cpu-0.32)")
    if installed.start_blocker("vllm") is None:
        pytest.skip(f"{found[0]} {found[1]} captures here: the engine suites run instead")
    conv = installed.installed_convention("vllm")
    if conv.name not in REFUSALS:
        pytest.skip(f"{found[0]} {found[1]} ({conv.name}): no recorded CPU refusal to observe")
    return found[1], conv


def test_capture_on_cpu_is_refused_at_engine_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version, conv = _refusing_release()
    from harness.engines.checkpoint import write_checkpoint
    from harness.engines.vllm import VLLMEngine

    monkeypatch.setattr(installed, "import_engine", importlib.import_module)  # past the start check
    checkpoint = write_checkpoint(tmp_path / "ckpt")
    words = REFUSALS[conv.name]  # type: ignore[attr-defined]
    try:
        engine = VLLMEngine(checkpoint)
    except Exception as err:  # the release's own refusal, whatever type it raises
        text = f"{type(err).__name__}: {err}"
        assert any(w in text for w in words), (
            f"vllm-cpu {version} refused capture on CPU, but not as recorded ({' / '.join(words)}): {text}"
        )
        return
    try:
        rollout = engine.generate_one([5, 6, 7, 8], max_tokens=2)
    finally:
        engine.close()
    pytest.fail(
        f"vllm-cpu {version} started with routed-expert capture on CPU and returned "
        f"{rollout!r:.200}: record that it captures (Convention.cpu_capture) and run the engine suites"
    )
