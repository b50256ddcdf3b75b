"""The reference subject: the executable specification, against which every suite must pass."""

from __future__ import annotations

from harness.subjects import Subject

REFERENCE = Subject(name="reference")
