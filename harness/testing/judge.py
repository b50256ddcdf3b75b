"""Judging routes by their meaning, not their representation (DESIGN §3.3, §4 "suites").

A subject may hand back ids in any integer dtype that holds them, as a torch tensor, a numpy array
or nested lists, with each route's ids in any order. The suites turn what they get into int64 torch
tensors (``as_ids``) and compare routes as sets (``route_sets``) before judging. Bad input is
judged the same way (``refuses``): a subject must raise, in its own words; the reference's wording
(``raises_naming``: a ValueError naming the field) is checked by the reference's own tests, which run
the same bad-input cases with that stricter judge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def as_ids(x: Any, what: str = "routes") -> torch.Tensor:
    """``x`` as an int64 torch tensor; AssertionError (naming ``what``) if it does not hold integers."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise AssertionError(f"{what}: expected integer ids, got dtype {x.dtype}")
        return x.long()
    array = np.asarray(x)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise AssertionError(f"{what}: expected integer ids, got dtype {array.dtype}")
    return torch.from_numpy(array.astype(np.int64))


def route_sets(x: Any, what: str = "routes") -> torch.Tensor:
    """Routes as per-(row, layer) expert sets: int64, ids sorted along the last (top_k) axis."""
    return torch.sort(as_ids(x, what), dim=-1).values


Refusal = Callable[..., None]
"""How a bad-input case is judged: ``refusal(call, *words)`` (``refuses`` or ``raises_naming``)."""


def refuses(call: Callable[[], Any], *words: str) -> None:
    """``call()`` raises — any exception, in the subject's own words — instead of returning a result.
    ``words`` are the reference's wording of the refusal, not judged here (see ``raises_naming``)."""
    try:
        got = call()
    except Exception:
        return
    raise AssertionError(
        f"bad input accepted (returned a {type(got).__name__}); expected it refused with an exception "
        f"(the reference raises a ValueError naming {words})"
    )


def raises_naming(call: Callable[[], Any], *words: str) -> None:
    """``call()`` raises a ValueError whose message holds every one of ``words`` (the field, the
    expected value); AssertionError if it returns or its message lacks a word. Any other exception
    propagates: a crash on bad input is not a clear error either."""
    try:
        got = call()
    except ValueError as err:
        missing = [w for w in words if w not in str(err)]
        assert not missing, f"error {str(err)!r} does not name {missing}"
        return
    raise AssertionError(
        f"bad input accepted (returned a {type(got).__name__}); expected a ValueError naming {words}"
    )
