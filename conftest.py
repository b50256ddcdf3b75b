"""Top-level pytest configuration for this repository's own runs (suites/ and tests/).

The harness's pytest plugin (markers, ``--rr-subject``, hypothesis profiles) is registered through
the ``pytest11`` entry point of the installed package. Here:

- One torch intra-op thread per test process. The models under test are tiny, so a forward is
  dominated by thread hand-offs (2 ms with one thread, hundreds with two threads per xdist worker on
  a 2-core machine); xdist supplies the parallelism instead.
- Once collected, what the imports built (torch, transformers, megatron-core, hypothesis: a few
  hundred thousand objects) is moved out of the garbage collector's sight (``gc.freeze``). Every
  pytest session ends with full collections (pytest's unraisable-exception cleanup), and the suite
  runs nested in tests (each mutant kill, each benign variant: ``harness.check.run_suites``) are
  sessions too: a full collection over everything imported took ~0.5 s, half of a mutant kill.
  Objects made by the tests themselves are collected as before.
- A test fails when it stalls, not when it is slow (``harness.testing.stall``: no CPU used by the
  test and its processes for ``--stall-timeout`` seconds); pytest-timeout's wall clock in
  ``pyproject.toml`` is only the cap on a test that spins forever.
"""

import gc

import pytest
import torch

pytest_plugins = ["harness.testing.stall"]

torch.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
