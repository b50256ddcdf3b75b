"""The regression gate for a new engine version: a baseline document and its comparison
(``baseline``, core) and ``rrh gate``'s observation of an engine against it (``run``).

Layer: ``baseline`` is core (JSON, no engine); ``run`` sits at the top beside the CLI and may import
the engine adapters, the suite runner and everything below.
"""
