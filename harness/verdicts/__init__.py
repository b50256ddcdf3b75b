"""Verdicts of released framework code: what the invariant suites say about each release's subjects,
recorded in ``fixtures/verdicts/`` and compared on every run (``record``), the same against a real
engine (``real_engine``), the pages generated from them (``tables``), ``python -m harness.verdicts``
(``command``), and the release watch (``releases``).

Layer: the suites and the suite runner (DESIGN §4); it may import the core, the subjects and
``harness.check``, never the CLI or the reports.
"""
