"""Routing-replay harness: verify that MoE routing replay (R2, R3) is implemented correctly.

The core (traces, engine conventions, metrics, strategies) depends on numpy only; engine and
trainer adapters import their engines lazily.
"""

from harness.errors import (
    ConventionError,
    HarnessError,
    MetricError,
    SubjectError,
    TraceError,
    TraceFileError,
)

__version__ = "0.1.0"

__all__ = [
    "ConventionError",
    "HarnessError",
    "MetricError",
    "SubjectError",
    "TraceError",
    "TraceFileError",
    "__version__",
]
