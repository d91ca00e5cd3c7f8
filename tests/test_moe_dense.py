"""MoE LoRA's versions 7 to 9: the dense op's kernels on the MoE blocks
(:mod:`punica_numba.ops.moe_dense`). Checked here:

1. the blocks as the dense tile table (:func:`~punica_numba.ops.moe_dense.moe_tiles`), and
   their pairs as the table of one-token tiles (:func:`~punica_numba.ops.moe_dense.moe_pairs`),
   against their definitions, written as loops, on drawn routings: block sizes below, at and
   past a tile of 16 (two tiles a block), slots turned off, experts -1, idle blocks, more
   blocks in use than the pairs kernel's threads (rounds of its running sum);
2. the op at version 7 against the float64 reference, on calls whose shrink and expand the
   tensor cores take (16-bit x, A, B and y; K, the rank, the widths and the offset in whole
   words), with the router's weights (w2: a row of x a pair) and without (w13: a row of x a
   token, read by its top_k pairs), added into y or stored; the dense op's kernels are what
   ran;
3. version 8 takes them from its threshold of pairs a (slot, expert) on, version 6's below;
   version 9 the row kernels on the pairs below it (the op itself against the reference at
   every version: ``tests/test_moe.py``).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import launch, reference
from punica_numba._checks import check_stack
from punica_numba.kernels.moe_claims import CLAIM_THREADS
from punica_numba.kernels.moe_pairs import pairs_threads
from punica_numba.kernels.shrink_mma import build_mma_shrink_kernel
from punica_numba.launch import LaunchConfig, force_launch_config
from punica_numba.moe_meta import align_pairs
from punica_numba.ops import moe as moe_ops
from punica_numba.ops import moe_dense
from punica_numba.ops.choice import choose_shrink
from punica_numba.ops.moe import fused_moe_lora
from punica_numba.ops.moe_dense import TILE_M, claimed_pairs, moe_pairs, moe_tiles

from .strategies import DEVICE, LARGE
from .test_moe import MOE_EXAMPLES, MoECase, check_against_reference


def tiles_by_loops(blocks, enabled, block_size, num_pairs, num_experts):
    """:func:`moe_tiles` as its docstring defines it, one tile at a time on the host: the
    blocks in use, slot by slot, then idle rows up to the bound of any alignment."""
    ids, experts, padded = (t.cpu().tolist() for t in blocks)
    enabled = enabled.cpu().tolist()
    per_block, row_blocks = -(-block_size // TILE_M), len(experts[0])
    bound = min(num_pairs, len(ids) * row_blocks)  # (a block in use holds a pair)
    table, tokens = [], []
    for l, row in enumerate(ids):
        if enabled[l] == 0:  # (a slot turned off has no blocks in use)
            continue
        for b in range(min(row_blocks, -(-max(padded[l], 0) // block_size))):
            e = experts[l][b]
            for j in range(per_block):
                lo, hi = (
                    b * block_size + TILE_M * j,
                    b * block_size + min(TILE_M * (j + 1), block_size),
                )
                pairs = [p for p in row[lo:hi] if 0 <= p < num_pairs]
                if 0 <= e < num_experts and pairs:
                    table.append([l * num_experts + e, TILE_M * len(table), len(pairs), pairs[0]])
                    tokens.append(pairs + [pairs[-1]] * (TILE_M - len(pairs)))
                else:
                    table.append([-1, 0, 0, 0])
                    tokens.append([0] * TILE_M)
    assert len(table) <= bound * per_block, "the bound is too small for this alignment"
    idle = bound * per_block - len(table)
    return table + [[-1, 0, 0, 0]] * idle, tokens + [[0] * TILE_M] * idle


def check_claimed_pairs(got, blocks, enabled, block_size, num_pairs, num_experts):
    """:func:`claimed_pairs`' table and tokens ``got`` against its docstring, one entry at a
    time on the host: each run's named pairs (of metadata that names no pair twice) in
    consecutive rows in their order, every row's number its own, the rows past them idle."""
    ids, experts, padded = (t.cpu().tolist() for t in blocks)
    enabled = enabled.cpu().tolist()
    table, tokens = (t.cpu().tolist() for t in got)
    runs = []  # each run's named pairs' rows, as (l * E + e, p)
    for l, row in enumerate(ids):
        in_use = min(len(row), -(-max(padded[l], 0) // block_size) * block_size)
        for start in range(0, len(row), CLAIM_THREADS):
            run = []
            for q in range(start, min(start + CLAIM_THREADS, in_use if enabled[l] else 0)):
                e, p = experts[l][q // block_size], row[q]
                if 0 <= e < num_experts and 0 <= p < num_pairs:
                    run.append([l * num_experts + e, p])
            runs += [run] if run else []
    named = sum(len(run) for run in runs)
    assert table[named:] == [[-1, 0, 0, 0]] * (num_pairs - named)
    assert tokens[named:] == [0] * (num_pairs - named)
    assert [row[1:3] for row in table[:named]] == [[i, 1] for i in range(named)]
    assert tokens[:named] == [row[3] for row in table[:named]]
    placed = [[slot, p] for slot, _, _, p in table[:named]]
    firsts = sorted((placed.index(run[0]), run) for run in runs)  # (each p is named once)
    assert [pair for _, run in firsts for pair in run] == placed


def pairs_by_loops(blocks, enabled, block_size, num_pairs, num_experts):
    """:func:`moe_pairs` as its docstring defines it, one pair at a time on the host."""
    ids, experts, padded = (t.cpu().tolist() for t in blocks)
    enabled = enabled.cpu().tolist()
    table, tokens = [], []
    for l, row in enumerate(ids):
        if enabled[l] == 0:
            continue
        for b in range(min(len(experts[l]), -(-max(padded[l], 0) // block_size))):
            e = experts[l][b]
            if not 0 <= e < num_experts:
                continue
            for p in row[b * block_size : (b + 1) * block_size]:
                if 0 <= p < num_pairs:
                    table.append([l * num_experts + e, len(table), 1, p])
                    tokens.append(p)
    table, tokens = table[:num_pairs], tokens[:num_pairs]
    idle = num_pairs - len(table)
    return table + [[-1, 0, 0, 0]] * idle, tokens + [0] * idle


@settings(max_examples=min(settings().max_examples, 30))
@given(
    st.integers(1, 3),  # slots
    st.integers(1, 5),  # experts
    st.sampled_from((1, 3, 16, 20)),  # block size
    st.integers(0, 12),  # tokens
    st.integers(0, 2**31 - 1),  # seed
    st.sampled_from((torch.int32, torch.bool)),  # adapter_enabled's flags
    st.integers(0, 4),  # experts that are not local (expert parallelism), at most all but one
    st.booleans(),  # the align step told which slots are off (else their pairs take blocks)
)
def test_the_blocks_as_the_dense_tile_table(
    slots, experts, block_size, tokens, seed, flags, remote, aligned_knowing
):
    """On drawn routings, with and without expert parallelism: the align step over every
    expert, ``expert_map`` naming the local ones, and the tiles over the local ones (whose
    count is the stacks', while the other experts' runs take blocks of -1); and the pairs of
    the same blocks as one-token tiles. The align step is told which slots are off, or not
    (their pairs then sit in blocks that the tiles and the pairs skip)."""
    gen = torch.Generator().manual_seed(seed)
    local = max(1, experts - remote)
    top_k = min(2, experts)
    topk_ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    for t in range(tokens):  # distinct experts a token, as a router picks them
        topk_ids[t] = torch.randperm(experts, generator=gen)[:top_k]
    topk_ids[torch.rand(tokens, top_k, generator=gen) < 0.1] = -1
    token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
    enabled = (torch.rand(slots, generator=gen) < 0.8).to(flags)
    expert_map = torch.full((experts,), -1, dtype=torch.int64)  # global -> local, -1 remote
    expert_map[torch.randperm(experts, generator=gen)[:local]] = torch.arange(local)
    told = enabled if aligned_knowing else torch.ones_like(enabled)
    blocks = align_pairs(
        topk_ids.to(DEVICE), token_slots.to(DEVICE), experts, block_size, slots,
        told.to(DEVICE), expert_map=expert_map.to(DEVICE) if local < experts else None,
    )  # fmt: skip
    num_pairs = tokens * top_k
    table, rows = moe_tiles(*blocks, enabled.to(DEVICE), block_size, num_pairs, local)
    want_table, want_rows = tiles_by_loops(blocks, enabled, block_size, num_pairs, local)
    assert table.dtype == rows.dtype == torch.int32
    assert table.cpu().tolist() == want_table
    assert rows.cpu().tolist() == want_rows
    # Each pair of a token with an adapter that is on, and a local expert, in one live tile
    # once.
    live = [t[:n] for (s, _, n, _), t in zip(want_table, want_rows) if s >= 0]
    routed = [
        t * top_k + k
        for t in range(tokens)
        for k in range(top_k)
        if topk_ids[t, k] >= 0
        and expert_map[topk_ids[t, k]] >= 0
        and token_slots[t] >= 0
        and enabled[token_slots[t]] != 0
    ]
    assert sorted(p for pairs in live for p in pairs) == routed
    # The same pairs, a tile each, in the tiles' order.
    pair_table, pair_tokens = moe_pairs(*blocks, enabled.to(DEVICE), block_size, num_pairs, local)
    want_table, want_tokens = pairs_by_loops(blocks, enabled, block_size, num_pairs, local)
    assert pair_table.dtype == pair_tokens.dtype == torch.int32
    assert pair_table.cpu().tolist() == want_table
    assert pair_tokens.cpu().tolist() == want_tokens
    assert [p for pairs in live for p in pairs] == [p for s, _, _, p in want_table if s >= 0]
    # The same pairs again, packed by runs that claim their rows (version 14's table).
    got = claimed_pairs(*blocks, enabled.to(DEVICE), block_size, num_pairs, local)
    assert got[0].dtype == got[1].dtype == torch.int32
    check_claimed_pairs(got, blocks, enabled, block_size, num_pairs, local)
    live = sorted([s, p] for s, _, _, p in got[0].cpu().tolist() if s >= 0)
    assert live == sorted([s, p] for s, _, _, p in want_table if s >= 0)


@st.composite
def dense_moe_cases(draw) -> MoECase:
    """A drawn call (:class:`tests.test_moe.MoECase`) whose kernels the tensor cores take:
    16-bit dtypes, K a multiple of 8, the rank of 4, widths of 8 and the offset of 4 (y's
    rows are then read and written in words); on the simulator block sizes below, at and
    past a tile of 16."""
    case = MoECase(draw)
    case.dtype = draw(st.sampled_from((torch.bfloat16, torch.float16)), label="dtype")
    case.offset = 4 * draw(st.integers(0, 1), label="offset / 4")
    if not LARGE:
        case.r = 4 * draw(st.integers(1, 2), label="r / 4")
        case.K = 8 * draw(st.integers(1, 2), label="K / 8")
        case.N = 8 * draw(st.integers(1, 2), label="N / 8")
        case.B = draw(st.sampled_from((2, 3, 16, 20)), label="block_size")
    return case


@MOE_EXAMPLES
@given(case=dense_moe_cases())
def test_version_7_matches_the_reference(case):
    ran = []

    def recorded(real):
        def recording(*args):
            ran.append((real.__name__, real(*args)))
            return ran[-1][1]

        return recording

    d = case.data()
    width = case.offset + case.S * case.N + 4  # (whole 8-byte words of 16-bit values a row)
    d["y"] = torch.randn(case.M, case.top_k, width, device=DEVICE).to(case.dtype)
    blocks = align_pairs(d["topk_ids"], d["slots"], case.E, case.B, case.L, d["enabled"])
    y, before = d["y"], d["y"].clone()
    shrink, expand = recorded(moe_ops.dense_shrink), recorded(moe_ops.dense_expand)
    with mock.patch.multiple(moe_ops, dense_shrink=shrink, dense_expand=expand):
        fused_moe_lora(
            y, d["x"], d["lora_a"], d["lora_b"], d["topk_weights"], *blocks, d["enabled"],
            block_size=case.B, mul_routed_weight=case.mul, offset=case.offset,
            add_inputs=case.add_inputs, version=7,
        )  # fmt: skip
    check_against_reference(case, y, d, before)
    assert ran == [("dense_shrink", True), ("dense_expand", True)], ran  # the dense op's kernels


def _small_call(dtype, mul_routed_weight: bool, block_size: int, version: int = 7):
    """One fixed call (5 tokens, top-2 of 3 experts, 2 slots, K = N = 8, r = 4): y after it
    and the reference's."""
    gen = torch.Generator().manual_seed(3)
    M, top_k, E, L, K, N, r = 5, 2, 3, 2, 8, 8, 4

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    topk_ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], device=DEVICE)
    slots = torch.tensor([0, 1, 1, -1, 0], device=DEVICE)
    enabled = torch.ones(L, dtype=torch.int32, device=DEVICE)
    x = randn(M * top_k if mul_routed_weight else M, K)
    a, b = [randn(L, E, r, K)], [randn(L, E, N, r)]
    weights = torch.rand(M, top_k, generator=gen).to(DEVICE)
    y = randn(M, top_k, N)
    before = y.clone()
    blocks = align_pairs(topk_ids, slots, E, block_size, L, enabled)
    fused_moe_lora(
        y, x, a, b, weights, *blocks, enabled, block_size=block_size,
        mul_routed_weight=mul_routed_weight, version=version,
    )  # fmt: skip
    want = reference.fused_moe_lora(
        before, x, a, b, topk_ids, weights, slots, mul_routed_weight=mul_routed_weight,
        adapter_enabled=enabled,
    )  # fmt: skip
    return y, want


@pytest.mark.parametrize("block_size", [2, 16])
def test_each_pair_of_a_token_reads_the_tokens_row_of_x(block_size):
    """w13 (no router weights): a row of x a token, read by each of its top-2 pairs."""
    y, want = _small_call(torch.bfloat16, False, block_size)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_version_7_without_the_tensor_cores_takes_version_6s_expand():
    """fp32 B and y: the dense tensor-core kernels decline, and the call is still right
    (version 6's kernels, the router's weights already in the buffer not taken twice)."""
    y, want = _small_call(torch.float32, True, 2)
    torch.testing.assert_close(y, want.to(y.dtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dense_from, dense", [(1, True), (2, False)])
def test_version_8_takes_version_7s_kernels_from_its_threshold(dense_from, dense, monkeypatch):
    """The small call (w2, bf16: 10 pairs over 2 slots of 3 experts, 1.67 a (slot, expert))
    at version 8, with DENSE_FROM_PAIRS at 1 or 2: version 7's tiles and dense kernels from
    it on, version 6's below it. Each gives the reference."""
    monkeypatch.setattr(moe_ops, "DENSE_FROM_PAIRS", dense_from)
    tiles = mock.Mock(wraps=moe_ops.moe_tiles)
    shrink = mock.Mock(wraps=moe_ops.dense_shrink)
    with mock.patch.multiple(moe_ops, moe_tiles=tiles, dense_shrink=shrink):
        y, want = _small_call(torch.bfloat16, True, 16, version=8)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (tiles.call_count, shrink.call_count) == ((1, 1) if dense else (0, 0))


@pytest.mark.parametrize("version, dense", [(11, False), (12, True)])
def test_version_12_takes_the_tiles_where_11_takes_version_6s_kernels(version, dense, monkeypatch):
    """The small call (1.67 pairs a (slot, expert)) with MMA_SHRINK_FROM_PAIRS and
    TILES_FROM_PAIRS at 1, DENSE_FROM_PAIRS as shipped (16): version 12 takes the dense op's
    tiles there, version 11 version 6's kernels. Each gives the reference."""
    monkeypatch.setattr(moe_ops, "MMA_SHRINK_FROM_PAIRS", 1)
    monkeypatch.setattr(moe_ops, "TILES_FROM_PAIRS", 1)
    tiles = mock.Mock(wraps=moe_ops.moe_tiles)
    shrink = mock.Mock(wraps=moe_ops.dense_shrink)
    with mock.patch.multiple(moe_ops, moe_tiles=tiles, dense_shrink=shrink):
        y, want = _small_call(torch.bfloat16, True, 16, version=version)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (tiles.call_count, shrink.call_count) == ((1, 1) if dense else (0, 0))


@pytest.mark.parametrize("table", [moe_tiles, moe_pairs, claimed_pairs])
def test_the_tiles_of_blocks_off_the_kernels_device_are_refused_before_a_launch(table):
    """Blocks where the kernels cannot read them (on a GPU a host pointer would be an illegal
    address, and the context lost) are a ValueError naming them."""
    meta = dict(dtype=torch.int32, device="meta")
    blocks = torch.empty(1, 16, **meta), torch.empty(1, 1, **meta), torch.empty(1, **meta)
    with pytest.raises(ValueError, match="sorted_token_ids"):
        table(*blocks, torch.ones(1, dtype=torch.int32), 16, 4, 2)


def test_a_pair_named_twice_takes_no_row_past_p():
    """Metadata that names pair 0 twice among P = 2 pairs: the rows are P, each a pair in
    the blocks' order (0, 1, then 0 again, which has no row); none idle."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[0, 1, 0, 2]], **i32)  # (2 is padding)
    table, tokens = moe_pairs(ids, torch.tensor([[1, 0]], **i32), torch.tensor([4], **i32),
                              torch.ones(1, **i32), 2, 2, 2)  # fmt: skip
    assert table.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1]]
    assert tokens.tolist() == [0, 1]


def test_the_blocks_past_num_tokens_post_padded_hold_no_pair_of_the_table():
    """Entries naming pairs past a slot's count of padded entries (stale or foreign): their
    blocks are not in use, so the pairs have no row, and the rows past the others are idle."""
    i32 = dict(dtype=torch.int32, device=DEVICE)
    ids = torch.tensor([[0, 4, 1, 2], [3, 4, 4, 4]], **i32)  # (4 is padding)
    experts = torch.tensor([[1, 0], [0, 1]], **i32)
    table, tokens = moe_pairs(ids, experts, torch.tensor([2, 3], **i32),
                              torch.ones(2, **i32), 2, 4, 2)  # fmt: skip
    assert table.tolist() == [[1, 0, 1, 0], [2, 1, 1, 3], [-1, 0, 0, 0], [-1, 0, 0, 0]]
    assert tokens.tolist() == [0, 3, 0, 0]


def test_the_pairs_kernel_takes_a_warp_or_more_up_to_the_blocks_in_use():
    """Its threads: a power of two from 32 that holds every block the call's pairs can use
    (at most P, at most NB a slot), up to the most."""
    assert pairs_threads(8, 16, 135, most=1024) == 32  # one token of top-8
    assert pairs_threads(100, 2, 40, most=1024) == 128  # 80 blocks at most
    assert pairs_threads(16384, 16, 1143, most=1024) == 1024
    assert pairs_threads(8, 16, 135, most=4) == 4  # (the simulator's)


@pytest.mark.gpu
def test_more_blocks_in_use_than_the_pairs_kernels_threads_take_rounds():
    """On a GPU the pairs kernel is one CUDA block of 1024 threads: some 3,000 blocks in use of
    0 to 2 pairs each (three slots, the second turned off, a few experts -1), in blocks of 4,
    take rounds of its running sum; the table and the tokens against the definition. And
    version 14's table of the same pairs, claimed by runs of 256 entries (the simulator's are
    a few)."""
    gen = torch.Generator().manual_seed(5)
    L, NB, bs, E = 3, 1500, 4, 64
    counts = torch.randint(0, 3, (L, NB), generator=gen)
    P = int(counts.sum())
    ids = torch.full((L, NB * bs), P, dtype=torch.int32)
    order = torch.randperm(P, generator=gen).tolist()
    for (l, b), c in zip(((l, b) for l in range(L) for b in range(NB)), counts.view(-1).tolist()):
        for j in range(c):
            ids[l, b * bs + j] = order.pop()
    experts = torch.randint(-1, E, (L, NB), generator=gen, dtype=torch.int32)
    padded = torch.tensor([NB * bs, NB * bs, NB * bs - 5], dtype=torch.int32)
    enabled = torch.tensor([1, 0, 1], dtype=torch.int32)
    blocks = tuple(t.to(DEVICE) for t in (ids, experts, padded))
    table, tokens = moe_pairs(*blocks, enabled.to(DEVICE), bs, P, E)
    want_table, want_tokens = pairs_by_loops(blocks, enabled, bs, P, E)
    assert table.cpu().tolist() == want_table
    assert tokens.cpu().tolist() == want_tokens
    check_claimed_pairs(claimed_pairs(*blocks, enabled.to(DEVICE), bs, P, E), blocks, enabled,
                        bs, P, E)  # fmt: skip


@pytest.mark.parametrize("version", [9, 14])
@pytest.mark.parametrize("mma_from, dense", [(1, True), (2, False)])
def test_version_9_takes_the_row_kernels_below_the_threshold(mma_from, dense, version, monkeypatch):
    """The small call (w2, bf16: 1.67 pairs a (slot, expert)) at version 9, with
    MMA_SHRINK_FROM_PAIRS at 1 or 2 (and DENSE_FROM_PAIRS at 1): version 8's kernels from it
    on (here version 7's tiles and kernels); below it the pairs as one-token tiles and the
    dense op's row kernels. Each gives the reference. Version 14 (its one launch and its
    tiles' threshold moved out of the way) the same, but its table of the pairs is
    :func:`claimed_pairs`' two launches, not :func:`moe_pairs`' one."""
    monkeypatch.setattr(moe_ops, "MMA_SHRINK_FROM_PAIRS", mma_from)
    monkeypatch.setattr(moe_ops, "DENSE_FROM_PAIRS", 1)
    monkeypatch.setattr(moe_ops, "TILES_FROM_PAIRS", mma_from)
    monkeypatch.setattr(moe_ops, "ONE_LAUNCH_TO_PAIRS", 0)
    launched = []
    real = moe_dense.launcher_of

    def recording(kernel):
        launched.append(getattr(kernel, "__name__", None) or kernel.py_func.__name__)
        return real(kernel)

    spies = {name: mock.Mock(wraps=getattr(moe_ops, name)) for name in
             ("moe_tiles", "moe_pairs", "claimed_pairs", "row_shrink", "row_expand")}  # fmt: skip
    monkeypatch.setattr(moe_dense, "launcher_of", recording)
    with mock.patch.multiple(moe_ops, **spies):
        y, want = _small_call(torch.bfloat16, True, 16, version=version)
    torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
    names = ("moe_tiles", "moe_pairs", "claimed_pairs", "row_shrink")
    counts = [spies[name].call_count for name in names]
    pairs = [0, 1, 0, 1] if version < 14 else [0, 0, 1, 1]  # (moe_pairs, or claimed_pairs)
    assert counts == ([1, 0, 0, 0] if dense else pairs), counts
    assert spies["row_expand"].call_count == (0 if dense else 1)
    if not dense:  # the table's kernel(s), the row shrink, then a row or lane-split expand
        kernels = ["pairs"] if version < 14 else ["idle", "claim"]
        assert launched[: len(kernels) + 2] == [*kernels, "shrink", "expand"], launched


@pytest.mark.parametrize("block_size", [2, 16])
@pytest.mark.parametrize("mul_routed_weight", [False, True], ids=["w13", "w2"])
def test_version_14_stores_version_13s_bits_on_the_pairs_path(mul_routed_weight, block_size,
                                                              monkeypatch):  # fmt: skip
    """The small call (1.67 pairs a (slot, expert)) on the pairs path (the one launch moved
    aside): versions 13 and 14 run the same row kernels on the same pairs, in rows of another
    order, and each pair's sums do not depend on its row: the same bits."""
    monkeypatch.setattr(moe_ops, "ONE_LAUNCH_TO_PAIRS", 0)
    stored = {}
    for version in (13, 14):
        y, want = _small_call(torch.bfloat16, mul_routed_weight, block_size, version=version)
        torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-2)
        stored[version] = y.view(torch.int16)
    assert torch.equal(stored[13], stored[14])


def test_x_rows_and_row_scaled_take_only_the_row_shrink_of_one_token_tiles():
    """Pairs that share a row of x (w13's) read it by ``t // x_rows``, and the router's
    weights go in as a factor a row (``row_scaled``), in the row shrink of one-token tiles
    only: any other configuration with either is refused (the tensor-core shrink has builds
    of its own, which refuse ``row_scaled`` where they add instead of store)."""
    x = torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE)
    a = check_stack("a", torch.zeros(1, 4, 8, dtype=torch.bfloat16, device=DEVICE))
    buffer = torch.zeros(1, 4, 4, dtype=torch.float32, device=DEVICE)
    for config in (LaunchConfig("rows", 16, 4, 4), LaunchConfig("mma", 64, 16, 8)):
        with pytest.raises(ValueError, match="x_rows"):
            choose_shrink(x, [a], buffer, None, False, config=config, x_rows=2)
    rows = LaunchConfig("rows", 16, 1, 4, spread=False)
    assert choose_shrink(x, [a], buffer, None, False, config=rows, x_rows=2).config == rows
    with pytest.raises(ValueError, match="row_scaled"):  # a factor a row: the same kernel only
        choose_shrink(x, [a], buffer, None, False, config=LaunchConfig("rows", 16, 4, 4),
                      row_scaled=True)  # fmt: skip
    with pytest.raises(ValueError, match="row_scaled"):  # (a kernel that stores)
        build_mma_shrink_kernel(torch.bfloat16, torch.float32, 32, 1, 1, True, row_scaled=True)


@pytest.mark.parametrize("x_rows", [1, 2])
@pytest.mark.parametrize("shrink", ["row_shrink", "dense_shrink"])
def test_the_router_weights_in_a_shrink_are_a_multiply_of_its_rows(shrink, x_rows):
    """The row shrink (on the pairs) and the dense tensor-core shrink (on the tiles), given
    the router's weights, store each pair's products times its weight: the bits of the same
    shrink without them and the buffer multiplied after (the launch version 9 spares at w2).
    6 pairs over 2 slots of 2 experts in blocks of 2; the pairs the blocks do not name keep
    the buffer's old rows."""
    gen = torch.Generator().manual_seed(11)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    P, E, r, K = 6, 2, 4, 16
    ids = torch.tensor([[0, 3, 2, 6], [1, 5, 6, 6]], **i32)  # (6 is padding; pair 4 unnamed)
    blocks = (ids, torch.tensor([[1, 0], [0, -1]], **i32), torch.tensor([4, 4], **i32))
    table = moe_pairs if shrink == "row_shrink" else moe_tiles
    work = table(*blocks, torch.ones(2, **i32), 2, P, E)
    x = torch.randn(P // x_rows, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    a = [torch.randn(2, E, r, K, generator=gen).to(torch.bfloat16).to(DEVICE)]
    router = (torch.rand(P, generator=gen) + 0.5).to(DEVICE)
    plain = torch.full((1, P, r), 7.0, device=DEVICE)
    folded = plain.clone()
    run = getattr(moe_dense, shrink)
    assert run(plain, x, a, work, x_rows, 1.5) is not False  # (False: the tensor cores declined)
    run(folded, x, a, work, x_rows, 1.5, router)
    named = torch.tensor([0, 1, 2, 3, 5])
    want = plain[:, named] * router[named].view(1, -1, 1)
    assert torch.equal(folded[:, named], want)
    assert (folded[:, 4] == 7.0).all()
    assert not torch.equal(folded[:, named], plain[:, named])  # (the weights are not all 1)


def test_the_tiles_shrink_is_built_with_its_configurations_passes_ahead(monkeypatch):
    """A tensor-core shrink of two passes of loads ahead, forced on the tiles, is built with
    two (until a4b8600 every tiles shrink was built with one, so ``tune --moe`` timed
    ``mma_t256_m16_n0_a2`` as its one-pass twin), and stores the one-pass build's bits: the
    same chunks of K in the same order. 6 pairs over 2 slots of 2 experts in blocks of 2,
    K = 456 (15 chunks of 32, the last partly past K), a rank of 4; on the GPU its own
    twins."""
    gen = torch.Generator().manual_seed(5)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    P, E, r, K = 6, 2, 4, 456
    ids = torch.tensor([[0, 3, 2, 6], [1, 5, 4, 6]], **i32)  # (6 is padding)
    blocks = (ids, torch.tensor([[1, 0], [0, 1]], **i32), torch.tensor([4, 4], **i32))
    tiles = moe_tiles(*blocks, torch.ones(2, **i32), 2, P, E)
    x = torch.randn(P, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    a = [torch.randn(2, E, r, K, generator=gen).to(torch.bfloat16).to(DEVICE)]
    ones = [c for c in launch.launch_configs("shrink") if moe_dense._shrink_runs(c, rank=r)]
    one = next(c for c in ones if c.ahead == 1)
    two = dataclasses.replace(one, ahead=2, tuned_only=True)
    if two not in ones:  # (this machine's table has no such twin: lend it one)
        table = launch.launch_configs("shrink") + (two,)
        machine = "_SIMULATOR_CONFIGS" if launch.SIMULATOR else "_GPU_CONFIGS"
        monkeypatch.setattr(launch, machine, dict(getattr(launch, machine), shrink=table))
    built = []

    def recording(*args, **kwargs):
        built.append(kwargs.get("ahead", 1))
        return build_mma_shrink_kernel(*args, **kwargs)

    monkeypatch.setattr(moe_dense, "build_mma_shrink_kernel", recording)
    stored = []
    for config in (one, two):
        buffer = torch.full((1, P, r), 7.0, device=DEVICE)
        with force_launch_config("shrink", config):
            assert moe_dense.dense_shrink(buffer, x, a, tiles, 1, 1.5)
        stored.append(buffer)
    assert built == [1, 2]
    assert torch.equal(stored[0], stored[1])
    owner = {0: (0, 1), 3: (0, 1), 2: (0, 0), 1: (1, 0), 5: (1, 0), 4: (1, 1)}  # p: (l, e)
    want = torch.stack([x[p].double() @ a[0][owner[p]].double().T for p in range(P)])
    torch.testing.assert_close(stored[1][0].double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
def test_a_block_of_more_than_16_pairs_is_tiles_of_16(block_size):
    """A block's pairs fill tiles of 16 in order: 20 pairs of one (slot, expert) in blocks of
    32 make one block, tiles of 16 and 4; in blocks of 16, two blocks of a tile each."""
    P = 20
    i32 = dict(dtype=torch.int32, device=DEVICE)
    ids = torch.arange(32, **i32).clamp(max=P).view(1, 32)  # 0..19, then P
    experts = torch.tensor([[1] if block_size == 32 else [1, 1]], **i32)
    padded = torch.tensor([32], **i32)
    on = torch.ones(1, **i32)
    table, rows = moe_tiles(ids, experts, padded, on, block_size, P, 2)
    assert table[:, 2].tolist() == [16, 4]
    assert table[:, 0].tolist() == [1, 1]
    assert rows[1].tolist() == [16, 17, 18, 19] + [19] * 12
