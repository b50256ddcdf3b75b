"""Hypothesis strategies for routing traces, lengths and malformed input.

They reach the boundaries on purpose, not by luck: 0-length responses, a single row, 256 and 257
experts (the uint8/uint16 edge), 65536 experts, ``top_k = 1`` and ``top_k = num_experts``,
dense-first layers, ids at 0 and ``num_experts − 1``, both layer-axis conventions, and rows that
repeat (``route_tables``: top-1, one or two experts, constant rows), which random ids never give.

Routes are drawn from a numpy generator seeded by hypothesis, so a trace of thousands of rows costs
one draw; the boundary values (extreme ids, which rows hold them) are explicit draws so they shrink.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st

from harness.schedules import RouteTable
from harness.trace import MAX_EXPERTS, LayerAxis, RoutingTrace
from reference_impl.config import layer_width, moe_slots
from reference_impl.episode import AttemptPlan, Schedule

BOUNDARY_EXPERTS = (1, 2, 8, 64, 255, 256, 257, 384, 65535, MAX_EXPERTS)


@dataclass(frozen=True)
class TraceSpec:
    """The shape and metadata of a trace, without its ids."""

    rows: int
    num_experts: int
    top_k: int
    num_layers: int
    moe_layers: tuple[int, ...]
    layer_axis: LayerAxis = LayerAxis.DECODER
    start: int = 0

    @property
    def width(self) -> int:
        """Slots on the layer axis."""
        return layer_width(self.layer_axis, self.num_layers, self.moe_layers)

    @property
    def moe_slots(self) -> tuple[int, ...]:
        """Indices along the layer axis that hold MoE routes."""
        return moe_slots(self.layer_axis, self.moe_layers)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``RoutingTrace`` for this spec."""
        return {
            "num_experts": self.num_experts,
            "moe_layers": self.moe_layers,
            "num_layers": self.num_layers,
            "layer_axis": self.layer_axis,
            "start": self.start,
        }


def num_experts(max_value: int = MAX_EXPERTS) -> st.SearchStrategy[int]:
    """Expert counts, with the uint8/uint16 edges and the extremes drawn often."""
    edges = [e for e in BOUNDARY_EXPERTS if e <= max_value]
    return st.one_of(st.sampled_from(edges), st.integers(1, max_value))


@st.composite
def top_k_for(draw: st.DrawFn, experts: int, max_k: int = 9) -> int:
    """A top_k for ``experts``: 1, ``experts`` itself when small, or anything between."""
    high = min(experts, max_k)
    return draw(st.one_of(st.just(1), st.just(high), st.integers(1, high)))


@st.composite
def trace_specs(
    draw: st.DrawFn, max_rows: int = 40, max_layers: int = 6, max_experts: int = MAX_EXPERTS
) -> TraceSpec:
    """Trace shapes: 0 or 1 rows, dense-first layers, either layer axis, a skipped prefix."""
    experts = draw(num_experts(max_experts))
    k = draw(top_k_for(experts))
    layers = draw(st.integers(1, max_layers))
    first_dense = draw(st.one_of(st.just(0), st.integers(0, layers - 1)))
    moe = tuple(range(first_dense, layers))
    axis = draw(st.sampled_from(LayerAxis))
    rows = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_rows)))
    start = draw(st.one_of(st.just(0), st.integers(0, 8)))
    return TraceSpec(rows, experts, k, layers, moe, axis, start)


def _routes_for(spec: TraceSpec, seed: int, extremes: bool) -> npt.NDArray[np.int64]:
    """Valid routes for ``spec``: distinct ids per MoE route, dense slots 0, optionally with 0 and E−1."""
    rng = np.random.default_rng(seed)
    e, k = spec.num_experts, spec.top_k
    routes = np.zeros((spec.rows, spec.width, k), dtype=np.int64)
    slots = list(spec.moe_slots)
    if spec.rows == 0 or not slots:
        return routes
    offsets = rng.choice(e, size=k, replace=False)  # a distinct pattern, shifted per route
    base = rng.integers(0, e, size=(spec.rows, len(slots), 1))
    moe = (base + offsets) % e
    if extremes:  # put the largest and the smallest id where the narrowest dtype is tested
        moe[0, 0] = (np.arange(k) + (e - 1)) % e
    routes[:, slots, :] = rng.permuted(moe, axis=-1)
    return routes


@st.composite
def valid_routes(draw: st.DrawFn, spec: TraceSpec) -> npt.NDArray[np.int64]:
    """An int64 array of valid routes for ``spec``."""
    return _routes_for(spec, draw(st.integers(0, 2**32 - 1)), draw(st.booleans()))


