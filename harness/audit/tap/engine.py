"""The tap's engine side (``harness.audit.tap.trainer``): each engine call of a sample — the start, a resume
after an abort, a new turn after tool tokens — as the harness's conventions decode it, with its own
payload, so the splice the framework made is judged against them. ``TapError``: what every part of
the tap raises when asked to record something it cannot place.

Imports ``harness.audit.layout.schema``, and ``harness.engines.vllm`` when a vLLM ``RequestOutput`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from harness.audit.layout.schema import ATTEMPT_KINDS, LayoutError


class TapError(LayoutError):
    """The tap was asked to record something it cannot place: the message names the field."""


@dataclass(frozen=True)
class TapAttempt:
    """One engine call of a sample: its kind, weight version, new tokens and its own payload
    (``[rows, num_layers, top_k]`` on the decoder axis, rows from position 0)."""

    kind: str
    weight_version: int
    context: tuple[int, ...]
    generated: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    routes: npt.NDArray[Any]


@dataclass
class EngineSample:
    """What the engine tap saw of one sample: its prompt, every attempt, and — once the framework
    made it — the spliced routes the trainer was given (``spliced``)."""

    key: str
    group_key: str | None
    prompt_len: int
    attempts: list[TapAttempt] = field(default_factory=list)
    spliced: npt.NDArray[Any] | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        last = self.attempts[-1]
        return last.context + last.generated

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def attempt_ends(self) -> list[int]:
        """Cumulative response tokens after each attempt (tool tokens count for the attempt that
        prefilled them)."""
        return [len(a.context) + len(a.generated) - self.prompt_len for a in self.attempts]

    def engine_logprobs(self) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.bool_]]:
        """Per response token: the engine's log-prob (nan for tool tokens) and whether it was generated."""
        values = np.full(self.response_len, np.nan, dtype=np.float32)
        generated = np.zeros(self.response_len, dtype=bool)
        for attempt in self.attempts:
            lo = len(attempt.context) - self.prompt_len
            hi = lo + len(attempt.generated)
            generated[lo:hi] = True
            if attempt.logprobs is not None:
                values[lo:hi] = attempt.logprobs
        return values, generated


class EngineTap:
    """Collects each sample's engine calls (see the module docstring and ``harness.audit.tap.trainer``'s)."""

    def __init__(self) -> None:
        self.samples: dict[str, EngineSample] = {}

    def attempt(
        self,
        key: str,
        rollout: Any,
        *,
        kind: str,
        weight_version: int,
        group_key: str | None = None,
    ) -> TapAttempt:
        """Record one engine call of sample ``key``: an ``EngineRollout`` (``prompt`` = the context it
        was given, its ``tokens``, ``logprobs`` and decoded ``trace``) of attempt ``kind``."""
        if not isinstance(key, str) or not key:
            raise TapError(f"sample_key: expected a non-empty string, got {key!r}")
        if kind not in ATTEMPT_KINDS:
            raise TapError(f"kind: expected one of {list(ATTEMPT_KINDS)}, got {kind!r}")
        sample = self.samples.get(key)
        if (sample is None) != (kind == "start"):
            raise TapError(
                f"kind: sample {key!r} {'has no attempt yet' if sample is None else 'already started'}; "
                f"expected {'start' if sample is None else 'resume or turn'}, got {kind!r}"
            )
        context = tuple(int(t) for t in rollout.prompt)
        if sample is None:
            sample = self.samples[key] = EngineSample(key, group_key, len(context))
        elif context[: len(sample.tokens)] != sample.tokens:
            raise TapError(
                f"context: attempt {len(sample.attempts)} of sample {key!r} does not extend the sample's "
                f"{len(sample.tokens)} tokens; expected them as its prefix"
            )
        trace = rollout.trace.to_decoder_axis()
        if trace.start != 0:
            raise TapError(f"trace.start: the tap keeps whole payloads; expected 0, got {trace.start}")
        record = TapAttempt(
            kind,
            int(weight_version),
            context,
            tuple(int(t) for t in rollout.tokens),
            None if rollout.logprobs is None else tuple(float(x) for x in rollout.logprobs),
            np.asarray(trace.experts),
        )
        sample.attempts.append(record)
        return record

    def request_output(
        self, key: str, output: Any, *, conv: Any, model: Any, version: str, kind: str, weight_version: int,
        group_key: str | None = None, index: int = 0,
    ) -> TapAttempt:  # fmt: skip
        """Record a vLLM ``RequestOutput`` (its ``outputs[index]``), decoded by the harness's convention."""
        from harness.engines.vllm import decode_request_output

        rollout = decode_request_output(output, conv=conv, model=model, version=version, index=index)
        return self.attempt(key, rollout, kind=kind, weight_version=weight_version, group_key=group_key)

    def pop(self, key: str) -> EngineSample:
        """The sample ``key`` (removed: the tap keeps only samples not yet trained on)."""
        try:
            return self.samples.pop(key)
        except KeyError:
            raise TapError(
                f"sample_key: {key!r} has no engine attempt; expected one of {sorted(self.samples)[:5]}"
            ) from None


# --- trainer side ---------------------------------------------------------------------------------
