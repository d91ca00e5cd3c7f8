"""The MoE LoRA expand, third rung: a thread's columns of B held in registers.

The same sums as :mod:`.moe_expand` (each pair's fp32 buffer row times ``B[l, e]`` of its
block, weighted by the router for w2, added to the pair's row of the output, or stored
there without ``add_inputs``). The first rung gives a thread one column and reads that
column's row of B again for every pair; here a thread owns ``VEC`` columns, loads their
rows of B once (``r`` values each, converted to fp32: the rank is compiled in, so they
sit in registers), and then walks the block's pairs with them.

Work split:

* ``blockIdx.x``: the block b of pairs of the row (:mod:`.moe_blocks`);
* ``blockIdx.y``: the row, the slot l;
* ``blockIdx.z``: the slice s and a group of ``THREADS * VEC`` columns, ``z = s * G + g``
  with ``G = ceil(N / (THREADS * VEC))`` groups a slice, so that a wide slice (w2's N =
  2048) spreads over many CUDA blocks.

Inside a group, thread ``tid`` owns the ``VEC`` columns ``SPAN`` apart that start at its
lane (``SPAN``: a warp's 32), as the linear expand's threads do (:mod:`.expand`): a warp
owns 32 neighbouring columns ``VEC`` times over, so its loads of the output and its
stores are 32 neighbouring elements each. The block's pairs go in chunks of
``TILE_P``: the chunk's entries, then every pair's buffer row (the same row for every
thread: a broadcast, 16 bytes a load where the rank is a multiple of 4), its routing
weight and the thread's old outputs, all loaded before any is used; then each
(pair, column): the dot product with the column's row of B, times the weight, plus the
old output, stored. Padding (an entry ``>= P``) reads the buffer's and output's row 0,
in bounds, and stores nothing. Deterministic: every output is stored by one thread,
its sum in rank order.

**Two trips at once.** The rows of B depend on the block's expert, the buffer rows on
its pairs: the first chunk's entries are read before the expert is looked up
(:func:`.moe_blocks.block_in_use`), so both lookups, then the loads of B and of the
buffer, are in flight together.

Memory traffic per CUDA block in use (pairs ``p <= block_size``): ``THREADS * VEC * r``
of B, once; ``r`` fp32 of the buffer per pair (broadcast); ``p * THREADS * VEC``
outputs written (and read with ``add_inputs``). No GPU timing of it is recorded yet
(docs/benchmarks).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import four_float32_loader, loader, memory_type, packing, storer, word_loader
from .moe_blocks import block_in_use, chunk_reader, slice_and_group

__all__ = ["build_moe_columns_expand_kernel"]


@functools.cache
def build_moe_columns_expand_kernel(
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    vec: int,
    tile_p: int,
    rank: int,
    packed: bool,
    wide: bool,
    weighted: bool,
    add_inputs: bool,
):
    """The expand, specialised on the dtypes of B and of the output, the threads per
    block, the columns a thread owns (``vec``), the pairs whose loads are issued
    together (``tile_p``), the rank, whether B arrives as packed int64 words (the rank a
    multiple of their elements), ``wide``: the caller's promise that every buffer row
    starts at a multiple of 16 bytes (the rank a multiple of 4), and the two options of
    the op: the routing weight (``weighted``) and ``add_inputs``.

    They must be constants: the rank, ``vec`` and ``tile_p`` size the registers that hold
    B and the buffer rows, and the loops over them are unrolled only when their trip
    counts are known; the options, known at compile time, leave no branch behind.
    """
    PACK = packing(w_dtype, packed)
    if rank % PACK:
        raise ValueError(f"packed rows of B take a rank that is a multiple of {PACK}, got {rank}")
    if wide and rank % 4:
        raise ValueError(f"16-byte buffer loads take a rank that is a multiple of 4, got {rank}")
    load_w = word_loader(w_dtype, packed)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    load_four = four_float32_loader(wide)
    THREADS, VEC, TILE_P, RANK = threads, vec, tile_p, rank
    WORDS = RANK // PACK  # words in a row of B
    QUADS = RANK // 4  # 16-byte loads in a buffer row (wide)
    SPAN = min(32, threads)  # a warp's neighbouring columns (the simulator's blocks are small)
    GROUP = THREADS * VEC  # columns a CUDA block owns
    B_VALUES = VEC * RANK  # bv[c * RANK + j]: column c, rank j
    B_WORDS = VEC * WORDS
    X_VALUES = TILE_P * RANK  # xr[i * RANK + j]: pair i's buffer row
    OLD = TILE_P * VEC  # old[i * VEC + c]
    WIDE, WEIGHTED, ADD_INPUTS = wide, weighted, add_inputs
    W_WORD = memory_type(w_dtype, packed)

    read_chunk = chunk_reader(TILE_P)
    begin = prologue()

    @jit_kernel(THREADS)
    def moe_expand_columns(
        x, w0, w1, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, block_size,
        offset,
    ):  # fmt: skip
        # x: [S, P, r] fp32; w*: [L, E, N, r/PACK] words; out: [P, W], slice s at
        # offset + s * N; weights: [P] routing weight of each pair, read when WEIGHTED
        begin()  # wait for the kernels before this one (dependent_launch)
        b, slot = cuda.blockIdx.x, cuda.blockIdx.y
        width = w0.shape[2]
        s, n0 = slice_and_group(width, GROUP)  # the slice, the group's first column
        w = w0 if s == 0 else w1
        column0 = offset + s * width
        num_pairs = out.shape[0]
        tid = cuda.threadIdx.x
        start = b * block_size
        pairs = min(block_size, sorted_ids.shape[1] - start)  # (the grid keeps start in the row)

        pair_of = cuda.local.array(TILE_P, int64)  # the chunk's pairs, -1: none
        column = cuda.local.array(VEC, int64)  # the thread's columns, clamped into the slice
        bv = cuda.local.array(B_VALUES, float32)
        xr = cuda.local.array(X_VALUES, float32)
        weight = cuda.local.array(TILE_P, float32)
        old = cuda.local.array(OLD, float32)
        b_words = cuda.local.array(B_WORDS, W_WORD)  # b_words[c * WORDS + k]

        # The first chunk's entries, then the block's expert: two trips to memory in flight
        # together (module notes).
        any_pair = read_chunk(pair_of, sorted_ids, slot, start, 0, pairs, num_pairs)
        _, _, expert = block_in_use(
            b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:
            return

        mine = (tid // SPAN) * SPAN * VEC + tid % SPAN  # the thread's first column in a group
        for c in range(VEC):  # columns n0 + mine + SPAN * c: a warp's are neighbours
            column[c] = min(n0 + mine + SPAN * c, width - 1)  # past the slice: never stored
        # The columns' rows of B, once for every pair of the block: every load, then the
        # conversions to fp32.
        for c in range(VEC):
            for k in range(WORDS):  # k in [0, r/PACK), unrolled
                b_words[c * WORDS + k] = w[slot, expert, column[c], k]
        for c in range(VEC):
            for k in range(WORDS):
                for lane in range(PACK):
                    bv[c * RANK + k * PACK + lane] = load_w(b_words[c * WORDS + k], lane)

        first = 0
        while True:  # chunks: entries first .. first + TILE_P - 1 of the block
            if any_pair:
                # Every load of the chunk first: buffer rows, weights, old outputs (padding
                # reads row 0: in bounds, never stored).
                for i in range(TILE_P):
                    p = max(pair_of[i], 0)
                    row = x[s, p]
                    if WIDE:
                        for q in range(QUADS):  # q in [0, r/4): 16 bytes a load
                            a0, a1, a2, a3 = load_four(row, 4 * q)
                            xr[i * RANK + 4 * q] = a0
                            xr[i * RANK + 4 * q + 1] = a1
                            xr[i * RANK + 4 * q + 2] = a2
                            xr[i * RANK + 4 * q + 3] = a3
                    else:
                        for j in range(RANK):  # j in [0, r)
                            xr[i * RANK + j] = row[j]
                    if WEIGHTED:
                        weight[i] = weights[p]
                    if ADD_INPUTS:
                        for c in range(VEC):
                            old[i * VEC + c] = load_out(out[p, column0 + column[c]])
                for i in range(TILE_P):
                    if pair_of[i] != -1:
                        for c in range(VEC):
                            acc = float32(0.0)
                            for j in range(RANK):  # j in [0, r), in order
                                acc += xr[i * RANK + j] * bv[c * RANK + j]
                            if WEIGHTED:
                                acc *= weight[i]
                            if ADD_INPUTS:  # the old output is added last (the op's order)
                                acc += old[i * VEC + c]
                            if n0 + mine + SPAN * c < width:
                                out[pair_of[i], column0 + column[c]] = store_out(acc)
            first += TILE_P
            if first >= pairs:
                break
            any_pair = read_chunk(pair_of, sorted_ids, slot, start, first, pairs, num_pairs)

    return moe_expand_columns
