"""The inputs of every gap metric: coercion to float64 numpy, validation, the masked-in tokens.

Also the metrics' parameters and their checks: ``LOGPROB_TOLERANCE``, the extreme-token threshold
τ and the IcePop ratio band. Conventions and errors: the package's docstring (``harness.metrics``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from harness.errors import MetricError

FloatArray: TypeAlias = npt.NDArray[np.float64]
BoolArray: TypeAlias = npt.NDArray[np.bool_]
#: numpy array, torch tensor (any device, any floating dtype) or nested sequence of floats.
LogprobsLike: TypeAlias = Any
#: bool or 0/1 array-like / torch tensor of the log-probs' shape; ``None`` selects every token.
MaskLike: TypeAlias = Any

#: A masked-in log-prob above this is rejected: it is not a log-probability.
LOGPROB_TOLERANCE = 1e-6

#: Headline threshold of the R3 paper's "extreme tokens" (arXiv 2510.11370): |Δ| > ln 2.
DEFAULT_TAU = 2.0
#: IcePop keeps tokens whose ratio π_train/π_infer lies in [0.5, 5].
ICEPOP_LOW = 0.5
ICEPOP_HIGH = 5.0


def _torch_tensor_type() -> Any:
    """``torch.Tensor`` if torch is already imported, else ``None`` (the core never imports torch)."""
    torch = sys.modules.get("torch")
    return None if torch is None else getattr(torch, "Tensor", None)


def _to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """Array view of ``x`` (torch tensors detached and moved to CPU) and its dtype's name."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(x, tensor_type):
        import torch

        t = x.detach().cpu()
        if t.dtype == torch.bool:
            return t.numpy(), str(t.dtype)
        if t.is_floating_point():
            return t.to(torch.float64).numpy(), str(t.dtype)
        if t.is_complex():
            return t.resolve_conj().numpy(), str(t.dtype)
        return t.to(torch.int64).numpy(), str(t.dtype)
    arr = np.asarray(x)
    return arr, str(arr.dtype)


def _as_float64(name: str, x: LogprobsLike) -> FloatArray:
    """``x`` as a float64 numpy array; raises MetricError unless it holds floating-point values."""
    arr, dtype_name = _to_numpy(x)
    if arr.dtype.kind != "f":
        raise MetricError(
            f"{name} has dtype {dtype_name}, expected a floating-point dtype (log-probabilities)"
        )
    return arr.astype(np.float64, copy=False)


def _as_mask(mask: MaskLike, shape: tuple[int, ...]) -> BoolArray:
    """``mask`` as a bool array of ``shape``; ``None`` selects everything."""
    if mask is None:
        return np.ones(shape, dtype=np.bool_)
    arr, dtype_name = _to_numpy(mask)
    if arr.shape != shape:
        raise MetricError(f"mask has shape {arr.shape}, expected {shape} like train_logprobs")
    if arr.dtype.kind == "b":
        return arr.astype(np.bool_, copy=False)
    if arr.dtype.kind not in "iuf":
        raise MetricError(f"mask has dtype {dtype_name}, expected bool or 0/1 values")
    is_one: BoolArray = arr == 1
    not_01 = ~(is_one | (arr == 0))
    if not_01.any():
        idx = tuple(int(i) for i in np.argwhere(not_01)[0])
        raise MetricError(f"mask has value {arr[idx].item()!r} at index {idx}, expected bool or 0/1 values")
    return is_one


def _check_values(name: str, values: FloatArray, where: BoolArray) -> None:
    """Masked-in entries must be finite and ≤ LOGPROB_TOLERANCE."""
    bad = where & ~np.isfinite(values)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise MetricError(
            f"{name} has non-finite value {float(values[idx])} at masked-in index {idx} "
            f"({int(bad.sum())} such entries), expected finite log-probabilities"
        )
    bad = where & (values > LOGPROB_TOLERANCE)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise MetricError(
            f"{name} has positive value {float(values[idx])!r} at masked-in index {idx} "
            f"({int(bad.sum())} such entries), expected log-probabilities <= 0 "
            f"(tolerance {LOGPROB_TOLERANCE:g})"
        )


@dataclass(frozen=True)
class Tokens:
    """The validated masked-in tokens, flattened: both log-probs and Δ = train − infer."""

    train: FloatArray
    infer: FloatArray
    delta: FloatArray


def select_tokens(train_logprobs: LogprobsLike, infer_logprobs: LogprobsLike, mask: MaskLike) -> Tokens:
    """Validate the three inputs and return the masked-in tokens (1-D float64 arrays)."""
    train = _as_float64("train_logprobs", train_logprobs)
    infer = _as_float64("infer_logprobs", infer_logprobs)
    if infer.shape != train.shape:
        raise MetricError(
            f"infer_logprobs has shape {infer.shape}, expected {train.shape} like train_logprobs"
        )
    keep = _as_mask(mask, train.shape)
    _check_values("train_logprobs", train, keep)
    _check_values("infer_logprobs", infer, keep)
    t = train[keep]
    i = infer[keep]
    return Tokens(train=t, infer=i, delta=t - i)


def check_tau(tau: float) -> float:
    """``tau`` as a float; raises MetricError unless it is a finite number >= 1."""
    ok = (
        isinstance(tau, (int, float, np.floating, np.integer))
        and not isinstance(tau, bool)
        and math.isfinite(tau)
        and tau >= 1
    )
    if not ok:
        raise MetricError(f"tau is {tau!r}, expected a finite number >= 1 (threshold |Δ| > ln tau)")
    return float(tau)


def check_band(low: float, high: float) -> tuple[float, float]:
    """``(low, high)`` as floats; raises MetricError unless ``0 < low <= high``."""
    ok = (
        isinstance(low, (int, float, np.floating, np.integer))
        and isinstance(high, (int, float, np.floating, np.integer))
        and math.isfinite(low)
        and 0 < low <= high
    )
    if not ok:
        raise MetricError(
            f"low, high are {low!r}, {high!r}, expected 0 < low <= high (ratio band [low, high])"
        )
    return float(low), float(high)
