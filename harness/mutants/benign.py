"""Benign variants: correct implementations that make a different, legitimate choice.

Each is the reference subject with one or two capabilities replaced by code that is right by the
specification (DESIGN §3) but not the reference's representation: another integer dtype, another
id order within a route, numpy instead of torch, another EP ownership scheme, another padding or
micro-batch packing, plain namespaces instead of modules. ``rrh mutants`` runs the suites of the
replaced capabilities against every one of them; any failure is a false alarm of the suites, and
fails the command as surely as a surviving mutant. ``--rr-subject harness.mutants.benign:<name>``
loads one.

This module is their registry, in the order ``rrh mutants`` runs them; the code that makes each
choice lives in ``harness.mutants.benign_functions`` (the pure functions) and
``harness.mutants.benign_drivers`` (the replay drivers).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace
from typing import Any

from harness.conventions import decode_payload
from harness.mutants import changed_capabilities, patched_module
from harness.mutants.benign_drivers import (
    HooksWithoutUnpatch,
    LogsReplayedWeightsDriver,
    bare_install_replay,
    one_forward_in_flight,
)
from harness.mutants.benign_functions import (
    LAYOUTS_IN_OWN_WORDS,
    decode_sorted_ids,
    decode_to_moe_ordinal,
    ep_global_ids_round_robin,
    ep_local_ids_round_robin,
    in_own_words,
    place_prompt_left_response_right,
    plan_micro_batches_first_fit,
    reference_logprobs_on_a_copy,
    replay_targets_int32_sorted,
    splice_into_buffer,
    splice_payload_tails,
    splice_refusing_omitted_prefixes,
    splice_to_numpy,
    truncate_dedup_by_position,
    truncate_keeping_last_kept_row,
    truncate_to_int32,
)
from harness.mutants.drivers import ConstructorPatchDriver
from harness.mutants.layouts import place_prompt_rows_once_per_group, select_samples_by_field_list
from harness.mutants.megatron import RoutersByOwnLayerNumber
from harness.mutants.passes import FIFO_CLEARED_BEFORE_EACH_UPDATE, R2_RECORDING_KEPT_ON_MODEL
from harness.mutants.replay import RoutersByModulePath
from harness.mutants.router_rules import (
    installer,
    recorded_by_own_top_k,
    replayed_at_the_group_stage,
    targets_moved_through,
)
from harness.mutants.serving import (
    ChunksIndexedInt32,
    DraftsFromFirstMatch,
    HandoffInInt16,
    VersionKeyedRouteStore,
)
from harness.mutants.splice import splice_with_turn_placeholders
from harness.mutants.training import tokens_per_expert_over_every_row
from harness.subjects import Subject
from harness.subjects.reference import REFERENCE
from harness.trainers.megatron.subject import HarnessMegatronDriver
from reference_impl import layouts, splice, training


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


def _namespace(module: Any) -> SimpleNamespace:
    """Every public name of ``module`` in a plain (unhashable) namespace."""
    return SimpleNamespace(**{n: getattr(module, n) for n in dir(module) if not n.startswith("_")})


BENIGN: tuple[Benign, ...] = (
    Benign(
        "serving-chunks-indexed-int32",
        "a capture buffer of int32 filled by position index: chunked prefill, another representation",
        _variant("serving-chunks-indexed-int32", serving=ChunksIndexedInt32),
    ),
    Benign(
        "serving-drafts-from-first-match",
        "n-gram drafts looked up at the earliest match, the accepted rows with sorted ids",
        _variant("serving-drafts-from-first-match", serving=DraftsFromFirstMatch),
    ),
    Benign(
        "serving-handoff-int16",
        "prefill/decode disaggregation handing the prompt rows over as int16",
        _variant("serving-handoff-int16", serving=HandoffInInt16),
    ),
    Benign(
        "serving-version-keyed-store",
        "a prefix route store keyed by the weights' version, kept across weight updates",
        _variant("serving-version-keyed-store", serving=VersionKeyedRouteStore),
    ),
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
        "splice-refusing-omitted-prefixes",
        "the correct splice for whole payloads, refusing every payload that omitted a cached prefix "
        "(routes_start > 0) as unsupported (the twin of omitted-prefix-read-from-zero)",
        _variant("splice-refusing-omitted-prefixes", splice=splice_refusing_omitted_prefixes),
    ),
    Benign(
        "splice-filling-turn-placeholders",
        "each turn padded with a placeholder row for its last token, replaced from the next turn's "
        "payload (the twin of turn-boundary-placeholder)",
        _variant(
            "splice-filling-turn-placeholders", splice=partial(splice_with_turn_placeholders, fill=True)
        ),
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
        "decode-in-own-words",
        "a payload of another row count refused with a terse ValueError of its own (the twin of "
        "fitted-payload: any refusal is right, a fitted payload is not)",
        _variant("decode-in-own-words", decode_payload=in_own_words(decode_payload)),
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
        "prompt-rows-deduplicated-by-content",
        "prompt rows stored once per group keyed by the prompt tokens and the rows themselves: only equal "
        "rows are shared (the twin of prompt-rows-keyed-by-prompt)",
        _variant(
            "prompt-rows-deduplicated-by-content",
            layouts=patched_module(
                layouts, place_left_padded=partial(place_prompt_rows_once_per_group, by_content=True)
            ),
        ),
    ),
    Benign(
        "tokens-per-expert-by-bincount",
        "router statistics counted with numpy bincount per MoE layer over the masked rows, as int32 (the "
        "twin of tokens-per-expert-over-padding)",
        _variant(
            "tokens-per-expert-by-bincount",
            training=patched_module(
                training, tokens_per_expert=partial(tokens_per_expert_over_every_row, exact=True)
            ),
        ),
    ),
    Benign(
        "selected-samples-repadded",
        "the picked samples read back whole and placed again, left-padded to the longest picked one (the "
        "twin of routes-left-on-replacement)",
        _variant(
            "selected-samples-repadded",
            layouts=patched_module(layouts, select_samples=partial(select_samples_by_field_list, repad=True)),
        ),
    ),
    Benign(
        "r2-recording-kept-on-model",
        "R2's recording kept on the model for the update pass, replaced by every old pass (the twin of "
        "r2-stale-recording)",
        _variant("r2-recording-kept-on-model", training=R2_RECORDING_KEPT_ON_MODEL),
    ),
    Benign(
        "fifo-cleared-before-each-update",
        "the forward-only pass leaves its recompute entries; each update pass clears the replay state "
        "before it starts (the twin of forward-only-pass-leaks-fifo)",
        _variant("fifo-cleared-before-each-update", training=FIFO_CLEARED_BEFORE_EACH_UPDATE),
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
        "routers-by-module-path",
        "every router module found by walking the model and keyed by its path layers.<i>.mlp.router: the "
        "MTP block's router is no decoder layer's and routes natively (the twin of "
        "mtp-router-by-layer-number)",
        _variant("routers-by-module-path", install_replay=lambda model: RoutersByModulePath(model)),
    ),
    Benign(
        "targets-moved-through-fp32",
        "replayed ids moved to the logits' device through fp32, which holds every id up to 2**24 (the "
        "twin of targets-in-logits-dtype)",
        _variant(
            "targets-moved-through-fp32", install_replay=installer(partial(targets_moved_through, exact=True))
        ),
    ),
    Benign(
        "replay-at-the-expert-top-k",
        "a group-limited router whose group stage runs natively and whose final expert top-k the targets "
        "overrule (the twin of replay-at-the-group-top-k)",
        _variant(
            "replay-at-the-expert-top-k",
            install_replay=installer(partial(replayed_at_the_group_stage, stage="expert")),
        ),
    ),
    Benign(
        "record-by-own-group-limited-top-k",
        "a RECORD branch re-implemented with the group limit, each kept group found by sorting (the twin "
        "of record-without-group-limit)",
        _variant(
            "record-by-own-group-limited-top-k",
            install_replay=installer(partial(recorded_by_own_top_k, group_limit=True)),
        ),
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
        "megatron-routers-by-own-layer-number",
        "Megatron-core routers keyed by their own layer_number, which 0.16.1 sets past the decoder for an "
        "MTP router (num_layers + k): the MTP router finds no targets and routes natively (the twin of "
        "megatron-mtp-router-by-layer-number)",
        _variant("megatron-routers-by-own-layer-number", megatron_data=RoutersByOwnLayerNumber()),
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
