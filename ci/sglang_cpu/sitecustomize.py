"""Real SGLang on a CPU, in every interpreter it starts: its routed-experts host buffer, unpinned.

What it replaces: one entry of SGLang's host-allocator table. SGLang 0.5.23 allocates the
routed-experts host buffer (``sglang/srt/state_capturer/base.py``, ``BaseHostCache``) through
``sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS[device]``, whose default,
``alloc_with_host_register``, always pins the buffer with ``cudaHostRegister`` ("Found no NVIDIA
driver" on a CPU). Here the ``"cpu"`` entry calls that same SGLang function with ``pin_memory=False``:
SGLang's own allocator, only unpinned (pinning buys asynchronous copies to a GPU there is none of).

Why a ``sitecustomize``: SGLang's scheduler and detokenizer are **spawned** interpreters, so a change
made only in the parent never reaches the process that captures. ``tox -e sglang-cpu`` puts this
folder first on ``PYTHONPATH`` (with the ``sgl_kernel`` stand-in beside it); the table is changed
when SGLang's module is first imported, in whichever process imports it, and nothing else of SGLang
is touched. Importing this file imports nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_TARGET = "sglang.srt.mem_cache.pool_host.common"
UNPINNED_SGLANG_HOST_BUFFER = True
"""Read by ``harness.engines.sglang_cpu``: this interpreter unpins SGLang's host buffer."""


def _unpin(module: Any) -> None:
    """Make ``ALLOC_MEMORY_FUNCS["cpu"]`` SGLang's default allocator with pinning off."""
    register = module.alloc_with_host_register

    def alloc_unpinned(
        dims: Any, dtype: Any, device: str, pin_memory: bool, allocator: Any, **kw: Any
    ) -> Any:
        return register(dims, dtype, device, False, allocator, **kw)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``_TARGET`` with the normal machinery and runs ``_unpin`` once it has executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _unpin(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
