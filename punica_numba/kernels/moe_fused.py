"""MoE LoRA in one launch: a CUDA block shrinks its block's pairs and expands them itself.

Where each (slot, expert) has a pair or two, the op's time is mostly waiting: at one token
of top-8 the table of pairs, the shrink and the expand of version 9 take about 2 µs each
on an H100 (lab notes, "The pairs path launch by launch"). Each pair's delta depends only on
its own block's A and B, so nothing needs another block's results: one CUDA block can take
a block of pairs from its entries to its rows of y, with the buffer between the two
products in shared memory. No table of pairs, no buffer in global memory, one launch.

Work split:

* ``blockIdx.x`` (and ``blockIdx.y``): block b of the metadata's row l (``compact``: a
  block in use found by the walk over the slots, :func:`.moe_blocks.unit_walker`, units
  ``x, x + gridDim.x, ...`` as in version 6; else b = ``blockIdx.x`` of row ``blockIdx.y``,
  the CUDA blocks past the row's blocks in use leaving at once);
* ``blockIdx.z``: the slice s and a group of ``THREADS * VEC`` output columns, ``z = s * G
  + g`` (:func:`.moe_blocks.slice_and_group`): each CUDA block of a slice does that
  slice's shrink again (its rows of A from L2 after the first), so that one token's few
  blocks still spread over many SMs.

A CUDA block takes its block's pairs in chunks of ``TILE_P``:

1. the chunk's entries (every thread reads them, :func:`.moe_blocks.chunk_reader`); for
   the first chunk the block's expert is looked up in the same trip to memory;
2. the loads that need only those: each thread's ``VEC`` columns of ``B_s[l, e]`` (once a
   block, as words, kept in registers), its old outputs and the pairs' router weights (w2),
   issued before the shrink so that they arrive while it runs;
3. the shrink of the chunk's rows of x by ``A_s[l, e]``: the warps go in teams of
   ``SPLITS``, a team taking ``TILE_N`` neighbouring ranks at a time (team t ranks ``(t +
   TEAMS g) TILE_N ..``) and its warps' lanes splitting K between them (word k to lane ``k
   % (32 SPLITS)``, :func:`.moe_shrink_split.chunk_sums`); each warp adds its lanes'
   partials by shuffles, no barrier between its steps, and its lane 0 puts the sums into
   the shared ``parts[SPLITS, TILE_P, r]`` fp32, a row for each warp of the team;
4. after one barrier, each thread's columns for the chunk's pairs: the pair's row of the
   buffer, its team's parts added in order (broadcasts from shared memory), against the
   column's row of B, in rank order, times the router weight (w2), plus the old output,
   stored.

Each warp's loads of a rank's row are a chain of ``K / (32 SPLITS UNROLL)`` trips to memory
(a step's FMAs wait for its loads, and the next step's loads follow them): at
Qwen3-30B-A3B's w13 (K = 2048, 512 words) eight with one warp a rank and two strides of
loads at once. Splitting K across warps shortens the chain; splitting the ranks gives each
warp fewer rows to hold.

Deterministic: every output is stored by one thread, once, its sums in an order fixed by
the build. Padding (an entry ``>= P``) reads row 0 of x and of y, in bounds, and stores
nothing. The simulator has no shuffles: there a warp is :data:`LANES` threads whose
partials go through shared memory, added in the butterfly's order.

Memory traffic per CUDA block in use: ``r * K`` of A (the slice's, once a chunk, from L1
after the first), the chunk's rows of x, ``THREADS * VEC * r`` of B once, and the pairs'
``THREADS * VEC`` outputs read and written; a slice's ``G`` column groups each read A and x.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader
from .moe_blocks import block_in_use, chunk_reader, slice_and_group, unit_walker
from .moe_shrink_split import chunk_sums

__all__ = ["LANES", "build_moe_fused_kernel"]

#: The lanes that split K for a rank: a warp's 32 on the GPU; on the simulator, where a
#: warp of shuffles is a loop through shared memory, 4 (so that test blocks hold warps).
LANES = 4 if SIMULATOR else 32


@functools.cache
def build_moe_fused_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_n: int,
    tile_p: int,
    unroll: int,
    splits: int,
    vec: int,
    rank: int,
    packed_xa: bool,
    packed_b: bool,
    weighted: bool,
    add_inputs: bool,
    compact: bool,
    slots_at_once: int,
):
    """The kernel ``moe_fused(x, a0, a1, b0, b1, out, weights, sorted_ids, expert_ids,
    num_post_pad, enabled, top_k, block_size, by_pair, offset)``, specialised on the dtype
    of x, A and B and of the output, the threads per CUDA block (whole teams of ``splits``
    warps of :data:`LANES`), the ranks (``tile_n``) and pairs (``tile_p``) of one step of a
    team's sums, the strides of K whose loads go out together (``unroll``), the warps of a
    team, which split a rank's K (``splits``), the columns a thread owns (``vec``), the
    rank, whether x and A,
    and B, arrive as packed int64 words, the router's weight (``weighted``),
    ``add_inputs``, the grid (``compact``) and the slots its walk reads at once.

    They must be constants: they size the registers and shared arrays and the loops over
    them, which Numba unrolls only when their trip counts are known.
    """
    if threads % (LANES * splits):
        raise ValueError(f"threads must be whole teams of {splits} warps of {LANES}, got {threads}")
    PACK_B = packing(dtype, packed_b)
    if rank % PACK_B:
        raise ValueError(f"packed rows of B take a rank that is a multiple of {PACK_B}, got {rank}")
    unit_of = unit_walker(slots_at_once)
    read_chunk = chunk_reader(tile_p)
    TEAM = LANES * splits  # the threads that split a rank's K
    add_chunk, X_WORDS, A_WORDS = chunk_sums(dtype, packed_xa, TEAM, tile_n, tile_p, unroll)
    THREADS, TILE_N, TILE_P, VEC, RANK, SPLITS = threads, tile_n, tile_p, vec, rank, splits
    TEAMS = THREADS // TEAM
    GROUPS = -(-RANK // (TEAMS * TILE_N))  # a team's steps over the rank
    PARTIALS = TILE_P * TILE_N  # a step's sums: partial[i * TILE_N + j]
    STEPS = LANES.bit_length() - 1  # of the lanes' butterfly
    SHUFFLE = not SIMULATOR
    FULL_MASK = 0xFFFFFFFF
    XA_WORD, B_WORD = memory_type(dtype, packed_xa), memory_type(dtype, packed_b)
    load_b = word_loader(dtype, packed_b)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    WORDS = RANK // PACK_B  # words in a row of B
    SPAN = min(32, threads)  # a warp's neighbouring columns (the simulator's blocks are small)
    GROUP = THREADS * VEC  # columns a CUDA block owns
    B_WORDS, OLD = VEC * WORDS, TILE_P * VEC  # a thread's words of B, its old outputs
    WEIGHTED, ADD_INPUTS, COMPACT = weighted, add_inputs, compact
    begin = prologue()

    @jit_kernel(THREADS)
    def moe_fused(
        x, a0, a1, b0, b1, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, top_k,
        block_size, by_pair, offset,
    ):  # fmt: skip
        # x: [M or P, K/PACK] words; a*: [L, E, r, K/PACK] words; b*: [L, E, N, r/PACK_B]
        # words; out: [P, W], slice s at offset + s * N; weights: [P] fp32 (WEIGHTED);
        # sorted_ids: [L, EM]; expert_ids: [L, NB]; num_post_pad: [L]; enabled: [>= L]
        begin()  # wait for the kernels before this one (dependent_launch)
        width = b0.shape[2]
        s, n_first = slice_and_group(width, GROUP)  # the slice, the group's first column
        a = a0 if s == 0 else a1
        b = b0 if s == 0 else b1
        column0 = offset + s * width
        num_pairs = out.shape[0]
        tid = cuda.threadIdx.x
        lane, warp = tid % LANES, tid // LANES
        team, member = tid // TEAM, warp % SPLITS  # (member: the warp's place in its team)
        k_first = lane + LANES * member  # the thread's first word of K in its team

        pair_of = cuda.local.array(TILE_P, int64)  # the chunk's pairs, -1: none
        rows = cuda.local.array(TILE_P, int64)  # and the rows of x they read
        column = cuda.local.array(VEC, int64)  # the thread's columns, clamped into the slice
        b_words = cuda.local.array(B_WORDS, B_WORD)  # b_words[c * WORDS + k]
        old = cuda.local.array(OLD, float32)  # old[i * VEC + c]
        weight = cuda.local.array(TILE_P, float32)  # the chunk's router weights (WEIGHTED)
        partial = cuda.local.array(PARTIALS, float32)
        xw = cuda.local.array(X_WORDS, XA_WORD)
        aw = cuda.local.array(A_WORDS, XA_WORD)
        xv = cuda.local.array(TILE_P, float32)
        lanes = cuda.shared.array((1 if SHUFFLE else THREADS, PARTIALS), float32)
        parts = cuda.shared.array((SPLITS, TILE_P, RANK), float32)  # each warp's of a team

        mine = (tid // SPAN) * SPAN * VEC + tid % SPAN  # the thread's first column in a group
        for c in range(VEC):  # columns n_first + mine + SPAN * c: a warp's are neighbours
            column[c] = min(n_first + mine + SPAN * c, width - 1)  # past the slice: not stored

        v = cuda.blockIdx.x
        while True:  # compact: the units v, v + gridDim.x, ... (one, where the grid is the bound)
            if COMPACT:
                slot, block = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, 1)
                if slot == -1:
                    break
                if v != cuda.blockIdx.x:
                    cuda.syncthreads()  # the unit before's readers of the buffer are done
            else:
                slot, block = cuda.blockIdx.y, cuda.blockIdx.x
            start = block * block_size
            pairs = min(block_size, sorted_ids.shape[1] - start)
            # The first chunk's entries and the block's expert: one trip to memory.
            any_pair = read_chunk(pair_of, sorted_ids, slot, start, 0, pairs, num_pairs)
            _, _, expert = block_in_use(
                block, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids,
                a.shape[1],
            )  # fmt: skip
            if expert != -1:
                for c in range(VEC):  # the columns' rows of B, once for the block's pairs
                    for k in range(WORDS):  # k in [0, r/PACK_B), unrolled
                        b_words[c * WORDS + k] = b[slot, expert, column[c], k]
                first = 0
                while True:  # chunks: entries first .. first + TILE_P - 1 of the block
                    if any_pair:
                        for i in range(TILE_P):  # i in [0, TILE_P), unrolled
                            p = max(pair_of[i], 0)  # (padding: row 0, never stored)
                            rows[i] = p if by_pair else p // top_k
                            if WEIGHTED:
                                weight[i] = weights[p]
                            if ADD_INPUTS:  # loaded now: they arrive while the shrink runs
                                for c in range(VEC):
                                    old[i * VEC + c] = load_out(out[p, column0 + column[c]])
                        for g in range(GROUPS):  # the team's steps over the rank
                            n0 = (team + TEAMS * g) * TILE_N
                            add_chunk(partial, xw, aw, xv, x, a, slot, expert, rows, n0, k_first)
                            if SHUFFLE:  # the lanes' partials: lane 0 gets the sums
                                for q in range(PARTIALS):
                                    value = partial[q]
                                    for step in range(STEPS):
                                        distance = LANES >> (step + 1)
                                        value += cuda.shfl_down_sync(FULL_MASK, value, distance)
                                    partial[q] = value
                            else:  # (the simulator: the same butterfly, in shared memory)
                                cuda.syncthreads()  # the step before's reads are done
                                for q in range(PARTIALS):
                                    lanes[tid, q] = partial[q]
                                cuda.syncthreads()
                                if lane == 0:
                                    for q in range(PARTIALS):
                                        for step in range(STEPS):
                                            half = LANES >> (step + 1)
                                            for u in range(half):
                                                lanes[tid + u, q] += lanes[tid + u + half, q]
                                        partial[q] = lanes[tid, q]
                            if lane == 0:
                                for i in range(TILE_P):
                                    for j in range(TILE_N):
                                        if n0 + j < RANK:
                                            parts[member, i, n0 + j] = partial[i * TILE_N + j]
                        cuda.syncthreads()  # every warp's parts are in
                        for i in range(TILE_P):
                            if pair_of[i] != -1:
                                for c in range(VEC):
                                    acc = float32(0.0)
                                    for k in range(WORDS):  # the rank, in order
                                        word = b_words[c * WORDS + k]
                                        for e in range(PACK_B):
                                            n = k * PACK_B + e
                                            value = parts[0, i, n]
                                            for m in range(1, SPLITS):  # the team's, in order
                                                value += parts[m, i, n]
                                            acc += value * load_b(word, e)
                                    if WEIGHTED:
                                        acc *= weight[i]  # the router's
                                    if ADD_INPUTS:  # the old output is added last
                                        acc += old[i * VEC + c]
                                    if n_first + mine + SPAN * c < width:
                                        out[pair_of[i], column0 + column[c]] = store_out(acc)
                        cuda.syncthreads()  # every thread's reads of the parts are done
                    first += TILE_P
                    if first >= pairs:
                        break
                    any_pair = read_chunk(pair_of, sorted_ids, slot, start, first, pairs, num_pairs)
            if not COMPACT:
                break
            v += cuda.gridDim.x

    return moe_fused
