"""Following a run while it trains (``rrh audit --follow``): what the writer has finished (``sources``),
the loop that audits it step by step into the one mergeable state (``watch``), and the per-step time
series it writes as each step lands (``series``)."""