@st.composite
def traces(draw: st.DrawFn, **spec_bounds: int) -> RoutingTrace:
    """Valid ``RoutingTrace`` objects over the whole boundary space of ``trace_specs``."""
    spec = draw(trace_specs(**spec_bounds))
    return RoutingTrace(draw(valid_routes(spec)), **spec.kwargs())


@st.composite
def sample_lengths(draw: st.DrawFn, max_prompt: int = 64, max_response: int = 64) -> tuple[int, int]:
    """``(prompt_len, response_len)``: prompts of at least one token, responses from 0 tokens up."""
    prompt = draw(st.one_of(st.just(1), st.integers(1, max_prompt)))
    response = draw(st.one_of(st.sampled_from([0, 1]), st.integers(0, max_response)))
    return prompt, response


@dataclass(frozen=True)
class Malformed:
    """Input that ``RoutingTrace`` must reject, and the field its message must name."""

    kind: str
    experts: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    field_name: str = "experts"


_MALFORMATIONS = (
    "repeated_id",
    "all_zero_route",
    "id_too_large",
    "negative_id",
    "float_dtype",
    "bool_dtype",
    "wrong_ndim",
    "ragged_lists",
    "wrong_layer_width",
    "bad_num_experts",
    "top_k_above_experts",
    "bad_moe_layers",
    "negative_start",
    "bad_layer_axis",
)


@st.composite
def malformed_traces(draw: st.DrawFn) -> Malformed:
    """One malformation of an otherwise valid trace, at a drawn position and layer."""
    kind = draw(st.sampled_from(_MALFORMATIONS))
    spec = draw(trace_specs(max_rows=12, max_layers=4, max_experts=600))
    spec = replace(spec, rows=max(spec.rows, 1))  # every malformation needs a row to live in
    if kind in ("repeated_id", "all_zero_route"):  # and these a MoE route with two lanes
        spec = replace(spec, num_experts=max(spec.num_experts, 2), top_k=max(spec.top_k, 2))
    routes = draw(valid_routes(spec))
    kwargs = spec.kwargs()
    row = draw(st.integers(0, max(spec.rows - 1, 0)))
    slot = draw(st.sampled_from(spec.moe_slots))
    lane = draw(st.integers(0, spec.top_k - 1))
    if kind == "repeated_id":
        other = (lane + draw(st.integers(1, spec.top_k - 1))) % spec.top_k
        routes[row, slot, other] = routes[row, slot, lane]
    elif kind == "all_zero_route":
        routes[row, slot, :] = 0
    elif kind == "id_too_large":
        routes[row, draw(st.integers(0, spec.width - 1)), lane] = spec.num_experts + draw(
            st.sampled_from([0, 1, 255, 65535, 2**31])
        )
    elif kind == "negative_id":
        routes[row, draw(st.integers(0, spec.width - 1)), lane] = -draw(st.integers(1, 2**31))
    elif kind == "float_dtype":
        return Malformed(
            kind, routes.astype(draw(st.sampled_from([np.float16, np.float32, np.float64]))), kwargs
        )
    elif kind == "bool_dtype":
        return Malformed(kind, routes > 0, kwargs)
    elif kind == "wrong_ndim":
        shape = draw(
            st.sampled_from([(routes.size,), (spec.rows, spec.width * spec.top_k), (1, *routes.shape)])
        )
        return Malformed(kind, routes.reshape(shape), kwargs)
    elif kind == "ragged_lists":
        nested = [*routes.tolist(), [[0] * (spec.top_k + 1)] * spec.width]
        return Malformed(kind, nested, kwargs)
    elif kind == "wrong_layer_width":
        extra = np.zeros((spec.rows, 1, spec.top_k), dtype=routes.dtype)
        return Malformed(kind, np.concatenate([routes, extra], axis=1), kwargs)
    elif kind == "bad_num_experts":
        kwargs["num_experts"] = draw(st.sampled_from([0, -1, MAX_EXPERTS + 1, 2**40, 2.5, True, "8"]))
        return Malformed(kind, routes, kwargs, "num_experts")
    elif kind == "top_k_above_experts":
        kwargs["num_experts"] = draw(st.integers(1, 3))
        wide = np.tile(np.arange(4), (spec.rows, spec.width, 1))
        return Malformed(kind, wide, kwargs, "top_k")
    elif kind == "bad_moe_layers":
        kwargs["moe_layers"] = draw(st.sampled_from([(spec.num_layers,), (-1,), (0, 0), (1, 0)]))
        kwargs["layer_axis"] = LayerAxis.DECODER
        return Malformed(
            kind,
            routes
            if spec.layer_axis is LayerAxis.DECODER
            else np.zeros((spec.rows, spec.num_layers, spec.top_k), dtype=np.int64),
            kwargs,
            "moe_layers",
        )
    elif kind == "negative_start":
        kwargs["start"] = draw(st.sampled_from([-1, -100, 1.5, None]))
        return Malformed(kind, routes, kwargs, "start")
    elif kind == "bad_layer_axis":
        kwargs["layer_axis"] = draw(st.sampled_from(["decoder_index", "moe", "", 3]))
        return Malformed(kind, routes, kwargs, "layer_axis")
    return Malformed(kind, routes, kwargs)


