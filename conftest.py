"""Top-level pytest configuration.

The harness's pytest plugin (markers, ``--rr-subject``, hypothesis profiles) is registered through
the ``pytest11`` entry point of the installed package; this file only keeps pytest's rootdir here
and lets the suites run from a plain checkout that was installed in editable mode.
"""
