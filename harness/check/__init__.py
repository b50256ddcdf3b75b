"""``rrh check`` underneath: the invariant suites run in-process against a subject (``suites``), the
typed plan of what a check runs (``plan``), the runner that executes a plan and reports it as it goes
(``runner``), and the mutation run that proves each suite kills its known bugs (``mutation``).

Layer: the suites and the suite runner (DESIGN §4), ``runner`` one floor up beside the reports it
writes to; it may import the subjects, the lab and the core, never the CLI.
"""
