"""The suites' failure messages say what was counted and what was expected, and which way it is off."""

from __future__ import annotations

from suites.test_splice import _row_count_message


def test_a_truncation_one_row_short_says_fewer_not_a_cut_token() -> None:
    message = _row_count_message(4, 6, (5, 6))
    assert message.startswith("4 rows after truncation for 6 tokens, expected 5 or 6")
    assert "1 fewer" in message and "cut token" not in message
    message = _row_count_message(4, 6, (5,))
    assert "expected 5" in message and "1 fewer" in message


def test_a_truncation_with_a_row_too_many_blames_a_cut_token() -> None:
    message = _row_count_message(8, 6, (5, 6))
    assert "8 rows after truncation for 6 tokens, expected 5 or 6" in message
    assert "2 more" in message and "cut token" in message
