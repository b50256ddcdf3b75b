"""What an audit found, from the merged accumulators (``harness.audit.checks.state``): the
figures of a finished audit (``audit_result``) with its per-step and per-layer tables, worst
samples and drift (``tables``), the prompt rows named at the end (``findings``), and the Parquet
tables of ``--summary`` (``summary``)."""
