"""The reference's own wording of a refusal: every bad-input case of the suites, judged strictly.

The suites judge a subject's refusal of bad input by the invariant alone (it raises, returns nothing,
leaves its input as it was: ``harness.testing.judge.refuses``); how the error reads is the reference's
style. Here the same cases run against the reference with ``raises_naming``: a ValueError whose
message names the field and the expected value.
"""

from __future__ import annotations

import pytest

from harness.subjects.reference import REFERENCE
from harness.testing.judge import raises_naming
from suites.test_layouts import test_bad_layout_input_is_refused as bad_layout_input
from suites.test_splice import test_bad_splice_and_truncate_input_is_refused as bad_splice_input
from suites.test_training import test_bad_trainer_input_is_refused as bad_trainer_input


@pytest.mark.capability("layouts")
def test_layout_errors_name_the_field() -> None:
    bad_layout_input(REFERENCE, raises_naming)


@pytest.mark.capability("splice", "truncate")
def test_splice_and_truncate_errors_name_the_field() -> None:
    bad_splice_input(REFERENCE, raises_naming)


@pytest.mark.capability("training")
def test_trainer_errors_name_the_field() -> None:
    bad_trainer_input(REFERENCE, raises_naming)
