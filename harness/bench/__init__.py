"""Every ``rrh bench`` target, each printing figures (never a timed test): the trace core's
throughput against a numpy copy and its recorded ratios (``trace``), the replay hooks' and the tap's
cost to a forward (``replay``, ``tap``, sharing the interleaved timing of ``pairs``), and the audit
against its read floor, serial, process pool and Ray (``audit``).

Layer: the top (DESIGN §4); it may import anything below it.
"""
