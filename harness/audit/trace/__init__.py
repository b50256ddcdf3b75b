"""The trainer trace: megatron-core's router trace (``router_tracer`` writes one from a forward),
its files (``layout``), the join of a trace with a framework's dump (``join``), the update pass a
trace names (``update``), and verl's THD packing undone to place a trace's rows on their tokens
(``verl_packing``)."""
