#!/usr/bin/env bash
# Install one framework release under test (verl-X, skyrl-X, mcore-X) into the active Python, on
# CPU, next to the torch already there (FACTS §6). verl's and SkyRL's metadata pull CUDA builds and
# pin older transformers, so the release goes in with --no-deps, then the few packages its routing
# replay, rollout and agent-loop modules import. Used by the tox envs and by .ci/run.
set -euo pipefail
release="${1:?usage: ci/install_framework.sh verl-0.9.1|skyrl-0.3.0|mcore-0.16.1}"
dist="${release%-*}"
version="${release##*-}"
pip_install() { python -m pip install -q --disable-pip-version-check "$@"; }
case "$dist" in
  verl)
    # pyvers 0.1 (tensordict's) pins packaging<26, which would downgrade the packaging that tox
    # and virtualenv need; it only calls packaging.version.parse, so it goes in without deps.
    pip_install --no-deps "verl==$version" tensordict==0.10.0 peft accelerate torchdata "pyvers<0.2"
    pip_install ray cloudpickle importlib_metadata orjson hydra-core codetiming pillow \
      cachetools uvicorn fastapi datasets psutil
    ;;
  skyrl)
    pip_install --no-deps "skyrl==$version"
    pip_install loguru jaxtyping datasets
    ;;
  mcore)
    pip_install --no-deps "megatron-core==$version"
    ;;
  *)
    echo "ci/install_framework.sh: unknown release '$release' (verl-X, skyrl-X or mcore-X)" >&2
    exit 2
    ;;
esac
python - "$dist" <<'PY'
import sys, torch
print(f"installed {sys.argv[1]} next to torch {torch.__version__}")
PY
