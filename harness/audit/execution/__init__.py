"""How an audit runs: serial, a process pool or Ray over the run's units (``executors``), the
pool's workers and their fork server (``pool``; the server's warm-up is
``harness.audit.synthetic.warm``), and the serial executor's read-ahead of the next row group
(``read_ahead``)."""
