"""The simulated engine: routes that tell which attempt computed them, the oracle of the splice suite.

An episode's `Schedule` (``reference_impl.episode``; re-exported here) is played through
`SimulatedEngine` by the one episode driver, ``reference_impl.episode.run_episode``. The engine's
route for position ``p`` under weight version ``v`` is a known, distinct function of ``(p, v)``
(`route`), so every row of a spliced trace tells which attempt computed it. That is what makes
"replace with the latest payload" (verl #6046) and "concatenate payloads" (verl #5430) observably
wrong. The engine generates exactly its budget (token id 0, log-prob 0) and prefills every tool
token it is given, so a plan's ``max_new_tokens`` is the number of tokens the attempt generates.

Real routing is not that kind: a top-1 router over few experts, or a model that sends a stretch of
tokens to the same experts, returns the same row again and again, across a resume or a turn boundary
too. A `RouteTable` gives the engine such low-entropy routes on purpose, so that a splice which takes
an equal row for a duplicate, or finds its rows by content, is seen to lose or misplace them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference_impl.engine import Rollout
from reference_impl.episode import AttemptPlan, Episode, Schedule, run_episode

__all__ = ["AttemptPlan", "RouteTable", "Schedule", "SimulatedEngine", "route", "simulate"]


def route(position: int, version: int, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """The simulated engine's route ``[layers, top_k]``: distinct ids, different for each version.

    Consecutive ids starting at ``(7p + 5v + 3l) mod E``: for E > 5·versions the start moves with
    every weight update, so rows computed under different weights never coincide.
    """
    starts = torch.tensor([(7 * position + 5 * version + 3 * layer) % num_experts for layer in range(layers)])
    return (starts[:, None] + torch.arange(top_k)[None, :]) % num_experts


@dataclass(frozen=True)
class RouteTable:
    """Low-entropy routes: the route of position ``p`` under weight version ``v`` is
    ``palette[(p // run + v·shift) mod len(palette)]``, its ids reversed at odd positions when
    ``reorder`` (the same set in another kernel order, DESIGN §3.3).

    One palette entry gives constant rows; two give runs of ``run`` equal rows. With ``shift = 0`` a
    weight update changes nothing, so the rows on both sides of every seam can be equal. Routes are
    nested tuples ``[layers][top_k]`` of distinct valid ids, so a table is hashable and prints whole.
    """

    palette: tuple[tuple[tuple[int, ...], ...], ...]
    run: int = 1
    shift: int = 0
    reorder: bool = False

    @property
    def layers(self) -> int:
        return len(self.palette[0])

    @property
    def top_k(self) -> int:
        return len(self.palette[0][0])

    def __call__(self, position: int, version: int) -> torch.Tensor:
        """The route ``[layers, top_k]`` of ``position`` under weights ``version``."""
        entry = torch.tensor(self.palette[(position // self.run + version * self.shift) % len(self.palette)])
        return entry.flip(-1) if self.reorder and position % 2 else entry

    def describe(self) -> str:
        reordered = ", odd rows reordered" if self.reorder else ""
        return (
            f"routes from a palette of {len(self.palette)} ({list(map(list, self.palette))}), runs of "
            f"{self.run}, shift {self.shift} per weight update{reordered}"
        )


class SimulatedEngine:
    """An engine call ``(context, max_new_tokens) -> Rollout`` whose rows are ``route(p, version)``.

    A call runs a forward when it generates or when the context grew since the last forward (tool
    tokens to prefill); its payload covers ``[0, context + generated − 1)`` under the current weight
    version. A call that runs none returns no payload, or with ``idle_payloads`` the rows of the
    context it prefilled before the abort (vLLM ≥ 0.22 returns the rows so far); either way a correct
    splice takes nothing from it. ``version_of_row`` records which version first computed each row:
    `expected` is the trace a correct splice builds. With a ``table`` its routes are the table's
    (low-entropy, rows repeat) and ``layers``/``top_k`` are the table's.
    """

    def __init__(
        self,
        prompt_len: int,
        *,
        layers: int = 2,
        top_k: int = 2,
        num_experts: int = 64,
        idle_payloads: bool = False,
        table: RouteTable | None = None,
    ) -> None:
        if table is not None:
            layers, top_k = table.layers, table.top_k
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.table = table
        self.idle_payloads = idle_payloads
        self.version = 0
        self.fed = prompt_len  # positions [0, fed) are in the context a forward has seen or skipped
        self.version_of_row: list[int] = []

    def update_weights(self, version: int) -> None:
        """The ``update_weights`` of `run_episode`: later rows are computed under ``version``."""
        self.version = version

    def __call__(self, context: Sequence[int], max_new_tokens: int) -> Rollout:
        length = len(context) + max_new_tokens
        ran_forward = max_new_tokens > 0 or len(context) > self.fed
        if ran_forward:  # rows first computed by this call carry its weight version
            self.version_of_row += [self.version] * (length - 1 - len(self.version_of_row))
            self.fed = length
        payload = self._rows(self.version, length - 1) if ran_forward or self.idle_payloads else None
        return Rollout(
            len(context),
            torch.zeros(max_new_tokens, dtype=torch.int64),
            torch.zeros(max_new_tokens, dtype=torch.float32),
            payload,
            0,
            "length",
        )

    @property
    def expected(self) -> torch.Tensor:
        """``[rows, layers, top_k]``: each row under the weights that first computed it (DESIGN §3.4)."""
        if not self.version_of_row:
            return self._rows(0, 0)
        return torch.stack([self.route_at(p, v) for p, v in enumerate(self.version_of_row)])

    def route_at(self, position: int, version: int) -> torch.Tensor:
        """The route ``[layers, top_k]`` this engine computes for ``position`` under weights ``version``."""
        if self.table is not None:
            return self.table(position, version)
        return route(position, version, self.layers, self.top_k, self.num_experts)

    def _rows(self, version: int, count: int) -> torch.Tensor:
        if count <= 0:
            return torch.zeros((0, self.layers, self.top_k), dtype=torch.long)
        return torch.stack([self.route_at(p, version) for p in range(count)])


def simulate(
    schedule: Schedule,
    *,
    layers: int = 2,
    top_k: int = 2,
    num_experts: int = 64,
    idle_payloads: bool = False,
    table: RouteTable | None = None,
) -> tuple[Episode[Rollout], SimulatedEngine]:
    """``schedule`` played through a fresh `SimulatedEngine`: the episode, and the engine (its oracle)."""
    engine = SimulatedEngine(
        schedule.prompt_len,
        layers=layers,
        top_k=top_k,
        num_experts=num_experts,
        idle_payloads=idle_payloads,
        table=table,
    )
    return run_episode(engine, schedule, update_weights=engine.update_weights), engine
