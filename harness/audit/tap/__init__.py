"""The tap: what a run's engine returned (``engine``) and what its trainer dispatched
(``trainer``), written as the run layout by each rank, with the per-rank manifests that say which
files a rank finished (``manifest``)."""
