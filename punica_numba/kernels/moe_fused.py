"""MoE LoRA in one launch: a CUDA block shrinks its block's pairs and expands them itself.

Where each (slot, expert) has a pair or two, the op's time is its launches: at one token
of top-8 the table of pairs, the shrink and the expand of version 9 take about 2 µs each
on an H100, most of it the wait for the kernel before (lab notes, "The pairs path launch
by launch"). Each pair's delta depends only on its own block's A and B, so nothing needs
another block's results: one CUDA block can take a block of pairs from its entries to its
rows of y, with the buffer between the two products in shared memory. No table of pairs
(the blocks are found by the compact grid's walk), no buffer in global memory, one launch.

Work split (a compact grid, :func:`.moe_blocks.unit_walker`):

* ``blockIdx.x``: a block in use of the metadata (slot l, block b of its row), found by
  the walk over the slots; units ``x, x + gridDim.x, ...`` as in version 6;
* ``blockIdx.z``: the slice s and a group of ``THREADS * VEC`` output columns, ``z = s * G
  + g`` (:func:`.moe_blocks.slice_and_group`): each CUDA block of a slice does that
  slice's shrink again (its rows of A from L2 after the first), so that one token's few
  blocks still spread over many SMs.

A CUDA block takes its block's pairs in chunks of ``TILE_P``:

1. the chunk's entries (every thread reads them, :func:`.moe_blocks.chunk_reader`); for
   the first chunk the block's expert is looked up in the same trip to memory;
2. the loads that need only those: each thread's ``VEC`` columns of ``B_s[l, e]`` (once a
   block, as words, kept in registers) and its old outputs, issued before the shrink so
   that they arrive while it runs;
3. the shrink of the chunk's rows of x by ``A_s[l, e]``, ``TILE_N`` ranks at a time, K
   split across the threads (:func:`.moe_shrink_split.chunk_sums`, version 3's sums), the
   threads' partials added in a fixed order (:func:`.shrink.block_sum`), each sum times the
   pair's router weight (w2) into the shared buffer ``[TILE_P, r]`` fp32;
4. each thread's columns for the chunk's pairs: the buffer row (a broadcast from shared
   memory) against the column's row of B, in rank order, plus the old output, stored.

Deterministic: every output is stored by one thread, once, its sums in an order fixed by
the build. Padding (an entry ``>= P``) reads row 0 of x and of y, in bounds, and stores
nothing.

Memory traffic per CUDA block in use: ``r * K`` of A (the slice's, once a chunk, from L1
after the first), the chunk's rows of x, ``THREADS * VEC * r`` of B once, and the pairs'
``THREADS * VEC`` outputs read and written; a slice's ``G`` column groups each read A and x.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader
from .moe_blocks import block_in_use, chunk_reader, slice_and_group, unit_walker
from .moe_shrink_split import chunk_sums
from .shrink import block_sum

__all__ = ["build_moe_fused_kernel"]


@functools.cache
def build_moe_fused_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_n: int,
    tile_p: int,
    unroll: int,
    vec: int,
    rank: int,
    packed_xa: bool,
    packed_b: bool,
    weighted: bool,
    add_inputs: bool,
    slots_at_once: int,
):
    """The kernel ``moe_fused(x, a0, a1, b0, b1, out, weights, sorted_ids, expert_ids,
    num_post_pad, enabled, top_k, block_size, by_pair, offset)``, specialised on the dtype
    of x, A and B and of the output, the threads per CUDA block (a power of two), the
    ranks (``tile_n``) and pairs (``tile_p``) of one step of the shrink's sums, the
    strides of K whose loads go out together (``unroll``), the columns a thread owns
    (``vec``), the rank, whether x and A, and B, arrive as packed int64 words, the router's
    weight (``weighted``), ``add_inputs``, and the slots the walk reads at once.

    They must be constants: they size the registers and shared arrays and the loops over
    them, which Numba unrolls only when their trip counts are known.
    """
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the block's sum, got {threads}")
    if tile_n * tile_p > threads:
        raise ValueError(
            f"a step's {tile_p} x {tile_n} sums need as many threads to store them, got {threads}"
        )
    PACK_B = packing(dtype, packed_b)
    if rank % PACK_B:
        raise ValueError(f"packed rows of B take a rank that is a multiple of {PACK_B}, got {rank}")
    unit_of = unit_walker(slots_at_once)
    read_chunk = chunk_reader(tile_p)
    add_chunk, X_WORDS, A_WORDS = chunk_sums(dtype, packed_xa, threads, tile_n, tile_p, unroll)
    THREADS, TILE_N, TILE_P, VEC, RANK = threads, tile_n, tile_p, vec, rank
    PARTIALS = TILE_P * TILE_N  # a step's sums: partial[i * TILE_N + j]
    add_up, TREE_WIDTH = block_sum(threads, PARTIALS)
    XA_WORD, B_WORD = memory_type(dtype, packed_xa), memory_type(dtype, packed_b)
    load_b = word_loader(dtype, packed_b)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    WORDS = RANK // PACK_B  # words in a row of B
    SPAN = min(32, threads)  # a warp's neighbouring columns (the simulator's blocks are small)
    GROUP = THREADS * VEC  # columns a CUDA block owns
    B_WORDS, OLD = VEC * WORDS, TILE_P * VEC  # a thread's words of B, its old outputs
    WEIGHTED, ADD_INPUTS = weighted, add_inputs
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

        pair_of = cuda.local.array(TILE_P, int64)  # the chunk's pairs, -1: none
        rows = cuda.local.array(TILE_P, int64)  # and the rows of x they read
        column = cuda.local.array(VEC, int64)  # the thread's columns, clamped into the slice
        b_words = cuda.local.array(B_WORDS, B_WORD)  # b_words[c * WORDS + k]
        old = cuda.local.array(OLD, float32)  # old[i * VEC + c]
        partial = cuda.local.array(PARTIALS, float32)
        xw = cuda.local.array(X_WORDS, XA_WORD)
        aw = cuda.local.array(A_WORDS, XA_WORD)
        xv = cuda.local.array(TILE_P, float32)
        tree = cuda.shared.array((PARTIALS, TREE_WIDTH), float32)
        buffer = cuda.shared.array((TILE_P, RANK), float32)  # the chunk's shrunk rows

        mine = (tid // SPAN) * SPAN * VEC + tid % SPAN  # the thread's first column in a group
        for c in range(VEC):  # columns n_first + mine + SPAN * c: a warp's are neighbours
            column[c] = min(n_first + mine + SPAN * c, width - 1)  # past the slice: not stored

        v = cuda.blockIdx.x
        while True:  # the units v, v + gridDim.x, ... (one, where the grid is the bound)
            slot, block = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, 1)
            if slot == -1:
                break
            if v != cuda.blockIdx.x:
                cuda.syncthreads()  # the unit before's readers of the shared arrays are done
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
                            if ADD_INPUTS:  # loaded now: they arrive while the shrink runs
                                for c in range(VEC):
                                    old[i * VEC + c] = load_out(out[p, column0 + column[c]])
                        for n0 in range(0, RANK, TILE_N):  # the rank groups, in order
                            add_chunk(partial, xw, aw, xv, x, a, slot, expert, rows, n0, tid)
                            add_up(partial, tree, tid)  # the threads' partials, in order
                            if tid < PARTIALS:
                                i, n = tid // TILE_N, n0 + tid % TILE_N
                                if n < RANK:
                                    total = tree[tid, 0]
                                    if WEIGHTED:
                                        total *= weights[max(pair_of[i], 0)]
                                    buffer[i, n] = total
                            cuda.syncthreads()  # the buffer is whole; the tree free again
                        for i in range(TILE_P):
                            if pair_of[i] != -1:
                                for c in range(VEC):
                                    acc = float32(0.0)
                                    for k in range(WORDS):  # the rank, in order
                                        word = b_words[c * WORDS + k]
                                        for lane in range(PACK_B):
                                            acc += buffer[i, k * PACK_B + lane] * load_b(word, lane)
                                    if ADD_INPUTS:  # the old output is added last
                                        acc += old[i * VEC + c]
                                    if n_first + mine + SPAN * c < width:
                                        out[pair_of[i], column0 + column[c]] = store_out(acc)
                        cuda.syncthreads()  # every thread's reads of the buffer are done
                    first += TILE_P
                    if first >= pairs:
                        break
                    any_pair = read_chunk(pair_of, sorted_ids, slot, start, first, pairs, num_pairs)
            v += cuda.gridDim.x

    return moe_fused
