"""An import-only stand-in for ``sgl_kernel`` (PyPI ``sglang-kernel``), so real SGLang runs on a CPU.

What it replaces: SGLang's compiled kernel package. The only build on PyPI (0.4.10) is a CUDA one
(no CPU ops, no sdist), and SGLang's CPU mode imports it at module level (for example
``sglang/kernels/ops/kvcache/cache_move.py``): ``ImportError: libcuda.so.1`` before any engine starts.

Why this is enough: on a CPU, SGLang 0.5.23 takes its own torch-native paths (``SGLANG_USE_CPU_ENGINE=1``,
``attention_backend="torch_native"``) and calls no ``sgl_kernel`` function; it only imports names.
So every ``sgl_kernel`` submodule imports, every name in it resolves, and every call (or any use
beyond naming it) raises ``StandInCalled`` and is appended to the file ``$RRH_SGLANG_STANDIN_LOG``
names. ``ci/sglang_cpu/standin_calls.py`` fails the run when that file is not empty: the proof that
what ran was SGLang's torch code, not a stand-in. No ``torch.ops.sgl_kernel`` op is registered, so
``cpu_has_amx_support()`` stays False and SGLang never asks for its AMX kernels.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import traceback
import types
from typing import Any, NoReturn

__version__ = "0.0.0+rrh.standin"
LOG_ENV = "RRH_SGLANG_STANDIN_LOG"


class StandInCalled(RuntimeError):
    """A stand-in name was used: SGLang took a path that needs the real CUDA kernel package."""


def _record(name: str) -> NoReturn:
    """Append the call (process, name, caller) to ``$RRH_SGLANG_STANDIN_LOG``, then raise."""
    log = os.environ.get(LOG_ENV)
    caller = "".join(traceback.format_stack(limit=4)[:-2]).strip().replace("\n", " | ")
    if log:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"pid {os.getpid()}: {name} used; from {caller}\n")
    raise StandInCalled(f"sgl_kernel stand-in: {name} was used; the real sglang-kernel is CUDA-only")


class _Name:
    """A name that resolves (imports, annotations, ``is None`` checks) and raises on any use."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _record(self._qualname)

    def __getattr__(self, attr: str) -> _Name:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Name(f"{self._qualname}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


class _Module(types.ModuleType):
    """A submodule whose every public name is a ``_Name``."""

    def __getattr__(self, attr: str) -> _Name:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Name(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every ``sgl_kernel.<x>[.<y>…]`` importable as a ``_Module`` (a package, so it nests)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.append(_Finder())


def __getattr__(attr: str) -> _Name:
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return _Name(f"{__name__}.{attr}")
