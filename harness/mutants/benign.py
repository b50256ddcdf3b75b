"""Benign variants: correct implementations that make a different, legitimate choice.

Each is the reference subject with one or two capabilities replaced by code that is right by the
specification (DESIGN §3) but not the reference's representation: another integer dtype, another
id order within a route, numpy instead of torch, another EP ownership scheme, another padding or
micro-batch packing, plain namespaces instead of modules. ``rrh mutants`` runs the suites of the
replaced capabilities against every one of them; any failure is a false alarm of the suites, and
fails the command as surely as a surviving mutant. ``--rr-subject harness.mutants.benign:<name>``
loads one.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from harness.conventions import decode_payload
from harness.mutants import changed_capabilities, patched_module
from harness.mutants.conventions import rebuilt
from harness.mutants.drivers import ConstructorPatchDriver
from harness.mutants.replay import ReplayForwardThroughBackward
from harness.subjects import Subject
from harness.subjects.capabilities import LayoutsCapability, members
from harness.subjects.reference import REFERENCE
from harness.trace import RoutingTrace
from harness.trainers.megatron.subject import HarnessMegatronDriver
from reference_impl import MoELM, layouts, splice, training
from reference_impl.layouts import LayoutError, MicroBatchPlan, Placed


@dataclass(frozen=True)
class Benign:
    """A correct subject that chooses differently from the reference.

    Attributes:
        name: short id; ``--rr-subject harness.mutants.benign:<name>`` selects it.
        choice: the legitimate choice it makes, and who makes it in the wild.
        subject: the reference with the capabilities that make that choice replaced.
    """

    name: str
    choice: str
    subject: Subject
    own_process: bool = False
    """Run in a process of its own: it ships a driver without ``unpatch()``, which would refuse every
    later patching driver of the process that runs it (``harness.subjects.replay``)."""

    @property
    def capabilities(self) -> tuple[str, ...]:
        """The capabilities that differ from the reference (at least one)."""
        changed = tuple(changed_capabilities(self.subject))
        if not changed:
            raise AssertionError(f"benign variant {self.name} replaces no capability")
        return changed

    @property
    def subject_spec(self) -> str:
        """The ``--rr-subject`` spec that loads this variant."""
        return f"harness.mutants.benign:{self.name}"


def _variant(name: str, **capabilities: Any) -> Subject:
    return replace(REFERENCE, name=f"benign:{name}", **capabilities)


# --- truncate --------------------------------------------------------------------------------------


def truncate_to_int32(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct cut, routes handed back as int32 (any integer dtype that holds the ids is right)."""
    cut_tokens, cut_routes = splice.truncate(tokens, routes, prompt_len, max_response_len)
    return cut_tokens, cut_routes.to(torch.int32)