@st.composite
def attempt_schedules(
    draw: st.DrawFn, max_attempts: int = 5, max_prompt: int = 12, max_tokens: int = 6
) -> Schedule:
    """Schedules of partial rollouts and turns with at least one new token in all.

    Reaches on purpose: attempts with 0 new tokens (the ``[-0:]`` slice), a first attempt aborted
    before any forward, tool tokens between turns, weight updates between attempts, and a last
    attempt cut by the length budget. Each later attempt is drawn as a resume (the call before it
    was aborted; no tool tokens) or a new turn (the call before it stopped; tool tokens first), so
    ``Schedule.kind`` labels every attempt for what it is. Prompt and tool token ids are
    ``1, 2, …``: the splice depends on how many there are, never on which.
    """
    prompt = draw(st.one_of(st.just(1), st.integers(1, max_prompt)))
    count = draw(st.integers(1, max_attempts))
    turns = [False] + [draw(st.booleans()) for _ in range(count - 1)]
    plans = []
    for j in range(count):
        last = j == count - 1
        tool = draw(st.one_of(st.just(0), st.integers(0, max_tokens))) if turns[j] else 0
        plans.append(
            AttemptPlan(
                max_new_tokens=draw(st.one_of(st.just(0), st.integers(0, max_tokens))),
                tool_tokens=tuple(range(1, tool + 1)),
                update_weights=j > 0 and draw(st.booleans()),
                finish_reason=(
                    draw(st.sampled_from(("stop", "length"))) if last else "stop" if turns[j + 1] else "abort"
                ),
            )
        )
    if not any(plan.max_new_tokens or plan.tool_tokens for plan in plans):
        plans[-1] = replace(plans[-1], max_new_tokens=1)
    return Schedule(tuple(range(1, prompt + 1)), tuple(plans))


@st.composite
def route_tables(draw: st.DrawFn, max_layers: int = 2) -> RouteTable:
    """Low-entropy routes for the simulated engine, where rows repeat: half the tables are degenerate
    (two or three experts, top-1 or every expert, a palette of one or two routes: constant rows, runs
    of equal rows), half cycle through three to five distinct routes that each weight update moves
    by one (:func:`cycling_route_tables`). Both may give the same set in another id order.

    Random routes over many experts never put two equal rows across a seam; these do, so a splice
    that treats an equal row as a duplicate, or finds rows by content, loses or moves them. Top-1
    routes avoid expert 0, so no row is an all-zero route (DESIGN §3.2).
    """
    return draw(st.one_of(degenerate_route_tables(max_layers), cycling_route_tables(max_layers)))


@st.composite
def degenerate_route_tables(draw: st.DrawFn, max_layers: int = 2) -> RouteTable:
    """Two or three experts, top-1 or every expert, a palette of one or two routes (constant rows, or
    runs of equal rows), weight updates that change nothing or move the palette: nearly every row
    equals its neighbours, across every seam."""
    experts = draw(st.sampled_from((2, 3)))
    top_k = draw(st.sampled_from((1, experts)))
    layers = draw(st.integers(1, max_layers))

    def one_route() -> tuple[int, ...]:
        if top_k == 1:
            return (draw(st.integers(1, experts - 1)),)
        return tuple(draw(st.permutations(range(experts))))

    def entry() -> tuple[tuple[int, ...], ...]:
        return tuple(one_route() for _ in range(layers))

    palette = tuple(entry() for _ in range(draw(st.integers(1, 2))))
    return RouteTable(palette, draw(st.integers(1, 4)), draw(st.sampled_from((0, 1))), draw(st.booleans()))


