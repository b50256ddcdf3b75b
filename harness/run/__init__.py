"""``rrh run``: a small real RL loop (real vLLM on CPU, a transformers trainer driven through a
subject's replay driver) written through the tap (``loop``), and its trainer ranks on gloo holding CP
or SP shards (``ranks``).

Layer: beside the subjects (DESIGN §4); it may import the engines, trainers, the audit's tap and
the core, never the suites or the CLI.
"""