def truncate_dedup_by_position(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of ``truncation-collapses-repeated-rows``: ``unique_consecutive`` over rows keyed by
    their position (a resume's re-sent overlap row has its position twice, equal routes at two
    positions do not), so nothing real is collapsed; the last kept token's real row is kept."""
    splice.truncate(tokens, routes, prompt_len, max_response_len)  # same input checks
    keep = min(tokens.shape[0], prompt_len + max_response_len)
    flat = torch.as_tensor(routes).flatten(1).long()
    keyed = torch.cat([torch.arange(flat.shape[0]).unsqueeze(1), flat], dim=1)
    unique = torch.unique_consecutive(keyed, dim=0)[:, 1:].reshape(-1, *routes.shape[1:])
    return tokens[:keep], unique[:keep].to(routes.dtype)


def truncate_keeping_last_kept_row(
    tokens: torch.Tensor, routes: torch.Tensor, prompt_len: int, max_response_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Cut to ``P + R′`` tokens and keep ``P + R′`` rows when something was cut: the last kept token was
    forwarded (a later token was sampled from it), so its row is a real route (DESIGN §3.1). numpy out."""
    keep = min(tokens.shape[0], prompt_len + max_response_len)
    splice.truncate(tokens, routes, prompt_len, max_response_len)  # same input checks
    rows = keep if keep < tokens.shape[0] else keep - 1
    return tokens[:keep].numpy(), routes[:rows].numpy()


# --- splice ----------------------------------------------------------------------------------------


def splice_to_numpy(prompt_len: int, attempts: Sequence[splice.Attempt]) -> np.ndarray:
    """The correct splice, returned as a numpy int32 array with each route's ids sorted."""
    return np.sort(splice.splice(prompt_len, attempts).numpy().astype(np.int32), axis=-1)


def splice_payload_tails(prompt_len: int, attempts: Sequence[splice.Attempt]) -> torch.Tensor:
    """The twin of ``seam-found-by-content``: each later attempt's rows are the last ``new_tokens``
    rows of its payload (the rows before them are the context it re-prefilled), found by the
    payload's length, never by content (verl's ``FullyAsyncLLMServerClient`` with its ``[-0:]``
    guard); the first contributing attempt's payload whole. Bad input: the reference's checks."""
    checked = splice.splice(prompt_len, attempts)  # same input checks; the answer when nothing was fed
    rows: list[torch.Tensor] = []
    for attempt in attempts:
        if not attempt.new_tokens or attempt.routes is None:
            continue
        payload = torch.as_tensor(attempt.routes)
        rows.append(payload[-attempt.new_tokens :] if rows else payload)
    return torch.cat(rows) if rows else checked


def splice_into_buffer(prompt_len: int, attempts: Sequence[splice.Attempt]) -> torch.Tensor | None:
    """The correct splice written as a buffer fill: allocate ``P + Σa − 1`` rows, then copy each
    contributing attempt's own new positions from the same rows of its payload, by index. It never
    compares rows, so rows that repeat across a seam stay where they are (the twin of the
    ``repeated-row-at-seam`` mutant). ``None`` when no position was fed; its own ValueErrors."""
    if prompt_len < 1 or any(a.new_tokens < 0 for a in attempts):
        raise ValueError(
            f"bad schedule: prompt of {prompt_len}, new tokens {[a.new_tokens for a in attempts]}"
        )
    rows = prompt_len + sum(a.new_tokens for a in attempts) - 1
    buffer: torch.Tensor | None = None
    filled, context_len = 0, prompt_len
    for attempt in attempts:
        context_len += attempt.new_tokens
        if not attempt.new_tokens:
            continue
        payload = attempt.routes
        if payload is None or payload.dim() != 3 or payload.shape[0] != context_len - 1:
            shape = None if payload is None else tuple(payload.shape)
            raise ValueError(f"payload {shape} cannot fill positions [{filled}, {context_len - 1})")
        if buffer is None:
            buffer = payload.new_zeros((rows, *payload.shape[1:]))
        buffer[filled : context_len - 1] = payload[filled : context_len - 1]
        filled = context_len - 1
    if buffer is None and rows:
        raise ValueError(f"no attempt added a token: nobody owns the {rows} prompt rows")
    return buffer


# --- decode_payload ---------------------------------------------------------------------------------


def decode_sorted_ids(*args: Any, **kwargs: Any) -> RoutingTrace:
    """The correct decoding with each route's ids sorted (kernels order top-k as they like, §3.3)."""
    trace = decode_payload(*args, **kwargs)
    return rebuilt(trace, np.sort(trace.experts, axis=-1))


def decode_to_moe_ordinal(*args: Any, **kwargs: Any) -> RoutingTrace:
    """The correct decoding, always on the MoE-ordinal layer axis (vLLM 0.21's, Megatron R2's)."""
    return decode_payload(*args, **kwargs).to_moe_ordinal()


# --- layouts ---------------------------------------------------------------------------------------


def ep_local_ids_round_robin(
    ids: torch.Tensor, num_experts: int, ep: int, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-robin expert ownership: expert e lives on rank e mod ep as local id e // ep."""
    _ = layouts.ep_local_ids(ids, num_experts, ep, rank)  # same input checks
    ids = ids.long()
    owned = ids % ep == rank
    return torch.where(owned, ids // ep, torch.full_like(ids, -1)), owned


def ep_global_ids_round_robin(local_ids: torch.Tensor, num_experts: int, ep: int, rank: int) -> torch.Tensor:
    """Inverse of :func:`ep_local_ids_round_robin` on rank ``rank``."""
    _ = layouts.ep_global_ids(local_ids, num_experts, ep, rank)  # same input checks
    return local_ids.long() * ep + rank


def place_prompt_left_response_right(
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    width: int,
    prompt_lens: Sequence[int] | None = None,
) -> Placed:
    """Given prompt lengths, prompts left-padded to the longest prompt and responses right-padded after
    it (verl's older ``prompts ⊕ responses`` batch); every row stays at its token's column."""
    placed = layouts.place_left_padded(samples, width, prompt_lens)
    if prompt_lens is None:
        return placed
    prompt_width = max(prompt_lens)
    needed = prompt_width + max(t.shape[0] - p for (t, _), p in zip(samples, prompt_lens, strict=True))
    if needed > width:
        raise LayoutError(f"width {width}: prompts left-padded to {prompt_width} and responses need {needed}")
    shifts = [width - t.shape[0] - (prompt_width - p) for (t, _), p in zip(samples, prompt_lens, strict=True)]

    def moved(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.roll(row, -shift, dims=0) for row, shift in zip(x, shifts, strict=True)])

    assert placed.response_mask is not None
    return Placed(
        moved(placed.tokens),
        moved(placed.attention_mask),
        moved(placed.routes),
        moved(placed.replay_mask),
        moved(placed.response_mask),
    )


def plan_micro_batches_first_fit(seq_lens: Sequence[int], max_tokens_per_micro_batch: int) -> MicroBatchPlan:
    """Samples packed in order, a new micro-batch whenever the budget would overflow; each group
    listed longest first (no balancing: a simpler trainer's packing)."""
    layouts.plan_micro_batches(seq_lens, max_tokens_per_micro_batch)  # same input checks
    groups: list[list[int]] = [[]]
    load = 0
    for index, length in enumerate(seq_lens):
        if groups[-1] and load + length > max_tokens_per_micro_batch:
            groups.append([])
            load = 0
        groups[-1].append(index)
        load += length
    groups = [sorted(group, key=lambda i: (-seq_lens[i], i)) for group in groups]
    order = torch.tensor([i for group in groups for i in group], dtype=torch.long)
    return MicroBatchPlan(groups, order, torch.argsort(order))


# --- training --------------------------------------------------------------------------------------


def replay_targets_int32_sorted(
    placed: Placed, moe_layers: Sequence[int], layer_axis: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct targets as int32 with each route's ids sorted, the mask as uint8."""
    targets, mask = training.replay_targets(placed, moe_layers, layer_axis)
    return targets.to(torch.int32).sort(-1).values, mask.to(torch.uint8)


def reference_logprobs_on_a_copy(model_ref: MoELM, placed: Placed) -> torch.Tensor:
    """π_ref from a frozen copy of the model whose routers were reset to native routing."""
    frozen = copy.deepcopy(model_ref)
    frozen.clear_replay()
    frozen.set_routing_mode(training.RoutingMode.NATIVE)
    with torch.no_grad():
        return training.token_logprobs(frozen, placed.tokens, placed.attention_mask)


# --- errors in a framework's own words ------------------------------------------------------------------


def in_own_words(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` refusing bad input with a framework's own terse wording (the offending field unnamed)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ValueError:
            raise ValueError(f"{fn.__name__}: arguments do not describe a valid batch") from None

    return call


LAYOUTS_IN_OWN_WORDS = patched_module(
    layouts, **{name: in_own_words(getattr(layouts, name)) for name in members(LayoutsCapability)}
)


# --- replay drivers ----------------------------------------------------------------------------------


class OneForwardInFlightThroughBackward(ReplayForwardThroughBackward):
    """REPLAY_FORWARD left on through backward, under a declared one-forward-in-flight contract (each
    micro-batch's backward runs before the next forward, as in verl's VeOmni engine): the recompute
    then replays the one forward's own targets, which is right."""

    forwards_in_flight = 1


def one_forward_in_flight(model: MoELM) -> OneForwardInFlightThroughBackward:
    return OneForwardInFlightThroughBackward(model)


class LogsReplayedWeightsDriver(HarnessMegatronDriver):
    """The twin of ``megatron-replay-drops-scaling-factor``: a forward hook on every ``TopKRouter``
    that, under replay, keeps a copy of the gate weights for its own logging and hands Megatron-core's
    weights on untouched (scaling factor and all), as a framework that wraps the replayed routing."""

    def install(self, model: Sequence[torch.nn.Module], config: Any) -> Any:
        from megatron.core.transformer.moe.router import TopKRouter

        from harness.mutants.megatron import replaying

        self.logged: list[torch.Tensor] = []

        def log(module: Any, args: Any, output: Any) -> Any:
            probs, routing_map = output
            if replaying(module):
                self.logged = [*self.logged[-7:], probs.detach().clone()]
            return probs, routing_map

        for chunk in model:
            for m in chunk.modules():
                if isinstance(m, TopKRouter):
                    m.register_forward_hook(log)
        return super().install(model, config)


class HooksWithoutUnpatch:
    """A transformers driver whose ``patch()`` sets a process-wide default and cannot be undone (no
    ``unpatch()``), as a framework that imports its patches for good."""

    patched = False

    def patch(self) -> None:
        type(self).patched = True

    def install(self, model: torch.nn.Module) -> Any:
        return REFERENCE.install_hf_replay(model)  # type: ignore[misc]


def bare_install_replay(model: MoELM) -> Any:
    """A bare ``model -> controller`` callable: a driver with nothing to patch."""
    return REFERENCE.install_replay(model)  # type: ignore[misc]


def _namespace(module: Any) -> SimpleNamespace:
    """Every public name of ``module`` in a plain (unhashable) namespace."""
    return SimpleNamespace(**{n: getattr(module, n) for n in dir(module) if not n.startswith("_")})


BENIGN: tuple[Benign, ...] = (
    Benign(
        "truncate-int32",
        "routes handed back as int32: any integer dtype that holds every id is correct",
        _variant("truncate-int32", truncate=truncate_to_int32),
    ),
    Benign(
        "truncate-dedup-by-position",
        "collapses consecutive rows keyed by position with unique_consecutive (a re-sent overlap row, "
        "never an equal route at another position), keeping the last kept token's real row",
        _variant("truncate-dedup-by-position", truncate=truncate_dedup_by_position),
    ),
    Benign(
        "truncate-keeps-last-kept-row",
        "after cutting to R′ tokens, keeps the last kept token's real row (P + R′ rows, §3.1), numpy out",
        _variant("truncate-keeps-last-kept-row", truncate=truncate_keeping_last_kept_row),
    ),
    Benign(
        "splice-numpy-sorted",
        "the splice as a numpy int32 array, each route's ids sorted",
        _variant("splice-numpy-sorted", splice=splice_to_numpy),
    ),
    Benign(
        "splice-payload-tails",
        "each later attempt's rows are the last new_tokens rows of its payload (verl's resume splice, "
        "with its [-0:] guard): the seam from the payload's length, never from its content",
        _variant("splice-payload-tails", splice=splice_payload_tails),
    ),
    Benign(
        "splice-into-buffer",
        "the splice as a preallocated buffer filled by position from each attempt's payload, never "
        "comparing rows (equal rows across a seam stay put)",
        _variant("splice-into-buffer", splice=splice_into_buffer),
    ),
    Benign(
        "decode-sorted-ids",
        "each decoded route's ids sorted (kernels order top-k differently; routes compare as sets)",
        _variant("decode-sorted-ids", decode_payload=decode_sorted_ids),
    ),
    Benign(
        "decode-moe-ordinal",
        "decoded traces kept on the MoE-ordinal layer axis (vLLM 0.21, Megatron R2 recordings)",
        _variant("decode-moe-ordinal", decode_payload=decode_to_moe_ordinal),
    ),
    Benign(
        "ep-round-robin",
        "experts owned round-robin over EP ranks (e on rank e mod ep); it declares no Megatron convention",
        _variant(
            "ep-round-robin",
            layouts=patched_module(
                layouts,
                ep_local_ids=ep_local_ids_round_robin,
                ep_global_ids=ep_global_ids_round_robin,
                EP_OWNERSHIP="round_robin",
            ),
        ),
    ),
    Benign(
        "prompt-left-response-right",
        "prompts left-padded and responses right-padded when prompt lengths are given (verl's older layout)",
        _variant(
            "prompt-left-response-right",
            layouts=patched_module(layouts, place_left_padded=place_prompt_left_response_right),
        ),
    ),
    Benign(
        "micro-batches-first-fit",
        "micro-batches packed first-fit in sample order, each listed longest first (no balancing)",
        _variant(
            "micro-batches-first-fit",
            layouts=patched_module(layouts, plan_micro_batches=plan_micro_batches_first_fit),
        ),
    ),
    Benign(
        "replay-targets-int32-sorted",
        "replay targets as int32 with sorted ids, the mask as uint8",
        _variant(
            "replay-targets-int32-sorted",
            training=patched_module(training, replay_targets=replay_targets_int32_sorted),
        ),
    ),
    Benign(
        "reference-pass-on-a-copy",
        "π_ref computed on a frozen deep copy of the model reset to native routing",
        _variant(
            "reference-pass-on-a-copy",
            training=patched_module(training, reference_logprobs=reference_logprobs_on_a_copy),
        ),
    ),
    Benign(
        "errors-in-own-words",
        "splice, truncate and layouts refuse bad input with their own ValueError wording, naming no field "
        "(the reference's wording is its own tests' business)",
        _variant(
            "errors-in-own-words",
            splice=in_own_words(splice.splice),
            truncate=in_own_words(splice.truncate),
            layouts=LAYOUTS_IN_OWN_WORDS,
        ),
    ),
    Benign(
        "constructor-patch-driver",
        "replay through a patched Router.__init__ and a process-global registry (verl's "
        "apply_router_replay_patch shape), per-model controllers in layer order; models built before the "
        "patch are refused loudly",
        _variant("constructor-patch-driver", install_replay=ConstructorPatchDriver()),
    ),
    Benign(
        "constructor-patch-driver-by-tag",
        "the constructor-patch driver knowing its routers by a flag its patched constructor sets on each "
        "(deep copies keep it), refusing an unflagged router loudly",
        _variant("constructor-patch-driver-by-tag", install_replay=ConstructorPatchDriver(by_tag=True)),
    ),
    Benign(
        "one-forward-in-flight",
        "declares one forward in flight (OneForwardInFlight) and keeps REPLAY_FORWARD through backward: "
        "the recompute replays the one forward's own targets",
        _variant("one-forward-in-flight", install_replay=one_forward_in_flight),
    ),
    Benign(
        "un-undoable-driver-beside-a-bare-callable",
        "a transformers driver without unpatch() and a bare model -> controller callable for the "
        "reference model, in one subject (the bare callable patches nothing, so nothing conflicts)",
        _variant(
            "un-undoable-driver-beside-a-bare-callable",
            install_replay=bare_install_replay,
            install_hf_replay=HooksWithoutUnpatch(),
        ),
        own_process=True,
    ),
    Benign(
        "un-undoable-driver-beside-megatron",
        "a transformers driver without unpatch() beside Megatron-core's own replay (a driver of its own, "
        "which patches nothing): the Megatron kind of the replay suite must not be refused for a patch it "
        "never made",
        _variant(
            "un-undoable-driver-beside-megatron",
            install_hf_replay=HooksWithoutUnpatch(),
            install_megatron_replay=HarnessMegatronDriver(),
        ),
        own_process=True,
    ),
    Benign(
        "megatron-logs-replayed-weights",
        "a forward hook on Megatron-core's routers that copies the replayed gate weights for its own "
        "logging and hands them on unchanged (a framework wrapping the replayed routing)",
        _variant("megatron-logs-replayed-weights", install_megatron_replay=LogsReplayedWeightsDriver()),
    ),
    Benign(
        "namespace-capabilities",
        "layouts and training given as plain SimpleNamespace objects (unhashable), not modules",
        _variant("namespace-capabilities", layouts=_namespace(layouts), training=_namespace(training)),
    ),
)

_BY_NAME = {b.name: b for b in BENIGN}


def get(name: str) -> Benign:
    """The benign variant called ``name``; ``KeyError`` lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no benign variant {name!r}; known: {', '.join(_BY_NAME)}") from None


def __getattr__(name: str) -> Subject:
    """``benign.<name>`` is that variant's subject (names hold dashes: use getattr)."""
    if name in _BY_NAME:
        return _BY_NAME[name].subject
    raise AttributeError(name)
