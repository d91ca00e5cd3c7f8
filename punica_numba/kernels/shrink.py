"""The shrink kernel: ``out[s, t, :] (+)= scaling * x[t] @ A_s[slot(t)]^T``, segment by segment.

Work split (one block = one tile of tokens of one slot, one slice, some ranks):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment, looked up in the
  tile table (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``TILE_N`` ranks; groups stride by ``gridDim.z``.

Inside a block, thread ``tid`` walks the hidden dimension one *word* at a time,
``w = tid, tid + THREADS, ...``: a word is one element, or (packed) an int64
holding ``PACK`` elements read with a single 8-byte load. It loads ``UNROLL``
strides' words before it uses any, so that many loads are in flight at once. It keeps ``TILE_M *
TILE_N`` partial dot products in registers; the block then adds its threads'
partials in a fixed order (on the GPU by warp shuffles, then the warps' sums in
shared memory; on the simulator, which has no shuffles, by a tree in shared
memory), so the result is the same bits on every run: no atomics. Each output
element is written by exactly one thread: read, add, write; or, compiled without
``accumulate`` (for a buffer the wrapper made for the call, whose contents mean
nothing), only written.

**One pass.** The loop over rank groups steps by ``gridDim.z * TILE_N``, known only at
run time, and Numba's ``range`` works out its trip count with a 64-bit division routine
(``CALL.REL.NOINC`` in the SASS) before a block's first load. Where the grid has a block
for every group (``one_pass``), the step is a constant past any rank instead: one trip,
its count a shift (ptxas 13.0, sm_90: the kernel of 2-rank tiles that serves T=1 is 600
SASS instructions instead of 744; on the H200 T=1 went from 2.80 to 2.62 µs,
``h200_v15_candidates.json``). The launch asks for it only where a thread holds at most
4 ranks' words: with 8 (36 loads a thread) ptxas then issues only 31 of them before the
first FMA, and the rest wait a whole trip to memory; a ``while`` loop, which has the
same effect on the code, took 256 tokens on 256 LoRAs from 13.0 to 15.2 µs on the H200
(measured at 4c6b554).

**One slot.** A block of one token waits for two trips to memory: the tile table's
row, which names the token and its slot, then x and the slot's rows of A. At one token
that chain is the kernel's time (on the H200 a probe of the same two trips takes 2.9 µs,
the shrink 3.0). Where the weight stacks hold a single slot (vLLM's default
``max_loras`` is 1), the rows of A are known before the slot is: a block built with
``one_slot`` takes the token of its own index (no table; the tokens in their own order),
loads its x and slot 0's rows of A together with the token's slot from
``token_lora_mapping``, and tests the slot only where it stores (a token of no LoRA,
slot -1, stores nothing). One trip. Tested there, the slot holds back no load; an early
exit on it had LLVM or ptxas issue every load after it (the SASS, ptxas 13.0). With two
slots, loading both and keeping one by value, ptxas moved the slot into a uniform
register before the loads, which waits for it just the same: so one slot only. The
products and their order are the table's: the same bits. Where the rows are packed
words, one slot takes :mod:`.shrink_token` instead, a lean kernel of a token and a rank
a block with the same arithmetic.

Memory traffic per block: ``TILE_M`` rows of x and ``TILE_N`` rows of A, each read
once; ``TILE_M * TILE_N`` outputs read and written.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader
from .segments import read_tile, tile_token, token_of_block

__all__ = [
    "MAX_SLICES",
    "block_sum",
    "build_shrink_kernel",
    "number_factor",
    "row_factor",
    "word_products",
]

#: Slices one launch covers. The weights of each slice arrive as separate arguments
#: (Numba kernels take no arrays of arrays), so the number is fixed; vLLM's layers use
#: at most 3 (q/k/v). More slices take more launches.
MAX_SLICES = 3


@functools.cache
def block_sum(threads: int, partials: int):
    """``(add_up, tree_width)``: the device function ``add_up(partial, tree, tid)`` that adds
    the ``threads`` partial sums of each of ``partials`` dot products (``partial[p]``, one
    per thread) in a fixed order, leaving dot product ``p`` in ``tree[p, 0]`` for thread
    ``p < partials`` to read, and the width of the shared array ``tree``
    (``[partials, tree_width]`` fp32, the kernel's own) that it needs.

    On the GPU: a butterfly of warp shuffles inside each warp (no barrier), then the
    warps' sums in shared memory, added in warp order. The simulator has no shuffles:
    there it is a tree in shared memory. Either order depends only on ``threads``, so
    kernels that use it with the same ``threads`` give the same bits."""
    WARP_SUM = not SIMULATOR and threads % 32 == 0
    TREE_WIDTH = threads // 32 if WARP_SUM else threads  # partials per dot product kept
    FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part
    THREADS, PARTIALS = threads, partials

    @cuda.jit(device=True, inline="always")
    def add_up(partial, tree, tid):
        if WARP_SUM:
            for p in range(PARTIALS):
                value = partial[p]
                for step in range(5):  # offsets 16, 8, 4, 2, 1; unrolled
                    value += cuda.shfl_down_sync(FULL_MASK, value, 16 >> step)
                if tid % 32 == 0:
                    tree[p, tid // 32] = value
            cuda.syncthreads()
            if tid < PARTIALS:
                total = tree[tid, 0]
                for warp in range(1, TREE_WIDTH):
                    total += tree[tid, warp]
                tree[tid, 0] = total
        else:
            for p in range(PARTIALS):
                tree[p, tid] = partial[p]
            cuda.syncthreads()
            stride = THREADS // 2
            while stride > 0:
                if tid < stride:
                    for p in range(PARTIALS):
                        tree[p, tid] += tree[p, tid + stride]
                cuda.syncthreads()
                stride //= 2

    return add_up, TREE_WIDTH


@cuda.jit(device=True, inline="always")
def number_factor(scaling, row):
    """The shrink's factor of every output row: the call's ``scaling``."""
    return scaling


@cuda.jit(device=True, inline="always")
def row_factor(scaling, row):
    """The shrink's factor of output row ``row``, with the call's scaling of 1: the
    router's weight of a pair (``scaling``, fp32 [rows])."""
    return scaling[row]


@functools.cache
def word_products(dtype: torch.dtype, packed: bool, threads: int, tile_m: int, tile_n: int):
    """``(add_products, x_words, w_words)``: the device function
    ``add_products(partial, xw, ww, x, w, token, a_slot, n0, rank, k_first, k_end)`` that
    adds a thread's share of a block's ``tile_m x tile_n`` dot products over the words
    ``k_first, k_first + threads, ...`` below ``k_end`` into ``partial[j * tile_n + q]``
    (token row ``token[j]`` of ``x`` against row ``n0 + q`` of ``w[a_slot]``), and the
    sizes of the local arrays of words it loads into, ``xw`` (``x_words``) and ``ww``
    (``w_words``), which the kernel makes (the row shrink, and the split shrink's chunk).

    It loads ``UNROLL`` strides' words before it uses any: more loads in flight per
    thread. Only for single-token tiles: with more (``tile_m = 4``) the words held spill
    out of registers, and the H200 measured 13 -> 21 µs at T=64 over 8 LoRAs. A word past
    ``k_end`` repeats the last one and is never added; a rank past ``rank`` repeats the
    last row, whose products the kernel never stores. The products of each word, element
    by element in order, are added to ``partial`` in k order: the same sums, so the same
    bits, in every kernel that uses it with the same ``threads``."""
    load = word_loader(dtype, packed)
    THREADS, TILE_M, TILE_N, PACK = threads, tile_m, tile_n, packing(dtype, packed)
    UNROLL = 4 if TILE_M == 1 else 1  # strides of K whose loads go out together

    @cuda.jit(device=True, inline="always")
    def add_products(partial, xw, ww, x, w, token, a_slot, n0, rank, k_first, k_end):
        for k0 in range(k_first, k_end, THREADS * UNROLL):  # k0 in [k_first, k_end)
            for u in range(UNROLL):
                k = min(k0 + u * THREADS, k_end - 1)
                for j in range(TILE_M):
                    xw[u * TILE_M + j] = x[token[j], k]
                for q in range(TILE_N):  # rank n0 + q; past the rank: a harmless repeat
                    ww[u * TILE_N + q] = w[a_slot, min(n0 + q, rank - 1), k]
            for u in range(UNROLL):
                if k0 + u * THREADS < k_end:
                    for q in range(TILE_N):
                        for lane in range(PACK):  # the elements of one word, unrolled
                            wk = load(ww[u * TILE_N + q], lane)
                            for j in range(TILE_M):
                                partial[j * TILE_N + q] += load(xw[u * TILE_M + j], lane) * wk

    return add_products, UNROLL * TILE_M, UNROLL * TILE_N


@functools.cache
def build_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    tile_n: int,
    packed: bool,
    accumulate: bool = True,
    one_pass: bool = False,
    one_slot: bool = False,
    x_rows: int = 1,
    row_scaled: bool = False,
):
    """Compile-time specialisation: the dtypes of x and A and of the output, threads per
    block, tile sizes, whether x and A arrive as packed int64 words, whether the
    products are added to the output (``accumulate``) or stored, ``one_pass``: the
    caller's promise that the grid has a block for every group of ``tile_n`` ranks, so
    that a block does one group and no loop step is worked out at run time, and
    ``one_slot``: the weight stacks hold one slot, and a block of one token loads its
    rows before it knows its token's slot (module notes, "One slot"; ``tile_m`` must be
    1). The kernel's ``tiles`` argument is then ``token_lora_mapping``, and the grid has
    a block per token. ``x_rows``: the output rows that share a row of x, row ``t`` of the
    output reading row ``t // x_rows`` (MoE LoRA's pairs of a token, its ``top_k``:
    :mod:`..ops.moe_dense`); 1 for the dense op. ``row_scaled``: the kernel's ``scaling`` is
    an fp32 array of a factor an output row, by which row ``t``'s products are multiplied
    after the call's scaling of 1 (MoE LoRA's router weights at w2, a launch spared); a
    number otherwise.

    They must be constants because they size local (register) and shared arrays and
    the loops over them, which Numba unrolls only when the trip count is known.
    (``accumulate`` as a run-time argument measured 3.76 µs on the H200 at T=1, where
    this kernel without it had measured 3.01 in an earlier run.)
    """
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the tree reduction, got {threads}")
    if one_slot and tile_m != 1:
        raise ValueError(f"one_slot needs tiles of one token, got tile_m={tile_m}")
    if row_scaled and (accumulate or one_slot):
        raise ValueError("row_scaled takes a kernel that stores, on the tile table")
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, TILE_M, TILE_N = threads, tile_m, tile_n
    PARTIALS = TILE_M * TILE_N  # dot products one block computes per rank group
    # The K loop, and the words a thread holds in it (UNROLL strides' loads issued
    # before any is used, for single-token tiles: word_products).
    add_products, X_WORDS, W_WORDS = word_products(dtype, packed, threads, tile_m, tile_n)
    ONE_SLOT, X_ROWS = one_slot, x_rows
    read_work = token_of_block if one_slot else read_tile  # a block's token(s) and slot
    # The threads' partial sums, added in an order fixed for THREADS (block_sum).
    add_up, TREE_WIDTH = block_sum(threads, PARTIALS)
    WORD = memory_type(dtype, packed)  # one word of x or A as it sits in memory

    ACCUMULATE, ONE_PASS = accumulate, one_pass
    # A step past any rank (one pass) is a constant: the loop's trip count is a shift.
    # A run-time step (gridDim.z * TILE_N) costs a 64-bit division routine before the
    # first load of every block.
    ONE_PASS_STEP = 1 << 40

    scaled = row_factor if row_scaled else number_factor  # the factor of an output row
    begin = prologue()

    @jit_kernel(THREADS)
    def shrink(x, w0, w1, w2, out, slice_base, tiles, sorted_tokens, scaling):
        # x: [M, K/PACK] words; w*: [L, R, K/PACK] words; out: [S, M, R]; tiles: [B, 4] int32
        # (one slot: tiles is token_lora_mapping, [M], and block b takes token b, whose
        # slot is tested only where the block stores)
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_work(tiles, cuda.blockIdx.x)
        if not ONE_SLOT and slot == -1:
            return  # the whole block leaves together, before any barrier
        s_local = cuda.blockIdx.y
        # By hand, not segments.slice_of: with it the H200's large shrinks took 10-32 %
        # longer (revert of b4147e5, h200_v25_candidates.json; again in the trials of
        # h200_v28_candidates.json). Compiled on a CPU machine both forms give the same PTX;
        # on the H200 machine they do not (123 registers against 126 at T=256 distinct).
        if s_local == 0:
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        rank = w.shape[1]
        words = x.shape[1]
        tid = cuda.threadIdx.x

        token = cuda.local.array(TILE_M, int64)  # the tile's token rows (of the output)
        x_row = cuda.local.array(TILE_M, int64)  # and the rows of x they read
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)
            x_row[j] = token[j] // X_ROWS

        partial = cuda.local.array(PARTIALS, float32)
        xw = cuda.local.array(X_WORDS, WORD)
        ww = cuda.local.array(W_WORDS, WORD)
        tree = cuda.shared.array((PARTIALS, TREE_WIDTH), float32)

        step = ONE_PASS_STEP if ONE_PASS else cuda.gridDim.z * TILE_N
        for n0 in range(cuda.blockIdx.z * TILE_N, rank, step):
            # The thread that will store output (j, n) reads its old value now, so the
            # read is not one more trip to memory after the sum (rows and ranks past
            # the tile repeat in-bounds ones and are never stored).
            old = float32(0.0)
            if ACCUMULATE and tid < PARTIALS:
                n = min(n0 + tid % TILE_N, rank - 1)
                old = load_out(out[out_slice, token[tid // TILE_N], n])
            for p in range(PARTIALS):
                partial[p] = float32(0.0)
            # k in [0, K/PACK), strided by THREADS; UNROLL strides' loads are issued
            # together (past the end: a harmless repeat, never added).
            a_slot = 0 if ONE_SLOT else slot
            add_products(partial, xw, ww, x, w, x_row, a_slot, n0, rank, tid, words)

            add_up(partial, tree, tid)  # the THREADS partials of each dot product, in order

            if tid < PARTIALS:
                j = tid // TILE_N
                n = n0 + tid % TILE_N
                # (one slot: a token of no LoRA stores nothing; tested here, the slot
                # holds back no load: module notes)
                if j < rows and n < rank and (not ONE_SLOT or slot != -1):
                    total = scaled(scaling, token[j]) * tree[tid, 0]
                    out[out_slice, token[j], n] = store_out(old + total)
            cuda.syncthreads()  # the tree is reused by the next rank group

    return shrink
