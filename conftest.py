"""Top-level pytest configuration for this repository's own runs (suites/ and tests/).

The harness's pytest plugin (markers, ``--rr-subject``, hypothesis profiles) is registered through
the ``pytest11`` entry point of the installed package. Here: one torch intra-op thread per test
process. The models under test are tiny, so a forward is dominated by thread hand-offs (2 ms with
one thread, hundreds with two threads per xdist worker on a 2-core machine); xdist supplies the
parallelism instead.
"""

import torch

torch.set_num_threads(1)
