"""Tests of the reference splice (DESIGN §3.4) and truncation.

Payloads are coded so that every row says where it came from: row ``p`` of the payload of an attempt
run under weights version ``v`` holds ``1000 * v + p`` everywhere. A splice that takes a row from the
wrong attempt, or attaches it to the wrong position, shows up as a wrong value.
"""

from __future__ import annotations

import pytest
import torch

from reference_impl.splice import Attempt, SpliceError, splice, splice_replace, truncate

LAYERS, TOP_K = 3, 2


def payload(context_len: int, version: int = 0) -> torch.Tensor:
    """Payload of an attempt that saw ``context_len`` positions under weights ``version``."""
    rows = torch.arange(context_len - 1) + 1000 * version
    return rows.view(-1, 1, 1).expand(-1, LAYERS, TOP_K).clone()


def versions(trace: torch.Tensor) -> list[int]:
    """The weights version each row of a coded trace came from."""
    return (trace[:, 0, 0] // 1000).tolist()


def positions(trace: torch.Tensor) -> list[int]:
    """The position each row of a coded trace was computed for."""
    return (trace[:, 0, 0] % 1000).tolist()


def test_single_attempt_is_its_payload() -> None:
    trace = splice(4, [Attempt(3, payload(7))])
    assert torch.equal(trace, payload(7))


def test_weight_change_keeps_first_computed_rows_and_replace_takes_latest() -> None:
    # P = 4, attempts add 3, 2, 2 tokens; the weights change before every attempt.
    first = payload(7, 0)
    attempts = [Attempt(3, first), Attempt(2, payload(9, 1)), Attempt(2, payload(11, 2))]
    trace = splice(4, attempts)
    assert trace.shape == (4 + 3 + 2 + 2 - 1, LAYERS, TOP_K)
    assert positions(trace) == list(range(10))
    # attempt 0: prompt rows and its own rows [0, 6); attempt 1: [6, 8); attempt 2: [8, 10)
    assert versions(trace) == [0] * 6 + [1] * 2 + [2] * 2
    assert torch.equal(trace[:6], first)

    replaced = splice_replace(4, attempts)
    assert replaced.shape == trace.shape
    assert versions(replaced) == [2] * 10
    assert not torch.equal(replaced, trace)


def test_same_weights_splice_equals_replace() -> None:
    attempts = [Attempt(3, payload(7)), Attempt(0, payload(7)), Attempt(2, payload(9))]
    assert torch.equal(splice(4, attempts), splice_replace(4, attempts))


def test_concatenating_whole_payloads_gives_the_wrong_row_count() -> None:
    # verl #5430: P = 4, attempts add 3 then 2 tokens.
    payloads = [payload(7), payload(9)]
    attempts = [Attempt(3, payloads[0]), Attempt(2, payloads[1])]
    concatenated = torch.cat(payloads)
    assert concatenated.shape[0] == 6 + 8
    assert splice(4, attempts).shape[0] == 4 + 3 + 2 - 1 == 8


def test_zero_token_attempt_contributes_nothing() -> None:
    # The `[-0:]` trap: payload[-0:] is the whole payload, not an empty slice.
    middle = payload(7, 1)
    assert middle[-0:].shape[0] == 6
    with_empty = [Attempt(3, payload(7, 0)), Attempt(0, middle), Attempt(2, payload(9, 2))]
    without = [Attempt(3, payload(7, 0)), Attempt(2, payload(9, 2))]
    trace = splice(4, with_empty)
    assert torch.equal(trace, splice(4, without))
    assert 1 not in versions(trace)
    assert trace.shape[0] == 8


def test_zero_token_attempt_may_return_none() -> None:
    attempts = [Attempt(3, payload(7, 0)), Attempt(0, None), Attempt(2, payload(9, 2))]
    assert versions(splice(4, attempts)) == [0] * 6 + [2] * 2


def test_first_attempt_aborted_before_any_forward() -> None:
    # The first attempt to add tokens supplies the prompt rows.
    trace = splice(4, [Attempt(0, None), Attempt(3, payload(7, 1))])
    assert versions(trace) == [1] * 6
    assert positions(trace) == list(range(6))


def test_none_payload_with_new_tokens_raises_naming_the_attempt() -> None:
    with pytest.raises(SpliceError, match=r"attempt 1: routes is None \(0 rows\); rows needed: 8"):
        splice(4, [Attempt(3, payload(7)), Attempt(2, None)])


def test_short_payload_raises_naming_rows_and_need() -> None:
    with pytest.raises(SpliceError, match=r"attempt 1: routes has 7 rows; rows needed: 8"):
        splice(4, [Attempt(3, payload(7)), Attempt(2, payload(8))])


def test_long_payload_raises() -> None:
    with pytest.raises(SpliceError, match=r"attempt 0: routes has 7 rows; rows needed: 6"):
        splice(4, [Attempt(3, payload(8))])


def test_payloads_with_different_layer_axes_raise() -> None:
    other = torch.zeros(8, LAYERS + 1, TOP_K, dtype=torch.long)
    with pytest.raises(SpliceError, match="payloads disagree"):
        splice(4, [Attempt(3, payload(7)), Attempt(2, other)])


def test_negative_new_tokens_and_empty_prompt_raise() -> None:
    with pytest.raises(SpliceError, match="attempt 0: new_tokens"):
        splice(4, [Attempt(-1, None)])
    with pytest.raises(SpliceError, match="prompt_len"):
        splice(0, [Attempt(1, payload(1))])


def test_degenerate_sample_of_length_one_has_no_rows() -> None:
    empty = torch.zeros(0, LAYERS, TOP_K, dtype=torch.int16)
    trace = splice(1, [Attempt(0, empty)])
    assert trace.shape == (0, LAYERS, TOP_K) and trace.dtype == torch.int16
    assert splice_replace(1, [Attempt(0, empty)]).shape == (0, LAYERS, TOP_K)
    with pytest.raises(SpliceError, match="no attempt returned routes"):
        splice(1, [Attempt(0, None)])


def test_prompt_only_sample_raises() -> None:
    with pytest.raises(SpliceError, match="no attempt added tokens, so no attempt owns the 3 prompt"):
        splice(4, [Attempt(0, payload(4))])


def test_length_two_sample_has_one_row() -> None:
    assert splice(1, [Attempt(1, payload(2))]).shape == (1, LAYERS, TOP_K)


def test_replace_skips_trailing_none_and_checks_row_count() -> None:
    attempts = [Attempt(3, payload(7, 0)), Attempt(0, None)]
    assert torch.equal(splice_replace(4, attempts), payload(7, 0))
    with pytest.raises(SpliceError, match=r"attempt 0: routes has 6 rows; rows needed: 8"):
        splice_replace(4, [Attempt(3, payload(7)), Attempt(2, None)])
    with pytest.raises(SpliceError, match="no attempt returned routes"):
        splice_replace(4, [Attempt(2, None)])


def test_truncate_keeps_tokens_and_rows_aligned() -> None:
    tokens = torch.arange(10)
    routes = payload(10)
    cut_tokens, cut_routes = truncate(tokens, routes, prompt_len=4, max_response_len=3)
    assert torch.equal(cut_tokens, torch.arange(7))
    assert cut_routes.shape[0] == len(cut_tokens) - 1 == 6
    assert torch.equal(cut_routes, routes[:6])


def test_truncate_within_budget_is_identity() -> None:
    tokens, routes = torch.arange(10), payload(10)
    cut_tokens, cut_routes = truncate(tokens, routes, prompt_len=4, max_response_len=6)
    assert torch.equal(cut_tokens, tokens) and torch.equal(cut_routes, routes)


def test_truncate_to_empty_response_keeps_prompt_rows() -> None:
    cut_tokens, cut_routes = truncate(torch.arange(10), payload(10), 4, 0)
    assert cut_tokens.shape[0] == 4 and cut_routes.shape[0] == 3


def test_truncate_rejects_misaligned_input() -> None:
    with pytest.raises(SpliceError, match=r"routes has 10 rows, expected len\(tokens\) - 1 = 9"):
        truncate(torch.arange(10), payload(11), 4, 3)
    with pytest.raises(SpliceError, match="prompt_len"):
        truncate(torch.arange(10), payload(10), 11, 3)
    with pytest.raises(SpliceError, match="max_response_len"):
        truncate(torch.arange(10), payload(10), 4, -1)
