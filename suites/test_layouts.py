"""Layout invariants (DESIGN §3.5, §3.6), checked on the subject's ``layouts`` functions.

Every layout moves positions, and must move tokens and routes with the same indices. Batches here
are random token ids with routes that carry a marker of their ``(sample, position)`` in every
``(layer, lane)`` slot, so a row that lands next to the wrong token names where it came from. The
expected indices are derived by hand in each test (left-pad columns, ``cu_seqlens``, contiguous
SP/TP shards, CP zig-zag chunks, Megatron's interleaved PP/VPP layer ranges, EP ownership),
never read from the reference. Bug classes (FACTS §4): filler replayed (verl #6473), prompt rows
native (verl #6325), CP layout (verl #7297), SP/FP8 padding (verl #5989), dense-layer shift
(verl #5037), PP/VPP offsets and chunk order (verl #5452), local ids leaking into traces.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, note
from hypothesis import strategies as st

from harness.testing.judge import Refusal, as_ids, refuses
from harness.testing.suite import require
from reference_impl.layouts import Placed, place_left_padded

pytestmark = pytest.mark.capability("layouts")

LAYERS, TOP_K = 3, 2


# --------------------------------------------------------------------------------------------------
# Coded batches: token ids are random; the row of position p of sample i is marker(i, p)
# --------------------------------------------------------------------------------------------------


def marker(sample: int, position: int) -> torch.Tensor:
    """The route ``[LAYERS, TOP_K]`` carried by the row of ``position`` of ``sample``: all slots distinct.

    Markers stay below 2**15: a trainer may store routes in any dtype that holds every expert id in
    use (verl 0.9.1 places them as int16), and a marker is meant to survive that, as an id would.
    """
    code = ((sample + 1) * 100 + position) * 10
    return code + TOP_K * torch.arange(LAYERS).view(-1, 1) + torch.arange(TOP_K).view(1, -1)


def decode(row: torch.Tensor) -> str:
    """Where a route row came from, in words (or that it is filler)."""
    value = int(row.reshape(-1)[0])
    if value == 0:
        return "zeros (filler)"
    code = value // 10
    return f"the row of sample {code // 100 - 1}, position {code % 100}"


def coded_sample(sample: int, length: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [length], routes [length − 1, LAYERS, TOP_K])``: random ids, marked rows."""
    tokens = torch.from_numpy(rng.integers(1, 50_000, size=length))
    if length > 1:
        routes = torch.stack([marker(sample, p) for p in range(length - 1)])
    else:
        routes = torch.zeros((0, LAYERS, TOP_K), dtype=torch.long)
    return tokens, routes


