"""Suites run against the subject chosen with ``--rr-subject``; a missing capability is a skip."""

from __future__ import annotations

from typing import Any

import pytest

from harness.subjects import MissingCapability, Subject


def require(subject: Subject, capability: str) -> Any:
    """The subject's ``capability``, or skip the test with a reason naming it."""
    try:
        return subject.require(capability)
    except MissingCapability as err:
        pytest.skip(str(err))
