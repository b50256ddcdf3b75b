"""Suites run against the subject chosen with ``--rr-subject``; a missing capability is a skip.

``require`` lives in the plugin so that the run's summary can count the capabilities exercised.
"""

from harness.pytest_plugin import require, subject_spec

__all__ = ["require", "subject_spec"]
