"""The harness's own error types.

Every check that rejects input raises one of these, with a message that names the field, the
position or layer where it applies, and the value that was expected. Callers can catch
``HarnessError`` for anything the harness refuses; the subclasses also derive from ``ValueError``
so code that already catches ``ValueError`` keeps working.
"""

from __future__ import annotations


class HarnessError(Exception):
    """Base class of every error the harness raises on purpose."""


class TraceError(HarnessError, ValueError):
    """A routing trace is malformed: wrong shape, dtype, ids, coverage or metadata."""


class TraceFileError(TraceError):
    """A stored trace cannot be read back: truncated, corrupted, or not a trace file."""


class ConventionError(HarnessError, ValueError):
    """An engine payload does not follow its engine's convention, or the engine version is unknown."""


class MetricError(HarnessError, ValueError):
    """Inputs to a metric are malformed (shapes, dtypes, values that are not log-probabilities)."""


class SubjectError(HarnessError, ValueError):
    """A subject (implementation under test) cannot be loaded or is not a subject."""


class MegatronReplayError(HarnessError, ValueError):
    """Replay targets cannot be fed to Megatron-core as asked, or a replay check failed."""
