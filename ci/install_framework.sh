#!/usr/bin/env bash
# Install framework releases under test (verl-X, skyrl-X, mcore-X; several in order: `verl-0.9.1
# mcore-0.19.2` is verl on a newer Megatron-core, `skyrl-0.4.0 mcore-0.19.2` because SkyRL 0.4.0
# imports megatron.core.models.hybrid, which megatron-core 0.16 lacks) into the active Python, on
# CPU, next to the torch already there (FACTS §6). verl's and SkyRL's metadata pull CUDA builds and pin older
# transformers, so a release goes in with --no-deps, then the few packages its routing replay,
# rollout and agent-loop modules import. megatron-core ≥ 0.17 and SkyRL 0.4.0 declare Python ≥ 3.12
# yet run on 3.11: they go in with --ignore-requires-python. Used by the tox envs and by .ci/run.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: ci/install_framework.sh RELEASE... (verl-0.9.1, skyrl-0.4.0, mcore-0.19.2)" >&2; exit 2; }
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }
for release in "$@"; do
  dist="${release%-*}"
  version="${release##*-}"
  case "$dist" in
    verl)
      # pyvers 0.1 (tensordict's) pins packaging<26, which would downgrade the packaging that tox
      # and virtualenv need; it only calls packaging.version.parse, so it goes in without deps.
      pip_install --no-deps "verl==$version" tensordict==0.10.0 peft accelerate torchdata "pyvers<0.2"
      pip_install ray cloudpickle importlib_metadata orjson hydra-core codetiming pillow \
        cachetools uvicorn fastapi datasets psutil
      ;;
    skyrl)
      pip_install --no-deps --ignore-requires-python "skyrl==$version"
      # 0.4.0 declares cloudpathlib and zstandard (its dataset modules import them).
      pip_install loguru jaxtyping datasets cloudpathlib zstandard
      ;;
    mcore)
      pip_install --no-deps --ignore-requires-python "megatron-core==$version"
      # 0.17+: megatron/core/ops/paged_stash.py imports triton unconditionally (CPU wheel, no CUDA).
      case "$version" in 0.16.*) ;; *) pip_install triton ;; esac
      ;;
    *)
      echo "ci/install_framework.sh: unknown release '$release' (verl-X, skyrl-X or mcore-X)" >&2
      exit 2
      ;;
  esac
done
python - "$@" <<'PY'
import sys, torch
print(f"installed {' '.join(sys.argv[1:])} next to torch {torch.__version__}")
PY
