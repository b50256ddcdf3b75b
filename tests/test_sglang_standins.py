"""The CPU stand-ins real SGLang runs with (``ci/sglang_cpu``): each does only what its docstring says.

Run in fresh interpreters with the folder on ``PYTHONPATH``, as ``tox -e sglang-cpu`` runs SGLang's
processes: the ``sgl_kernel`` stand-in imports any submodule and resolves any name, and any use is
logged and raises, so ``standin_calls.py`` turns red (the proof that the check can fail); the
``sitecustomize`` gives SGLang's host-allocator table an unpinned ``"cpu"`` entry that calls SGLang's
own allocator, checked on a module of the same dotted name (no SGLang needed here).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STANDINS = ROOT / "ci" / "sglang_cpu"


def _python(code: str, tmp_path: Path, *extra_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (STANDINS, *extra_path))
    env["RRH_SGLANG_STANDIN_LOG"] = str(tmp_path / "uses.log")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def _standin_calls(tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(STANDINS / "standin_calls.py"), str(tmp_path / "uses.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_sgl_kernel_name_imports_and_nothing_is_logged(tmp_path: Path) -> None:
    done = _python(
        """
        import sgl_kernel
        from sgl_kernel.kvcacheio import transfer_kv_all_layer
        from sgl_kernel.scalar_type import ScalarType, scalar_types
        import sgl_kernel.elementwise.deep
        assert scalar_types.uint4b8 is not None and transfer_kv_all_layer is not None
        assert sgl_kernel.__version__.endswith("+rrh.standin")
        print("imported")
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "imported" in done.stdout
    checked = _standin_calls(tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "never used" in checked.stdout


def test_a_call_raises_is_logged_and_fails_the_check(tmp_path: Path) -> None:
    done = _python(
        """
        from sgl_kernel.kvcacheio import transfer_kv_all_layer
        try:
            transfer_kv_all_layer(1, 2)
        except RuntimeError as err:
            print(type(err).__name__, err)
        """,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "StandInCalled" in done.stdout and "sgl_kernel.kvcacheio.transfer_kv_all_layer" in done.stdout
    checked = _standin_calls(tmp_path)
    assert checked.returncode == 1, checked.stdout
    assert "used 1 time(s)" in checked.stderr
    assert "sgl_kernel.kvcacheio.transfer_kv_all_layer used" in checked.stderr


def test_the_host_buffer_entry_calls_sglangs_allocator_unpinned(tmp_path: Path) -> None:
    """A module named as SGLang's allocator table: after the import its ``"cpu"`` entry calls the
    module's own ``alloc_with_host_register`` with ``pin_memory=False``; other devices untouched."""
    package = tmp_path / "site" / "sglang" / "srt" / "mem_cache" / "pool_host"
    package.mkdir(parents=True)
    for folder in (package, *package.parents):
        if folder == tmp_path / "site":
            break
        (folder / "__init__.py").write_text("")
    (package / "common.py").write_text(
        textwrap.dedent(
            """
            from collections import defaultdict
            calls = []
            def alloc_with_host_register(dims, dtype, device, pin_memory, allocator, granularity=None):
                calls.append((dims, device, pin_memory, granularity))
                return "buffer"
            def alloc_with_pin_memory(*args, **kwargs):
                return "npu buffer"
            ALLOC_MEMORY_FUNCS = defaultdict(lambda: alloc_with_host_register, {"npu": alloc_with_pin_memory})
            """
        )
    )
    done = _python(
        """
        import sitecustomize
        from sglang.srt.mem_cache.pool_host import common
        assert sitecustomize.UNPINNED_SGLANG_HOST_BUFFER
        out = common.ALLOC_MEMORY_FUNCS["cpu"]((4, 2, 3), "int32", "cpu", True, None)
        assert out == "buffer", out
        assert common.calls == [((4, 2, 3), "cpu", False, None)], common.calls
        assert common.ALLOC_MEMORY_FUNCS["npu"] is common.alloc_with_pin_memory
        assert common.ALLOC_MEMORY_FUNCS["cuda"] is common.alloc_with_host_register
        print("unpinned")
        """,
        tmp_path,
        tmp_path / "site",
    )
    assert done.returncode == 0, done.stderr
    assert "unpinned" in done.stdout


def test_the_install_keeps_every_requirement_but_the_cuda_kernels(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``ci/sglang_cpu/install.py`` reads the installed wheel's own metadata: pins kept as written,
    requirements of other platforms and extras dropped, the CUDA-only kernels left out and named."""
    import importlib.util
    import platform

    info = tmp_path / "fakesgl-1.0.dist-info"
    info.mkdir()
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakesgl\nVersion: 1.0\n"
        "Requires-Dist: transformers==5.19.0\n"
        "Requires-Dist: sglang-kernel==0.4.10\n"
        "Requires-Dist: flashinfer_python[cu13]==0.7.2\n"
        f'Requires-Dist: decord2; platform_machine == "{other}"\n'
        'Requires-Dist: pytest; extra == "test"\n'
        "Requires-Dist: xgrammar==0.2.7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("sgl_install", STANDINS / "install.py")
    assert spec is not None and spec.loader is not None
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    kept, left_out = install.requirements("fakesgl")
    assert kept == ["transformers==5.19.0", "xgrammar==0.2.7"]
    assert left_out == ["sglang-kernel==0.4.10", "flashinfer_python[cu13]==0.7.2"]
