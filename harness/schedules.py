"""Attempt schedules: partial rollouts and multi-turn episodes, and what a correct splice returns.

A *schedule* is one sample's life in the inference engine: a prompt, then attempts (DESIGN §2
"attempt"), each of which may first prefill tool/observation tokens, then generate some tokens
(possibly none: aborted at once), possibly cut by the length budget, possibly after a weight
update (the fully-async case). ``simulate`` plays a schedule through a model engine whose route
for position ``p`` under weight version ``v`` is a known, distinct function of ``(p, v)``, so every
row of a spliced trace tells which attempt computed it. That is what makes "replace with the
latest payload" (verl #6046) and "concatenate payloads" (verl #5430) observably wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference_impl.splice import Attempt

FINISH_REASONS = ("stop", "abort", "length")


@dataclass(frozen=True)
class AttemptSpec:
    """One engine call: ``tool_tokens`` prefilled first, then ``generated`` tokens sampled."""

    tool_tokens: int = 0
    generated: int = 0
    weight_update_before: bool = False
    finish_reason: str = "stop"

    @property
    def new_tokens(self) -> int:
        """Tokens this attempt adds to the sample (tool tokens count for the attempt that prefilled them)."""
        return self.tool_tokens + self.generated


@dataclass(frozen=True)
class Schedule:
    """A prompt and the attempts that extended it."""

    prompt_len: int
    attempts: tuple[AttemptSpec, ...]

    @property
    def total_len(self) -> int:
        return self.prompt_len + sum(a.new_tokens for a in self.attempts)

    def kind(self, index: int) -> str:
        """What engine call attempt ``index`` is: ``"start"`` (the first), ``"turn"`` (it prefills tool
        tokens, or the call before it ended its turn with ``"stop"``) or ``"resume"`` (it continues an
        aborted call)."""
        if index == 0:
            return "start"
        spec = self.attempts[index]
        return "turn" if spec.tool_tokens or self.attempts[index - 1].finish_reason == "stop" else "resume"

    @property
    def expected_rows(self) -> int:
        """``P + Σ a_j − 1`` (DESIGN §3.4)."""
        return self.total_len - 1

    def describe(self) -> str:
        """The schedule in plain words, for failure messages."""
        parts = [f"prompt of {self.prompt_len} tokens"]
        for j, a in enumerate(self.attempts, 1):
            words = (
                f"attempt {j} ({self.kind(j - 1)}): {a.tool_tokens} tool + {a.generated} generated "
                f"({a.finish_reason})"
            )
            parts.append(("weights updated; " if a.weight_update_before else "") + words)
        return "; ".join(parts)


@dataclass(frozen=True)
class SimulatedRollout:
    """What the engine returned for each attempt, and the trace a correct splice builds."""

    attempts: tuple[Attempt, ...]
    expected: torch.Tensor  # [P + Σa − 1, layers, top_k]
    version_of_row: tuple[int, ...]  # the weight version that computed each expected row


def route(position: int, version: int, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """The simulated engine's route ``[layers, top_k]``: distinct ids, different for each version.

    Consecutive ids starting at ``(7p + 5v + 3l) mod E``: for E > 5·versions the start moves with
    every weight update, so rows computed under different weights never coincide.
    """
    starts = torch.tensor([(7 * position + 5 * version + 3 * layer) % num_experts for layer in range(layers)])
    return (starts[:, None] + torch.arange(top_k)[None, :]) % num_experts


def simulate(
    schedule: Schedule,
    *,
    layers: int = 2,
    top_k: int = 2,
    num_experts: int = 64,
    idle_payloads: bool = False,
) -> SimulatedRollout:
    """Play ``schedule`` through the model engine (rows ``[0, context + generated − 1)`` per call).

    An attempt that adds no token returns None, or with ``idle_payloads`` the rows of the context
    it prefilled before the abort (vLLM ≥ 0.22 returns the rows so far); either way a correct
    splice takes nothing from it.
    """

    def rows_under(version: int, count: int) -> torch.Tensor:
        if count <= 0:
            return torch.zeros((0, layers, top_k), dtype=torch.long)
        return torch.stack([route(p, version, layers, top_k, num_experts) for p in range(count)])

    version = 0
    context = schedule.prompt_len
    attempts: list[Attempt] = []
    version_of_row: list[int] = []
    for index, spec in enumerate(schedule.attempts):
        version += spec.weight_update_before
        fed = context + spec.tool_tokens + spec.generated
        ran_forward = spec.new_tokens > 0
        payload = rows_under(version, fed - 1) if ran_forward or idle_payloads else None
        if ran_forward:  # rows first computed by this attempt carry its weight version
            version_of_row += [version] * (fed - 1 - len(version_of_row))
        attempts.append(
            Attempt(
                new_tokens=spec.new_tokens,
                routes=payload,
                finish_reason=spec.finish_reason,
                kind=schedule.kind(index),
                tool_tokens=spec.tool_tokens,
                weight_version=version,
            )
        )
        context = fed
    expected = (
        torch.stack([route(p, v, layers, top_k, num_experts) for p, v in enumerate(version_of_row)])
        if version_of_row
        else rows_under(0, 0)
    )
    return SimulatedRollout(tuple(attempts), expected, tuple(version_of_row))