@st.composite
def cycling_route_tables(draw: st.DrawFn, max_layers: int = 2) -> RouteTable:
    """Three to twenty-four distinct routes in turn (top-1 of up to 25 experts, or top-2 of 8), runs of
    one or two, each weight update moving the palette by one entry (usually) or not at all.

    The rows before and after a seam repeat, moved: the route of the last row an attempt kept
    reappears in the next attempt's payload one position away when the weights changed, and nowhere
    else when the palette is longer than the payload. A splice that finds the seam by looking for
    that row's content — even only when it occurs once — puts the new rows at the wrong position;
    degenerate tables (every row equal, so no content is unique) and the simulated engine's own
    routes (distinct for every position and weight version) both hide that.
    """
    top_k = draw(st.sampled_from((1, 2)))
    size = draw(st.one_of(st.integers(3, 5), st.integers(16, 24)))
    layers = draw(st.integers(1, max_layers))
    sets: list[tuple[int, ...]]
    if top_k == 1:
        sets = [(e,) for e in range(1, size + 1)]
    else:
        sets = list(itertools.combinations(range(8), 2))
    firsts = draw(st.permutations(sets))[:size]

    def route(ids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(reversed(ids)) if draw(st.booleans()) else ids

    palette = tuple(
        (route(first), *(route(draw(st.sampled_from(sets))) for _ in range(layers - 1))) for first in firsts
    )
    shift = draw(st.sampled_from((1, 1, 1, 0)))
    return RouteTable(palette, draw(st.integers(1, 2)), shift, draw(st.booleans()))


@dataclass(frozen=True)
class EnginePayload:
    """One sample's routed experts as an engine returns them, and the routes they must decode to."""

    engine: str
    version: str
    payload: Any
    model: Any  # harness.conventions.ModelSpec
    prompt_len: int
    response_len: int
    start: int
    routes: npt.NDArray[np.int64]  # decoder axis, dense slots 0, rows [start, P + R − 1)
    form: str  # which wire form was built, for failure messages

    def describe(self) -> str:
        return (
            f"{self.engine} {self.version} ({self.form}): prompt {self.prompt_len}, response "
            f"{self.response_len}, start {self.start}, "
            f"{self.model.num_experts} experts top-{self.model.top_k}"
        )


# A few released versions per convention, the range edges among them.
_VERSIONS = {
    "vllm-0.14": ("0.14.0", "0.15.1"),
    "vllm-0.16": ("0.16.0", "0.18.0", "0.20.2"),
    "vllm-0.21": ("0.21.0",),
    "vllm-0.22": ("0.22.0", "0.24.1", "0.26.3"),
    "vllm-0.27": ("0.27.1", "0.30.0"),
    "vllm-0.31": ("0.31.0", "0.33.0"),
    "sglang": ("0.5.0", "0.5.4"),
}


@st.composite
def engine_payloads(draw: st.DrawFn, max_experts: int = 600) -> EnginePayload:
    """Real payloads of every convention, built the way each engine builds its bytes."""
    from harness import conventions as conv

    convention = draw(st.sampled_from(conv.CONVENTIONS))
    version = draw(st.sampled_from(_VERSIONS[convention.name]))
    prompt, response = draw(sample_lengths(max_prompt=12, max_response=12))
    start = draw(st.integers(0, prompt + response - 1)) if convention.start_param else 0
    experts = draw(num_experts(max_experts))
    layers = draw(st.integers(1, 4))
    moe = tuple(range(draw(st.integers(0, layers - 1)), layers))
    spec = TraceSpec(
        prompt + response - 1 - start, experts, draw(top_k_for(experts)), layers, moe, start=start
    )
    routes = draw(valid_routes(spec))
    model = conv.ModelSpec(layers, experts, spec.top_k, moe)
    emitted = convention.emitted_dtype(model)
    if convention.form.name == "split":
        ordinal = routes[:, list(moe), :].astype(emitted)
        http = draw(st.booleans())
        halves = [ordinal[:prompt], ordinal[prompt:]]
        payload: Any = tuple(h.tolist() if http else h for h in halves)
        form = "nested lists (HTTP)" if http else "int16 ndarrays"
    elif convention.form.name == "npy" and draw(st.booleans()):
        payload, form = conv.encode_vllm_npy_b64(routes.astype(emitted)), "base64 .npy (HTTP)"
    elif convention.form.name == "sglang":
        payload, form = conv.encode_sglang_b64(routes), "base64 int32"
    else:
        payload, form = routes.astype(emitted), f"{emitted} ndarray"
    return EnginePayload(convention.engine, version, payload, model, prompt, response, start, routes, form)
