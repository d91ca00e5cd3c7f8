"""The MoE LoRA shrink, third rung: K split across a CUDA block's threads.

The same sums as :mod:`.moe_shrink` (each pair's input row times ``A[l, e]`` of its
block, stored into the fp32 buffer ``[S, P, r]``). The first rung gives each dot product
of length K to one thread, which runs K dependent steps; here a CUDA block shares each
one, the way the linear shrink does (:mod:`.shrink`), so a thread runs K / THREADS.

Work split:

* ``blockIdx.x``: the block b of pairs of the row (:mod:`.moe_blocks`);
* ``blockIdx.y``: the row, the slot l;
* ``blockIdx.z``: the slice s and a group of ``TILE_N`` ranks, ``z = s * G + g`` with
  ``G = ceil(r / TILE_N)`` groups a slice, so that even one token, whose ``top_k`` pairs
  sit in ``top_k`` blocks of one pair each, makes ``top_k * S * G`` CUDA blocks.

Inside a CUDA block the block's pairs go in chunks of ``TILE_P``. For a chunk, thread
``tid`` walks K one *word* at a time, ``k = tid, tid + THREADS, ...`` (a word: one
element, or an int64 of ``PACK`` elements read with one 8-byte load, :mod:`.dtypes`),
issuing ``UNROLL`` strides' loads before it uses any, and keeps the chunk's ``TILE_P x
TILE_N`` partial dot products in registers. The block then adds its threads' partials
in a fixed order (:func:`.shrink.block_sum`), and thread ``i * TILE_N + j`` stores the
sum of pair i and rank ``g * TILE_N + j``. A chunk whose entries are all padding is
skipped (every thread reads the same entries, so the whole block skips it together);
padding inside a chunk (an entry ``>= P``) reads row 0 of x, in bounds, and stores
nothing. Deterministic: every output is stored by one thread, and its sum's order
depends only on ``THREADS``.

**Two trips at once.** A block must find its pairs (``sorted_token_ids``) and its
expert (``expert_ids``, in :func:`.moe_blocks.block_in_use`) before it loads anything
else: the rows of x depend on the pairs, the rows of A on the expert. The first
chunk's entries are read before the block's expert is, so the two lookups, and then
the loads of x and of A, are in flight together rather than one after the other.

Memory traffic per CUDA block in use (pairs ``p <= block_size``, ``c = ceil(p /
TILE_P)`` chunks): ``c * TILE_N * K`` of A (the same ``TILE_N`` rows for every chunk,
from L1 after the first), ``c * TILE_P * K`` of x (padding rows included), and ``p *
TILE_N`` fp32 stores; a launch reads each pair's input row once per rank group and
slice. No GPU timing of it is recorded yet (docs/benchmarks).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import memory_type, packing, word_loader
from .moe_blocks import MOST_SLOTS_AT_ONCE, block_in_use, slice_and_group, unit_walker
from .shrink import block_sum

__all__ = ["build_moe_split_shrink_kernel", "chunk_sums"]


@functools.cache
def chunk_sums(
    dtype: torch.dtype, packed: bool, threads: int, tile_n: int, tile_p: int, unroll: int
):
    """``(add_chunk, x_words, a_words)``: the device function ``add_chunk(partial, xw, aw, xv,
    x, w, slot, expert, rows, n0, tid)`` that sets ``partial[i * tile_n + j]`` to thread
    ``tid``'s share of the dot product of input row ``rows[i]`` of ``x`` with row ``n0 + j``
    of ``w[slot, expert]`` (its words ``tid, tid + threads, ...``), and the sizes of the
    local arrays of words it loads into, ``xw`` (``x_words``) and ``aw`` (``a_words``); ``xv``
    holds ``tile_p`` fp32. ``unroll`` strides' loads are issued before any is used; a word
    past K repeats the last one and is never added, a rank past the rank repeats the last
    row (its sums are never stored). The products of each word, element by element in
    order, are added in k order: the same sums in every kernel that uses it with the same
    ``threads`` (this module's shrink, :mod:`.moe_fused`)."""
    load = word_loader(dtype, packed)
    THREADS, TILE_N, TILE_P, UNROLL = threads, tile_n, tile_p, unroll
    PACK = packing(dtype, packed)
    PARTIALS = TILE_P * TILE_N
    STEP = THREADS * UNROLL  # words of K a block's loads cover at once

    @cuda.jit(device=True, inline="always")
    def add_chunk(partial, xw, aw, xv, x, w, slot, expert, rows, n0, tid):
        rank, words = w.shape[2], x.shape[1]
        for q in range(PARTIALS):
            partial[q] = float32(0.0)
        # k in [0, K/PACK), strided by THREADS; UNROLL strides' loads are issued
        # together (past the end: a repeat of the last word, never added).
        for k0 in range(tid, words, STEP):
            for u in range(UNROLL):
                k = min(k0 + u * THREADS, words - 1)
                for j in range(TILE_N):  # rank n0 + j; past the rank: a repeat
                    aw[u * TILE_N + j] = w[slot, expert, min(n0 + j, rank - 1), k]
                for i in range(TILE_P):
                    xw[u * TILE_P + i] = x[rows[i], k]
            for u in range(UNROLL):
                if k0 + u * THREADS < words:
                    for lane in range(PACK):  # the elements of one word, unrolled
                        for i in range(TILE_P):
                            xv[i] = load(xw[u * TILE_P + i], lane)
                        for j in range(TILE_N):
                            a = load(aw[u * TILE_N + j], lane)
                            for i in range(TILE_P):
                                partial[i * TILE_N + j] += xv[i] * a

    return add_chunk, UNROLL * TILE_P, UNROLL * TILE_N


@functools.cache
def build_moe_split_shrink_kernel(
    dtype: torch.dtype,
    threads: int,
    tile_n: int,
    tile_p: int,
    unroll: int,
    packed: bool,
    compact: bool = False,
    slots_at_once: int = MOST_SLOTS_AT_ONCE,
):
    """The shrink, specialised on the dtype of x and A, the threads per block, the ranks
    (``tile_n``) and pairs (``tile_p``) of one chunk's products, the strides of K whose
    loads are issued together (``unroll``), whether x and A arrive as packed int64
    words, and whether the grid is compact (``compact``: its CUDA blocks along x walk the
    blocks in use, :func:`.moe_blocks.unit_walker`, reading ``slots_at_once`` slots'
    counts at once; else block ``blockIdx.x`` of row ``blockIdx.y``).

    They must be constants: they size the local (register) and shared arrays and the
    loops over them, which Numba unrolls only when the trip count is known.
    """
    unit_of = unit_walker(slots_at_once)
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the block's sum, got {threads}")
    if tile_n * tile_p > threads:
        raise ValueError(
            f"a chunk's {tile_p} x {tile_n} sums need as many threads to store them, got {threads}"
        )
    WORD = memory_type(dtype, packed)  # one word of x or A as it sits in memory
    THREADS, TILE_N, TILE_P = threads, tile_n, tile_p
    COMPACT = compact
    PARTIALS = TILE_P * TILE_N  # a chunk's dot products: partials[i * TILE_N + j]
    add_chunk, X_WORDS, A_WORDS = chunk_sums(dtype, packed, threads, tile_n, tile_p, unroll)
    # The threads' partial sums, added in an order fixed for THREADS.
    add_up, TREE_WIDTH = block_sum(threads, PARTIALS)

    @cuda.jit(device=True, inline="always")
    def read_chunk(rows, sorted_ids, slot, start, first, pairs, num_pairs, top_k, by_pair, tid):
        """Entries ``first .. first + TILE_P - 1`` of the block: each one's input row into
        ``rows`` (row 0 for padding and past the block: in bounds, never stored), and
        ``(mine, any_pair)``: the pair whose sums thread ``tid`` stores (-1: none), and
        whether the chunk holds a pair at all."""
        mine = int64(-1)
        any_pair = False
        for i in range(TILE_P):  # i in [0, TILE_P), unrolled
            entry = first + i
            pair = sorted_ids[slot, start + min(entry, pairs - 1)]
            real = entry < pairs and 0 <= pair < num_pairs  # (padding is num_pairs)
            rows[i] = (pair if by_pair else pair // top_k) if real else 0
            any_pair = any_pair or real
            if real and i == tid // TILE_N:
                mine = pair
        return mine, any_pair

    @cuda.jit(device=True, inline="always")
    def shrink_block(
        slot, b, x, w, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k, block_size,
        by_pair, s, n0, rows, partial, xw, aw, xv, tree,
    ):  # fmt: skip
        """Block b of row ``slot``: its expert, then its pairs a chunk at a time (module
        notes). Every thread of the CUDA block calls it with the same block."""
        rank = w.shape[2]
        num_pairs = out.shape[1]
        tid = cuda.threadIdx.x
        start = b * block_size
        pairs = min(block_size, sorted_ids.shape[1] - start)  # (the grid keeps start in the row)

        # The first chunk's entries, then the block's expert: two trips to memory in flight
        # together (module notes).
        mine, any_pair = read_chunk(
            rows, sorted_ids, slot, start, 0, pairs, num_pairs, top_k, by_pair, tid
        )
        _, _, expert = block_in_use(
            b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:
            return  # every thread of the CUDA block together, before any barrier

        first = 0
        while True:  # chunks: entries first .. first + TILE_P - 1 of the block
            if any_pair:
                add_chunk(partial, xw, aw, xv, x, w, slot, expert, rows, n0, tid)
                add_up(partial, tree, tid)  # the THREADS partials of each sum, in order

                if tid < PARTIALS:
                    n = n0 + tid % TILE_N
                    if mine != -1 and n < rank:
                        out[s, mine, n] = tree[tid, 0]
                cuda.syncthreads()  # the tree is reused by the next chunk
            first += TILE_P
            if first >= pairs:
                break
            mine, any_pair = read_chunk(
                rows, sorted_ids, slot, start, first, pairs, num_pairs, top_k, by_pair, tid
            )

    begin = prologue()

    @jit_kernel(THREADS)
    def moe_shrink_split(
        x, w0, w1, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k, block_size, by_pair
    ):
        # x: [M or P, K/PACK] words; w*: [L, E, r, K/PACK] words; out: [S, P, r] fp32,
        # stored; sorted_ids: [L, EM]; expert_ids: [L, NB]; num_post_pad: [L]; enabled: [>= L]
        begin()  # wait for the kernels before this one (dependent_launch)
        s, n0 = slice_and_group(w0.shape[2], TILE_N)  # the slice, the group's first rank
        w = w0 if s == 0 else w1

        rows = cuda.local.array(TILE_P, int64)  # the chunk's input rows
        partial = cuda.local.array(PARTIALS, float32)
        xw = cuda.local.array(X_WORDS, WORD)  # xw[u * TILE_P + i]: pair i, stride u
        aw = cuda.local.array(A_WORDS, WORD)  # aw[u * TILE_N + j]: rank n0 + j, stride u
        xv = cuda.local.array(TILE_P, float32)  # one element of each pair's word
        tree = cuda.shared.array((PARTIALS, TREE_WIDTH), float32)

        if not COMPACT:  # block blockIdx.x of row blockIdx.y
            shrink_block(
                cuda.blockIdx.y, cuda.blockIdx.x, x, w, out, sorted_ids, expert_ids,
                num_post_pad, enabled, top_k, block_size, by_pair, s, n0, rows, partial, xw,
                aw, xv, tree,
            )  # fmt: skip
            return
        v = cuda.blockIdx.x  # a compact grid (moe_blocks.unit_walker): the blocks in use
        while True:
            slot, b = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, 1)
            if slot == -1:
                break
            if v != cuda.blockIdx.x:
                cuda.syncthreads()  # the block before's readers of the tree are done
            shrink_block(
                slot, b, x, w, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k,
                block_size, by_pair, s, n0, rows, partial, xw, aw, xv, tree,
            )  # fmt: skip
            v += cuda.gridDim.x

    return moe_shrink_split