def coded_batch(lengths: tuple[int, ...], seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    return [coded_sample(i, n, rng) for i, n in enumerate(lengths)]


def coded_sequence(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed sequence with one row per token (``routes [length, …]``), as SP/CP shard it."""
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(rng.integers(1, 50_000, size=length))
    return tokens, torch.stack([marker(0, p) for p in range(length)])


def hand_padded(
    samples: list[tuple[torch.Tensor, torch.Tensor]], width: int, side: str = "left"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, routes, attention_mask, replay_mask)`` of a padded batch, built by hand."""
    batch = len(samples)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    routes = torch.zeros(batch, width, LAYERS, TOP_K, dtype=torch.long)
    attention = torch.zeros(batch, width, dtype=torch.bool)
    replay = torch.zeros(batch, width, dtype=torch.bool)
    for i, (t, r) in enumerate(samples):
        n = t.shape[0]
        start = width - n if side == "left" else 0
        tokens[i, start : start + n] = t
        routes[i, start : start + n - 1] = r
        attention[i, start : start + n] = True
        replay[i, start : start + n - 1] = True
    return tokens, routes, attention, replay


def describe_batch(lengths: tuple[int, ...], width: int) -> str:
    return f"batch of {len(lengths)} samples of lengths {list(lengths)}, width {width}"


batch_lengths = st.lists(st.one_of(st.just(1), st.integers(1, 12)), min_size=1, max_size=6).map(tuple)
seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------------------------------
# 1. Padded placement (left padding, or prompts and responses padded apart)
# --------------------------------------------------------------------------------------------------


@st.composite
def placements(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...] | None, int, int]:
    """``(lengths, prompt_lens or None, width, seed)`` of a batch to place; with prompt lengths the
    width leaves room for prompts and responses padded apart (a trainer may pad them so)."""
    lengths = draw(batch_lengths)
    prompts = draw(st.one_of(st.none(), st.tuples(*(st.integers(1, n) for n in lengths))))
    extra = draw(st.integers(0, 4))
    if prompts is None:
        width = max(lengths) + extra
    else:
        width = max(prompts) + max(n - p for n, p in zip(lengths, prompts, strict=True)) + extra
    return lengths, prompts, width, draw(seeds)


def real_columns(placed: Any, sample: int) -> list[int]:
    """The columns of ``sample``'s real tokens, in order: where its attention mask is True."""
    return torch.nonzero(torch.as_tensor(placed.attention_mask[sample]).bool()).squeeze(1).tolist()


@given(
    prompt=st.integers(2, 6),
    responses=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    extra=st.integers(0, 2),
    seed=seeds,
)
def test_samples_of_a_group_keep_their_own_prompt_rows(
    subject: Any, prompt: int, responses: list[int], extra: int, seed: int
) -> None:
    """A GRPO group: every sample has the same prompt tokens, yet row ``p`` of sample ``j`` is the
    routing live for *that* sample (DESIGN §3.4). The prompt rows of two samples are equal only when the
    engine really reused them (a prefix hit); after a bf16 prefill in another batch, an evicted block or
    a resume under new weights they differ. A placement that stores prompt rows once per group, keyed by
    the prompt, gives every sample the first one's."""
    note(f"counterexample: prompt={prompt}, responses={responses}, extra={extra}, seed={seed}")
    layouts = require(subject, "layouts")
    lengths = tuple(prompt + r for r in responses)
    samples = coded_batch(lengths, seed)
    shared = samples[0][0][:prompt]
    samples = [(torch.cat([shared, t[prompt:]]), r) for t, r in samples]
    width = max(lengths) + extra
    placed = layouts.place_left_padded(
        [(t.clone(), r.clone()) for t, r in samples], width, [prompt] * len(lengths)
    )
    where = f"a group of {len(lengths)} samples sharing a {prompt}-token prompt, responses {responses}"
    for i, (_, routes) in enumerate(samples):
        columns = real_columns(placed, i)
        for p in range(prompt):
            got = as_ids(placed.routes[i, columns[p]])
            assert torch.equal(got, routes[p]), (
                f"{where}: sample {i}, prompt position {p} holds {decode(got)}, expected its own row "
                f"(the row of sample {i}, position {p})"
            )


@given(
    rounds=st.lists(st.lists(st.integers(1, 8), min_size=1, max_size=5), min_size=1, max_size=3),
    extra=st.integers(0, 2),
    seed=seeds,
    data=st.data(),
)
def test_selected_samples_carry_their_own_routes(
    subject: Any, rounds: list[list[int]], extra: int, seed: int, data: st.DataObject
) -> None:
    """Dynamic sampling and filtering build a batch from samples of other batches (DAPO tops a batch up
    from the next generation round): each picked sample keeps its own tokens, rows and masks, its rows
    replayed. Rebuilding samples from a field list without the routes leaves a rejected sample's routes
    on its replacement, or drops them so its rows route natively (SkyRL #1908 bug 5; NeMo-RL #2849)."""
    layouts = require(subject, "layouts")
    rng = np.random.default_rng(seed)
    width = max(max(r) for r in rounds) + extra
    sources = [
        [coded_sample(8 * r + i, n, rng) for i, n in enumerate(lengths)] for r, lengths in enumerate(rounds)
    ]
    batches = [place_left_padded(samples, width) for samples in sources]
    pairs = st.sampled_from([(r, i) for r, lengths in enumerate(rounds) for i in range(len(lengths))])
    picks = data.draw(st.lists(pairs, min_size=1, max_size=6), label="picks (round, sample)")
    where = f"samples {picks} (round, index) picked from rounds of lengths {rounds}, width {width}"
    got = layouts.select_samples(batches, picks)
    assert torch.as_tensor(got.tokens).shape[0] == len(picks), (
        f"{where}: the batch has {torch.as_tensor(got.tokens).shape[0]} samples, expected {len(picks)}"
    )
    for k, (r, i) in enumerate(picks):
        tokens, routes = sources[r][i]
        columns = real_columns(got, k)
        assert torch.equal(as_ids(torch.as_tensor(got.tokens)[k, columns]), tokens), (
            f"{where}: sample {k}'s tokens are not those of round {r}'s sample {i}"
        )
        for p in range(tokens.shape[0] - 1):
            row = as_ids(torch.as_tensor(got.routes)[k, columns[p]])
            assert torch.equal(row, routes[p]), (
                f"{where}: sample {k} (round {r}'s sample {i}), position {p} holds {decode(row)}, expected "
                f"its own row (the row of sample {8 * r + i}, position {p})"
            )
        replayed = torch.as_tensor(got.replay_mask)[k].bool().nonzero().squeeze(1).tolist()
        assert replayed == columns[:-1], (
            f"{where}: sample {k}'s replay mask is True at columns {replayed}, expected its rows' columns "
            f"{columns[:-1]} (rows without a replay mask route natively)"
        )


@given(case=placements())
@example(case=((3, 1, 5), None, 7, 0))
@example(case=((4,), None, 4, 1))
@example(case=((3, 1, 5), (2, 1, 1), 8, 2))
def test_placement_puts_each_row_at_its_tokens_column(
    subject: Any, case: tuple[tuple[int, ...], tuple[int, ...] | None, int, int]
) -> None:
    """Padding a batch puts each sample's tokens, in order, on its real columns, and each row with its token.

    Which columns hold the padding is the trainer's choice (left, or prompts left and responses right):
    the invariant is that every row moves with its token, and the response mask marks the response.
    """
    note("counterexample: lengths={}, prompt lengths={}, width={}, seed={}".format(*case))
    layouts = require(subject, "layouts")
    lengths, prompts, width, seed = case
    samples = coded_batch(lengths, seed)
    where = describe_batch(lengths, width) + (f", prompts {list(prompts)}" if prompts else "")
    placed = layouts.place_left_padded([(t.clone(), r.clone()) for t, r in samples], width, prompts)
    assert tuple(placed.tokens.shape) == (len(lengths), width), (
        f"{where}: tokens are {tuple(placed.tokens.shape)}"
    )
    assert tuple(placed.routes.shape) == (len(lengths), width, LAYERS, TOP_K), (
        f"{where}: routes are {tuple(placed.routes.shape)}, expected {(len(lengths), width, LAYERS, TOP_K)}"
    )
    for i, (tokens, routes) in enumerate(samples):
        columns = real_columns(placed, i)
        assert len(columns) == tokens.shape[0], (
            f"{where}: sample {i} has {tokens.shape[0]} tokens but {len(columns)} attended columns"
        )
        assert torch.equal(as_ids(placed.tokens[i, columns]), tokens), (
            f"{where}: sample {i}'s tokens are not, in order, at its attended columns {columns}"
        )
        for p in range(tokens.shape[0] - 1):
            got = as_ids(placed.routes[i, columns[p]])
            assert torch.equal(got, routes[p]), (
                f"{where}: sample {i}, column {columns[p]} (token position {p}) holds {decode(got)}, "
                f"expected the row of sample {i}, position {p}"
            )
        if prompts is not None:
            response = torch.as_tensor(placed.response_mask[i]).bool()
            expected = torch.zeros(width, dtype=torch.bool)
            expected[columns[prompts[i] :]] = True
            assert torch.equal(response, expected), (
                f"{where}: sample {i}'s response mask is True at {response.nonzero().squeeze(1).tolist()}, "
                f"expected the columns of its response tokens {columns[prompts[i] :]}"
            )


@given(case=placements())
@example(case=((3, 1, 5), None, 7, 0))
@example(case=((2, 2), None, 2, 1))
@example(case=((3, 1, 5), (2, 1, 1), 8, 2))
def test_replay_mask_is_true_exactly_on_rows_that_exist(
    subject: Any, case: tuple[tuple[int, ...], tuple[int, ...] | None, int, int]
) -> None:
    """The replay mask is True on every real row (prompt rows too), False on padding and each last token.

    A sample whose prompt is all of it (no response token) is the one exception: it has no log-prob
    to train, so its rows shape nothing and may be replayed or left native (verl's R3 mask leaves
    them native); its padding and last token are still never replayed.
    """
    note("counterexample: lengths={}, prompt lengths={}, width={}, seed={}".format(*case))
    layouts = require(subject, "layouts")
    lengths, prompts, width, seed = case
    placed = layouts.place_left_padded(coded_batch(lengths, seed), width, prompts)
    required = torch.zeros(len(lengths), width, dtype=torch.bool)
    allowed = torch.zeros(len(lengths), width, dtype=torch.bool)
    for i, length in enumerate(lengths):
        rows = real_columns(placed, i)[:-1]
        allowed[i, rows] = True
        if prompts is None or prompts[i] < length:
            required[i, rows] = True
    got = torch.as_tensor(placed.replay_mask).bool()
    filler = (got & ~allowed).nonzero().tolist()
    missing = (required & ~got).nonzero().tolist()
    if filler or missing:
        raise AssertionError(
            f"{describe_batch(lengths, width)}: replay_mask marks filler (padding or a sample's last token) "
            f"at [sample, column] {filler[:6]} and leaves real rows unreplayed at {missing[:6]}"
        )


@given(case=placements())
@example(case=((3, 1, 5), None, 7, 0))
@example(case=((3, 1, 5), (2, 1, 1), 8, 2))
def test_placement_round_trip_is_bit_exact(
    subject: Any, case: tuple[tuple[int, ...], tuple[int, ...] | None, int, int]
) -> None:
    """Placing then unplacing gives back every sample's tokens and rows bit for bit."""
    note("counterexample: lengths={}, prompt lengths={}, width={}, seed={}".format(*case))
    layouts = require(subject, "layouts")
    lengths, prompts, width, seed = case
    samples = coded_batch(lengths, seed)
    back = layouts.unplace(layouts.place_left_padded(samples, width, prompts))
    assert len(back) == len(samples), f"{describe_batch(lengths, width)}: unplace gave {len(back)} samples"
    for i, ((tokens, routes), (back_tokens, back_routes)) in enumerate(zip(samples, back, strict=True)):
        assert torch.equal(as_ids(back_tokens), tokens) and torch.equal(as_ids(back_routes), routes), (
            f"{describe_batch(lengths, width)}: sample {i} does not survive place → unplace bit for bit "
            f"({tuple(back_tokens.shape)} tokens, {tuple(back_routes.shape)} rows back)"
        )


# --------------------------------------------------------------------------------------------------
# 2. Packing with cu_seqlens
# --------------------------------------------------------------------------------------------------


@given(lengths=batch_lengths, extra=st.integers(0, 3), side=st.sampled_from(["left", "right"]), seed=seeds)
@example(lengths=(3, 1, 5), extra=1, side="left", seed=0)
def test_packing_gathers_tokens_and_rows_with_the_same_indices(
    subject: Any, lengths: tuple[int, ...], extra: int, side: str, seed: int
) -> None:
    """Packing keeps exactly the real tokens with their rows (cu_seqlens by hand) and unpacks bit for bit."""
    note(f"counterexample: lengths={lengths}, extra={extra}, side={side}, seed={seed}")
    layouts = require(subject, "layouts")
    samples = coded_batch(lengths, seed)
    width = max(lengths) + extra
    where = f"{describe_batch(lengths, width)}, {side}-padded"
    tokens, routes, attention, replay = hand_padded(samples, width, side)
    packing = layouts.pack(attention)
    cu = [0, *np.cumsum(lengths).tolist()]
    assert packing.cu_seqlens.tolist() == cu, (
        f"{where}: cu_seqlens {packing.cu_seqlens.tolist()}, expected {cu}"
    )
    assert packing.cu_seqlens.dtype == torch.int32, (
        f"{where}: cu_seqlens is {packing.cu_seqlens.dtype}, varlen attention takes int32"
    )
    flat = [i * width + c for i in range(len(lengths)) for c in range(width) if attention[i, c]]
    assert packing.indices.tolist() == flat, (
        f"{where}: packing indices {packing.indices.tolist()}, expected {flat}"
    )
    packed_tokens = packing.gather(tokens)
    packed_routes = packing.gather(routes)
    packed_replay = packing.gather(replay)
    assert torch.equal(packed_tokens, torch.cat([t for t, _ in samples])), (
        f"{where}: packed tokens are not the samples in order"
    )
    for i, (_, rows) in enumerate(samples):
        for p in range(rows.shape[0]):
            got = packed_routes[cu[i] + p]
            assert torch.equal(got, rows[p]), (
                f"{where}: packed position {cu[i] + p} (sample {i}, position {p}) holds {decode(got)}"
            )
        assert packed_replay[cu[i] : cu[i + 1]].tolist() == [True] * rows.shape[0] + [False], (
            f"{where}: packed replay mask of sample {i} is {packed_replay[cu[i] : cu[i + 1]].tolist()}, "
            "expected True on its rows and False on its last token"
        )
    assert torch.equal(packing.scatter(packed_tokens), tokens), (
        f"{where}: tokens do not survive pack → unpack"
    )
    assert torch.equal(packing.scatter(packed_routes), routes), (
        f"{where}: routes do not survive pack → unpack"
    )
    assert torch.equal(packing.scatter(packed_replay, fill=False), replay), (
        f"{where}: replay mask does not survive pack → unpack"
    )
    logprobs = torch.from_numpy(np.random.default_rng(seed).standard_normal((len(lengths), width))).float()
    logprobs[~attention] = 0
    assert torch.equal(packing.scatter(packing.gather(logprobs)), logprobs), (
        f"{where}: per-token float values (log-probs) do not survive pack → unpack bit for bit"
    )


# --------------------------------------------------------------------------------------------------
# 3. Micro-batches and dynamic-batch reordering
# --------------------------------------------------------------------------------------------------


@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=10).map(tuple),
    slack=st.integers(0, 24),
    seed=seeds,
)
@example(lengths=(5, 3, 4, 2), slack=2, seed=0)
@example(lengths=(5, 5, 2), slack=1, seed=1)
@example(lengths=(7,), slack=0, seed=2)
def test_micro_batches_stay_within_budget_and_merge_back(
    subject: Any, lengths: tuple[int, ...], slack: int, seed: int
) -> None:
    """Micro-batches partition the batch within the token budget, none empty; tokens and rows split alike and
    merge back."""
    note(f"counterexample: lengths={lengths}, slack={slack}, seed={seed}")
    layouts = require(subject, "layouts")
    budget = max(lengths) + slack
    where = f"samples of lengths {list(lengths)}, budget {budget} tokens per micro-batch"
    plan = layouts.plan_micro_batches(list(lengths), budget)
    groups = [list(g) for g in plan.groups]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))), (
        f"{where}: groups {groups} are not a partition of the samples"
    )
    over = [g for g in groups if sum(lengths[i] for i in g) > budget]
    assert not over, f"{where}: micro-batches {over} exceed the budget"
    assert all(groups), f"{where}: groups {groups} include an empty micro-batch (a forward of no sample)"
    assert plan.order.tolist() == [i for g in groups for i in g], (
        f"{where}: order {plan.order.tolist()} is not the groups concatenated"
    )
    samples = coded_batch(lengths, seed)
    tokens, routes, _, replay = hand_padded(samples, max(lengths))
    for name, x in (("tokens", tokens), ("routes", routes), ("replay mask", replay)):
        parts = plan.split(x)
        assert len(parts) == len(groups), (
            f"{where}: split gave {len(parts)} micro-batches for {len(groups)} groups"
        )
        for g, (group, part) in enumerate(zip(groups, parts, strict=True)):
            assert torch.equal(part, x[group]), (
                f"{where}: micro-batch {g} of the {name} is not samples {group}"
            )
        assert torch.equal(plan.merge(parts), x), f"{where}: {name} do not survive split → merge"


