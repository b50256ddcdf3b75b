"""Install one SGLang release for its CPU engine mode: the release itself, and its requirements
except the CUDA-only kernel packages, which SGLang's CPU path never calls.

Why: ``pip install sglang`` also brings ~3 GB of GPU kernels (sglang-kernel, flashinfer,
flash-attn-4, cutlass DSL, tilelang, DeepEP, DeepGEMM, FlashMLA, ...) that no CPU run can execute,
and CI machines' disks are shared by every environment of ``.ci/run``. ``sgl_kernel`` is the one of
them SGLang imports on CPU: ``ci/sglang_cpu/sgl_kernel`` stands in for it (import-only, every use
logged), so leaving the real package out also proves no CUDA kernel ran. Everything else the wheel
requires is installed as the release pins it, read from the installed wheel's own metadata, so a
version bump (``RRH_SGLANG_VERSION``) installs that release's requirements.

Usage: ``python ci/sglang_cpu/install.py 0.5.23`` (tox -e sglang-cpu runs it).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The CUDA-only packages of SGLang's requirements, by canonical name: GPU kernels, their compilers
# and CUDA runtime hooks. None is imported on SGLang's CPU path but sgl_kernel (stood in).
CUDA_ONLY = frozenset(
    {
        "sglang-kernel",  # sgl_kernel: stood in by ci/sglang_cpu/sgl_kernel
        "flashinfer-python",
        "flash-attn-4",
        "humming-kernels",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "tilelang",
        "apache-tvm-ffi",  # tilelang's and flashinfer's runtime
        "torch-memory-saver",  # a CUDA allocator hook
        "cuda-python",
    }
)


def pip(*args: str) -> None:
    """Run this interpreter's pip; its failure is this script's."""
    subprocess.run([sys.executable, "-m", "pip", "install", *args], check=True)


def requirements(dist: str) -> tuple[list[str], list[str]]:
    """``dist``'s unconditional requirements on this platform: those to install, and the CUDA-only
    ones left out."""
    kept, left_out = [], []
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        (left_out if canonicalize_name(req.name) in CUDA_ONLY else kept).append(str(req).split(";")[0])
    return kept, left_out


def main(version: str) -> None:
    pip("--no-deps", f"sglang=={version}")
    kept, left_out = requirements("sglang")
    pip(*kept)
    # pip's resolver then reports these as "not installed": they are left out on purpose.
    print(f"sglang {version}: {len(kept)} requirements installed; CUDA-only, left out: {', '.join(left_out)}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python ci/sglang_cpu/install.py SGLANG_VERSION (e.g. 0.5.23)")
    main(sys.argv[1])