# --------------------------------------------------------------------------------------------------
# 4. SP/TP sequence split
# --------------------------------------------------------------------------------------------------


@given(length=st.integers(1, 40), tp=st.integers(1, 8), seed=seeds)
@example(length=5, tp=2, seed=0)
@example(length=3, tp=4, seed=1)
@example(length=7, tp=4, seed=2)
def test_sp_shards_are_contiguous_with_padding_never_replayed(
    subject: Any, length: int, tp: int, seed: int
) -> None:
    """SP/TP rank r holds shard r of the sequence padded to a multiple of tp, tokens and rows alike."""
    note(f"counterexample: length={length}, tp={tp}, seed={seed}")
    layouts = require(subject, "layouts")
    tokens, routes = coded_sequence(length, seed)
    size = -(-length // tp)
    pad_len = size * tp - length
    where = f"sequence of {length} tokens, tp={tp} (shards of {size}, {pad_len} padding)"
    _, got_pad = layouts.sp_pad(tokens, tp)
    assert got_pad == pad_len, f"{where}: sp_pad pads {got_pad} positions, expected {pad_len}"
    token_shards, route_shards = [], []
    for rank in range(tp):
        positions = torch.arange(rank * size, (rank + 1) * size)
        valid = positions < length
        token_shard = as_ids(layouts.sp_shard(tokens, tp, rank), f"rank {rank}'s token shard")
        route_shard = as_ids(layouts.sp_shard(routes, tp, rank), f"rank {rank}'s route shard")
        token_shards.append(token_shard)
        route_shards.append(route_shard)
        assert token_shard.shape[0] == size and route_shard.shape[0] == size, (
            f"{where}: rank {rank} holds {token_shard.shape[0]} tokens and {route_shard.shape[0]} rows, "
            f"expected {size} each"
        )
        mask = layouts.sp_valid_mask(length, tp, rank)
        assert mask.tolist() == valid.tolist(), (
            f"{where}: rank {rank}'s valid mask is {mask.tolist()}, expected {valid.tolist()} "
            "(padding is never replayed)"
        )
        real = positions[valid]
        assert torch.equal(token_shard[valid], tokens[real]), (
            f"{where}: rank {rank} holds tokens other than positions {real.tolist()}"
        )
        for j in range(int(valid.sum())):
            assert torch.equal(route_shard[j], routes[rank * size + j]), (
                f"{where}: rank {rank}, slot {j} (position {rank * size + j}) holds {decode(route_shard[j])}"
            )
    assert torch.equal(layouts.sp_gather(token_shards, pad_len), tokens), (
        f"{where}: tokens do not survive shard → gather"
    )
    assert torch.equal(layouts.sp_gather(route_shards, pad_len), routes), (
        f"{where}: routes do not survive shard → gather"
    )


# --------------------------------------------------------------------------------------------------
# 5. CP zig-zag
# --------------------------------------------------------------------------------------------------


def zigzag_by_hand(padded_len: int, cp: int, rank: int) -> list[int]:
    """Chunk ``rank`` then chunk ``2·cp − 1 − rank`` of ``2·cp`` equal chunks."""
    chunk = padded_len // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return [*range(rank * chunk, (rank + 1) * chunk), *range(mirror * chunk, (mirror + 1) * chunk)]


@given(length=st.integers(1, 40), cp=st.integers(1, 4), seed=seeds)
@example(length=8, cp=2, seed=0)
@example(length=9, cp=2, seed=1)
@example(length=5, cp=3, seed=2)
def test_cp_zigzag_shards_tokens_and_rows_with_the_same_indices(
    subject: Any, length: int, cp: int, seed: int
) -> None:
    """CP rank r holds chunks r and 2cp−1−r of the padded sequence, tokens and rows alike; merge undoes it."""
    note(f"counterexample: length={length}, cp={cp}, seed={seed}")
    layouts = require(subject, "layouts")
    tokens, routes = coded_sequence(length, seed)
    pad_len = -length % (2 * cp)
    padded_len = length + pad_len
    where = f"sequence of {length} tokens, cp={cp} (padded to {padded_len})"
    _, got_pad = layouts.cp_pad(tokens, cp)
    assert got_pad == pad_len, f"{where}: cp_pad pads {got_pad} positions, expected {pad_len}"
    token_shards, route_shards = [], []
    for rank in range(cp):
        held = zigzag_by_hand(padded_len, cp, rank)
        got_held = layouts.cp_zigzag_indices(padded_len, cp, rank).tolist()
        assert got_held == held, f"{where}: rank {rank} holds positions {got_held}, expected {held}"
        token_shard = as_ids(layouts.cp_zigzag_shard(tokens, cp, rank), f"rank {rank}'s token shard")
        route_shard = as_ids(layouts.cp_zigzag_shard(routes, cp, rank), f"rank {rank}'s route shard")
        token_shards.append(token_shard)
        route_shards.append(route_shard)
        valid = [q < length for q in held]
        mask = layouts.cp_valid_mask(length, cp, rank)
        assert mask.tolist() == valid, (
            f"{where}: rank {rank}'s valid mask is {mask.tolist()}, expected {valid}"
        )
        assert token_shard.shape[0] == len(held) and route_shard.shape[0] == len(held), (
            f"{where}: rank {rank} holds {token_shard.shape[0]} tokens and {route_shard.shape[0]} rows, "
            f"expected {len(held)}"
        )
        for j, q in enumerate(held):
            if q >= length:
                continue
            assert int(token_shard[j]) == int(tokens[q]), (
                f"{where}: rank {rank}, slot {j} holds a token other than position {q}'s"
            )
            assert torch.equal(route_shard[j], routes[q]), (
                f"{where}: rank {rank}, slot {j} holds the token of position {q} "
                f"but {decode(route_shard[j])} "
                "(tokens and routes sharded with different indices)"
            )
    assert torch.equal(layouts.cp_zigzag_merge(token_shards, pad_len), tokens), (
        f"{where}: tokens do not survive shard → merge"
    )
    assert torch.equal(layouts.cp_zigzag_merge(route_shards, pad_len), routes), (
        f"{where}: routes do not survive shard → merge"
    )


# --------------------------------------------------------------------------------------------------
# 6. PP/VPP layer ownership with dense layers
# --------------------------------------------------------------------------------------------------


@st.composite
def pp_models(
    draw: st.DrawFn, vpp: st.SearchStrategy[int] | None = None
) -> tuple[int, int, int, tuple[int, ...]]:
    """``(num_layers, pp, vpp, moe_layers)``: dense-first layers (DeepSeek) or interleaved MoE layers."""
    pp = draw(st.integers(1, 4))
    v = draw(vpp if vpp is not None else st.integers(1, 3))
    num_layers = pp * v * draw(st.integers(1, 3))
    pattern = draw(st.sampled_from(["first_k_dense", "first_k_dense", "all_moe", "every_other"]))
    if pattern == "first_k_dense":
        first = min(draw(st.one_of(st.just(1), st.integers(1, 4))), num_layers - 1)
        moe = tuple(range(first, num_layers))
    elif pattern == "every_other":
        moe = tuple(range(1, num_layers, 2)) or (0,)
    else:
        moe = tuple(range(num_layers))
    return num_layers, pp, v, moe


def ranges_by_hand(num_layers: int, pp: int, vpp: int) -> list[list[range]]:
    """Megatron's interleaved order: virtual chunk c of rank r is model chunk c·pp + r."""
    size = num_layers // (pp * vpp)
    return [[range((c * pp + r) * size, (c * pp + r + 1) * size) for c in range(vpp)] for r in range(pp)]


def decoder_trace(tokens: int, num_layers: int, moe_layers: tuple[int, ...]) -> torch.Tensor:
    """Decoder-axis trace: MoE slot l of position p holds a marker of (l, p); dense slots hold 0."""
    trace = torch.zeros(tokens, num_layers, TOP_K, dtype=torch.long)
    for layer in moe_layers:
        trace[:, layer] = ((layer + 1) * 1000 + 10 * torch.arange(tokens)).view(-1, 1) + torch.arange(TOP_K)
    return trace


def layers_of(targets: torch.Tensor) -> list[int]:
    """The decoder layer each slot of a ``[T, n, k]`` target tensor came from (−1: a dense 0 slot)."""
    return [int(v) // 1000 - 1 for v in targets[0, :, 0]] if targets.shape[0] else []


def as_ranges(ranges: Any) -> list[list[tuple[int, int]]]:
    return [[(r.start, r.stop) for r in chunks] for chunks in ranges]


@given(model=pp_models())
@example(model=(8, 2, 2, tuple(range(1, 8))))
@example(model=(6, 3, 1, (3, 4, 5)))
def test_pp_layer_ranges_cover_every_layer_once(
    subject: Any, model: tuple[int, int, int, tuple[int, ...]]
) -> None:
    """PP/VPP stages own every decoder layer exactly once, in Megatron's interleaved order."""
    note("counterexample: {} layers, pp={}, vpp={}, MoE layers {}".format(*model))
    layouts = require(subject, "layouts")
    num_layers, pp, vpp, _ = model
    got = as_ranges(layouts.pp_layer_ranges(num_layers, pp, vpp))
    expected = as_ranges(ranges_by_hand(num_layers, pp, vpp))
    owned = sorted(layer for chunks in got for start, stop in chunks for layer in range(start, stop))
    where = f"{num_layers} layers, pp={pp}, vpp={vpp}"
    assert owned == list(range(num_layers)), (
        f"{where}: stages own layers {owned}, expected each of 0..{num_layers - 1} once"
    )
    assert got == expected, (
        f"{where}: ranges {got}, expected {expected} (virtual chunk c of rank r is model chunk c·pp + r)"
    )


@given(model=pp_models(), tokens=st.integers(1, 4))
@example(model=(4, 2, 1, (1, 2, 3)), tokens=3)
@example(model=(8, 2, 2, (3, 4, 5, 6, 7)), tokens=2)
def test_stage_targets_give_each_stage_its_own_moe_layers(
    subject: Any, model: tuple[int, int, int, tuple[int, ...]], tokens: int
) -> None:
    """Each PP stage's targets from a decoder-axis trace are exactly its own MoE layers (dense skipped)."""
    note("counterexample: {} layers, pp={}, vpp={}, MoE layers {}".format(*model))
    note(f"counterexample: tokens={tokens}")
    layouts = require(subject, "layouts")
    num_layers, pp, vpp, moe = model
    trace = decoder_trace(tokens, num_layers, moe)
    for rank, chunks in enumerate(ranges_by_hand(num_layers, pp, vpp)):
        for chunk, layer_range in enumerate(chunks):
            own = [layer for layer in moe if layer in layer_range]
            got = layouts.stage_targets(trace.clone(), list(moe), layer_range)
            assert torch.equal(got, trace[:, own]), (
                f"{num_layers} layers (MoE layers {list(moe)}), pp={pp}, vpp={vpp}: "
                f"stage (rank {rank}, chunk {chunk}) owning layers [{layer_range.start}, {layer_range.stop}) "
                f"got the routes of layers {layers_of(got)}, "
                f"expected {own}"
            )


@given(model=pp_models(), tokens=st.integers(1, 4))
@example(model=(4, 2, 1, (1, 2, 3)), tokens=3)
@example(model=(8, 2, 2, (3, 4, 5, 6, 7)), tokens=2)
def test_stage_targets_from_moe_ordinal_trace_count_moe_layers(
    subject: Any, model: tuple[int, int, int, tuple[int, ...]], tokens: int
) -> None:
    """Each PP stage's targets from an MoE-ordinal trace are its own MoE layers (offsets count MoE layers)."""
    note("counterexample: {} layers, pp={}, vpp={}, MoE layers {}".format(*model))
    note(f"counterexample: tokens={tokens}")
    layouts = require(subject, "layouts")
    num_layers, pp, vpp, moe = model
    ordinal = decoder_trace(tokens, num_layers, moe)[:, list(moe)]
    for rank, chunks in enumerate(ranges_by_hand(num_layers, pp, vpp)):
        for chunk, layer_range in enumerate(chunks):
            slots = [j for j, layer in enumerate(moe) if layer in layer_range]
            got = layouts.stage_targets_moe_ordinal(ordinal.clone(), list(moe), layer_range)
            assert torch.equal(got, ordinal[:, slots]), (
                f"{num_layers} layers (MoE layers {list(moe)}), pp={pp}, vpp={vpp}: "
                f"stage (rank {rank}, chunk {chunk}) owning layers [{layer_range.start}, {layer_range.stop}) "
                f"got the routes of layers {layers_of(got)}, "
                f"expected {[moe[j] for j in slots]}"
            )


@given(model=pp_models(vpp=st.sampled_from([2, 2, 3, 1])), tokens=st.integers(1, 4))
@example(model=(8, 2, 2, tuple(range(1, 8))), tokens=2)
@example(model=(12, 3, 2, tuple(range(2, 12))), tokens=1)
def test_merging_stage_recordings_restores_model_layer_order(
    subject: Any, model: tuple[int, int, int, tuple[int, ...]], tokens: int
) -> None:
    """Per-stage recordings merge into the MoE-ordinal trace in model-layer order, VPP chunks included."""
    note("counterexample: {} layers, pp={}, vpp={}, MoE layers {}".format(*model))
    note(f"counterexample: tokens={tokens}")
    layouts = require(subject, "layouts")
    num_layers, pp, vpp, moe = model
    ordinal = decoder_trace(tokens, num_layers, moe)[:, list(moe)]
    ranges = ranges_by_hand(num_layers, pp, vpp)
    per_stage = {
        (rank, chunk): ordinal[:, [j for j, layer in enumerate(moe) if layer in ranges[rank][chunk]]]
        for rank in range(pp)
        for chunk in range(vpp)
    }
    merged = layouts.merge_stage_recordings(per_stage, ranges, moe_layers=list(moe))
    assert torch.equal(merged, ordinal), (
        f"{num_layers} layers (MoE layers {list(moe)}), pp={pp}, vpp={vpp}: "
        "merged recording has the routes of "
        f"layers {layers_of(merged)}, expected {list(moe)} in model order"
    )


# --------------------------------------------------------------------------------------------------
# 7. EP expert ids
# --------------------------------------------------------------------------------------------------

EP_SHAPES = ((8, 1), (8, 2), (8, 4), (12, 3), (64, 8), (256, 2), (256, 4), (300, 4), (384, 8))


def ep_ids(num_experts: int, seed: int, rows: int) -> torch.Tensor:
    """Global ids ``[rows, LAYERS, TOP_K]`` in the narrowest storage (DESIGN §3.2), 0 and E − 1 included."""
    rng = np.random.default_rng(seed)
    dtype = torch.uint8 if num_experts <= 256 else torch.int16
    ids = torch.from_numpy(rng.integers(0, num_experts, size=(rows, LAYERS, TOP_K))).to(dtype)
    ids[0, 0, 0], ids[-1, -1, -1] = 0, num_experts - 1
    return ids


@given(experts_and_ep=st.sampled_from(EP_SHAPES), seed=seeds, rows=st.integers(1, 6))
@example(experts_and_ep=(256, 2), seed=0, rows=2)
@example(experts_and_ep=(8, 2), seed=1, rows=1)
def test_ep_local_ids_round_trip_and_traces_keep_global_ids(
    subject: Any, experts_and_ep: tuple[int, int], seed: int, rows: int
) -> None:
    """Under EP every expert has exactly one owner rank, local ids are in [0, E/ep) and one-to-one with
    the rank's experts, local → global round trips, and the trace keeps its global ids.

    Which rank owns which expert is the trainer's choice (Megatron shards contiguously; see the
    opt-in check below); the dispatch only needs a consistent one.
    """
    note("counterexample: {} experts, ep={}".format(*experts_and_ep) + f", seed={seed}, rows={rows}")
    layouts = require(subject, "layouts")
    num_experts, ep = experts_and_ep
    ids = ep_ids(num_experts, seed, rows)
    before = ids.clone()
    per_rank = num_experts // ep
    where = f"{num_experts} experts, ep={ep}, ids stored as {ids.dtype}"
    every_expert = torch.arange(num_experts)
    owners = torch.zeros(num_experts, dtype=torch.long)
    for rank in range(ep):
        local, owned = layouts.ep_local_ids(every_expert.clone(), num_experts, ep, rank)
        local, owned = as_ids(local, "local ids"), torch.as_tensor(owned).bool()
        owners += owned.long()
        mine = local[owned]
        assert sorted(mine.tolist()) == list(range(per_rank)), (
            f"{where}: rank {rank}'s local ids {sorted(mine.tolist())[:12]} are not one-to-one with "
            f"[0, E/ep = {per_rank})"
        )
        back = as_ids(layouts.ep_global_ids(mine.clone(), num_experts, ep, rank), "global ids")
        assert torch.equal(back, every_expert[owned]), (
            f"{where}: rank {rank}'s local → global ids do not round trip "
            f"({every_expert[owned].tolist()[:8]} → {mine.tolist()[:8]} → {back.tolist()[:8]})"
        )
        wide = ids.long()  # the router's own int64 ids: mapping them must not rewrite them in place
        trace_local, trace_owned = layouts.ep_local_ids(wide, num_experts, ep, rank)
        trace_owned = torch.as_tensor(trace_owned).bool()
        assert torch.equal(wide, before.long()), (
            f"{where}: rank {rank}'s global → local mapping rewrote the int64 ids it was given "
            "(the recorded trace would hold local ids)"
        )
        assert torch.equal(trace_owned, owned[ids.long()]), (
            f"{where}: rank {rank} owns other ids in a trace than among the experts themselves"
        )
        assert torch.equal(as_ids(trace_local)[trace_owned], local[ids.long()][trace_owned]), (
            f"{where}: rank {rank} maps a trace's ids to other local ids than the experts themselves"
        )
    unowned = (owners != 1).nonzero().squeeze(1).tolist()
    assert not unowned, (
        f"{where}: experts {unowned[:8]} are owned by {[int(owners[e]) for e in unowned[:8]]} ranks, "
        "expected exactly one"
    )
    assert torch.equal(ids, before) and ids.dtype == before.dtype, (
        f"{where}: mapping to local ids rewrote the trace's global ids"
    )


@given(experts_and_ep=st.sampled_from(EP_SHAPES), seed=seeds, rows=st.integers(1, 6))
@example(experts_and_ep=(256, 2), seed=0, rows=2)
def test_ep_ownership_is_megatrons_contiguous_shards(
    subject: Any, experts_and_ep: tuple[int, int], seed: int, rows: int
) -> None:
    """A subject that declares Megatron's EP convention (``layouts.EP_OWNERSHIP == "contiguous"``) gives
    rank r experts [r·E/ep, (r+1)·E/ep) as local ids id − r·E/ep, −1 where another rank owns the id."""
    note("counterexample: {} experts, ep={}".format(*experts_and_ep) + f", seed={seed}, rows={rows}")
    layouts = require(subject, "layouts")
    declared = getattr(layouts, "EP_OWNERSHIP", None)
    if declared != "contiguous":
        pytest.skip(
            f"layouts.EP_OWNERSHIP is {declared!r}: the subject does not declare Megatron's convention"
        )
    num_experts, ep = experts_and_ep
    ids = ep_ids(num_experts, seed, rows)
    per_rank = num_experts // ep
    for rank in range(ep):
        local, owned = layouts.ep_local_ids(ids, num_experts, ep, rank)
        expected_owned = (ids.long() // per_rank) == rank
        expected_local = torch.where(expected_owned, ids.long() - rank * per_rank, torch.full(ids.shape, -1))
        assert torch.equal(torch.as_tensor(owned).bool(), expected_owned), (
            f"{num_experts} experts, ep={ep}: rank {rank} does not own exactly experts "
            f"[{rank * per_rank}, {(rank + 1) * per_rank})"
        )
        assert torch.equal(as_ids(local), expected_local), (
            f"{num_experts} experts, ep={ep}: rank {rank}'s local ids are not id − {rank * per_rank} "
            "(−1 where another rank owns the expert)"
        )


# --------------------------------------------------------------------------------------------------
# 8. Input no layout fits
# --------------------------------------------------------------------------------------------------


def test_bad_layout_input_is_refused(subject: Any, refused: Refusal = refuses) -> None:
    """A layout that cannot apply raises, in the subject's own words, never returns a silently wrong
    batch, shard or id, and leaves its input as it was (DESIGN §3.8): samples that do not fit, a rank
    outside its group, a trace on the other layer axis (verl #5037), stage recordings that do not match
    their ranges, ids outside their range. The reference's own tests run these cases with
    ``raises_naming``: its errors name the field."""
    layouts = require(subject, "layouts")
    samples = coded_batch((4, 2), 0)
    before = [(t.clone(), r.clone()) for t, r in samples]
    (t0, r0), (t1, r1) = samples
    place = layouts.place_left_padded
    refused(lambda: place(samples, 4, [1]), "prompt_lens")
    refused(lambda: place([], 4), "samples")
    refused(lambda: place([(t0, r0), (t1[:, None], r1)], 4), "sample 1", "tokens")
    refused(lambda: place(samples, 3), "sample 0", "width", "4")
    refused(lambda: place([(t0, r0[:-1]), (t1, r1)], 4), "sample 0", "2 rows", "= 3")
    refused(lambda: place([(t0, r0), (t1, r1[:, :2])], 4), "sample 1", "routes")
    batch = place_left_padded(samples, 4)
    refused(lambda: layouts.select_samples([batch], [(0, 2)]), "picks[0]", "[0, 2)")
    refused(lambda: layouts.select_samples([batch], []), "picks")
    refused(lambda: layouts.select_samples([batch], [0]), "picks[0]", "pair")
    refused(lambda: place(samples, 4, [1, 3]), "sample 1", "prompt_lens", "3")
    placed = place(samples, 4)
    no_token = torch.as_tensor(placed.attention_mask).bool().clone()
    no_token[1] = False
    refused(
        lambda: layouts.unplace(Placed(placed.tokens, no_token, placed.routes, placed.replay_mask)),
        "sample 1",
        "attention_mask",
    )

    refused(lambda: layouts.pack(torch.ones(4, dtype=torch.bool)), "attention_mask")
    packing = layouts.pack(placed.attention_mask)
    refused(lambda: packing.gather(torch.zeros(3, 4)), "(2, 4)")
    refused(lambda: packing.scatter(torch.zeros(5)), "5 rows", "6")
    refused(lambda: layouts.plan_micro_batches([3, 2], 0), "max_tokens_per_micro_batch")
    refused(lambda: layouts.plan_micro_batches([], 4), "seq_lens")
    refused(lambda: layouts.plan_micro_batches([3, 5], 4), "sample 1", "seq_len 5")
    refused(lambda: layouts.plan_micro_batches([3, -1], 4), "sample 1", "seq_len -1")
    plan = layouts.plan_micro_batches([3, 2, 2], 4)
    refused(lambda: plan.split(torch.zeros(2)), "2 samples", "3")
    refused(lambda: plan.merge(plan.split(torch.arange(3))[:-1]), "micro-batch sizes")

    x = torch.arange(5)
    refused(lambda: layouts.sp_pad(x, 0), "tp")
    refused(lambda: layouts.sp_shard(x, 2, 2), "rank", "tp")
    refused(lambda: layouts.sp_valid_mask(5, 2, -1), "rank", "tp")
    refused(lambda: layouts.sp_gather([], 0), "shards")
    refused(lambda: layouts.sp_gather([x[:3], x[:2]], 0), "shards", "[3, 2]")
    refused(lambda: layouts.cp_pad(x, 0), "cp")
    refused(lambda: layouts.cp_zigzag_indices(8, 2, 2), "rank", "cp")
    refused(lambda: layouts.cp_zigzag_indices(6, 2, 0), "padded_len", "4")

    refused(lambda: layouts.pp_layer_ranges(4, 0), "pp")
    refused(lambda: layouts.pp_layer_ranges(4, 1, 0), "vpp")
    refused(lambda: layouts.pp_layer_ranges(6, 2, 2), "num_layers", "4")
    decoder = decoder_trace(2, 4, (1, 3))
    ordinal = decoder[:, [1, 3]]
    refused(lambda: layouts.stage_targets(ordinal, [1, 3], range(0, 2)), "routes")
    refused(lambda: layouts.stage_targets(decoder[:, :, 0], [1, 3], range(0, 4)), "routes")
    refused(lambda: layouts.stage_targets_moe_ordinal(decoder, [1, 3], range(0, 4)), "routes")
    refused(lambda: layouts.stage_targets(decoder, [3, 1], range(0, 4)), "moe_layers")
    refused(lambda: layouts.stage_targets(decoder, [1, 1], range(0, 4)), "moe_layers")
    refused(lambda: layouts.stage_targets_moe_ordinal(ordinal, [-1, 3], range(0, 4)), "moe_layers")
    ranges = ranges_by_hand(4, 2, 1)
    refused(lambda: layouts.merge_stage_recordings({(0, 0): ordinal[:, :1]}, ranges), "per_stage", "(1, 0)")
    refused(
        lambda: layouts.merge_stage_recordings({(0, 0): ordinal[:, :0], (1, 0): ordinal}, ranges, [1, 3]),
        "pp_rank=0",
        "0 MoE slots",
        "expected 1",
    )

    ids = torch.tensor([0, 8])
    refused(lambda: layouts.ep_local_ids(ids, 8, 2, 0), "ids", "8")
    refused(lambda: layouts.ep_local_ids(ids - 1, 8, 2, 0), "ids", "-1")
    refused(lambda: layouts.ep_global_ids(torch.tensor([0, 4]), 8, 2, 1), "local_ids", "4")
    refused(lambda: layouts.ep_local_ids(ids[:1], 8, 3, 0), "num_experts", "ep")
    refused(lambda: layouts.ep_local_ids(ids[:1], 8, 2, 2), "rank", "ep")
    refused(lambda: layouts.ep_global_ids(ids[:1], 8, 0, 0), "ep")
    changed = [
        i
        for i, ((t, r), (t0, r0)) in enumerate(zip(samples, before, strict=True))
        if not (torch.equal(t, t0) and torch.equal(r, r0))
    ]
    assert not changed, f"refused layouts changed samples {changed} of their input"
