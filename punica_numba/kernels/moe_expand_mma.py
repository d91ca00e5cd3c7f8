"""The MoE LoRA expand, fourth rung: a block's buffer rows times ``B[l, e]`` on the tensor cores.

The same sums as :mod:`.moe_expand` (each pair's fp32 buffer row times ``B[l, e]`` of its
block, weighted by the router for w2, added to the pair's row of the output, or stored
there without ``add_inputs``). A block of up to ``block_size`` pairs makes the product
``Y[pairs, N] = buffer[pairs, r] @ B[l, e]^T``: a warp's ``mma.sync m16n8k16``
(:mod:`.mma`) does 16 pairs x 8 columns x 16 ranks in one instruction.

Work split:

* ``blockIdx.x``: the block b of pairs of the row (:mod:`.moe_blocks`);
* ``blockIdx.y``: the row, the slot l;
* ``blockIdx.z``: the slice s and a group of ``BLOCK_N = WARPS * 8 * N_TILES`` columns,
  ``z = s * G + g`` with ``G = ceil(N / BLOCK_N)`` groups a slice; warp ``w`` owns the
  group's columns ``8 N_TILES w .. 8 N_TILES (w + 1) - 1``;
* inside a CUDA block the block's entries go in passes of ``TILE_M = 16 * M_TILES``;
  a warp's products of a pass are ``M_TILES x N_TILES`` tiles, each over the rank in
  ``K_STEPS = ceil(r / 16)`` steps. Every output is one lane's, stored once: no sum
  across warps, deterministic.

**Precision** (that of :mod:`.expand_mma`, "Precision"). The buffer is fp32, the tensor
cores take 16-bit operands: each buffer element is split into two bf16, ``hi + lo``
(:func:`.mma.split_pair`, 16 of fp32's 24 significant bits), and with bf16 B a product
tile is two ``mma`` into one fp32 accumulator, ``lo @ B`` then ``hi @ B``. fp16 B is
split too, exactly, into two bf16 (:func:`.mma.split_f16_pair`; bf16 holds fp32's
exponents, so no buffer value overflows or vanishes), and a tile is three ``mma``, small
terms first: ``lo @ B_hi``, ``hi @ B_lo``, ``hi @ B_hi`` (the term left out, ``lo @
B_lo``, is under 2**-14 of the magnitude, six times below fp16's own rounding of the
output). Then, as in the other versions, the sum times the routing weight, plus the old
output, rounded once into the output's dtype.

**Fragments from memory.** Lane ``t`` takes, in rank step ``kk``, the four neighbouring
ranks ``16 kk + 4t .. + 3`` (as :mod:`.shrink_mma`, "Whole words"; the buffer and B take
the same order): of B's row ``n0 + 8 nj + g`` one int64 word (B arrives as ``[L, E, N,
r/4]`` words, so r is a multiple of 4), its low half as ranks ``2t, 2t + 1`` of the
step and its high half as ``2t + 8, 2t + 9``; of a buffer row the same four fp32 (one
16-byte load where ``wide_x``), split. Ranks past r are zeros, and so is a row of
padding (an entry ``>= P``, or past the block): no load, and no store. B's fragments
depend only on the block's expert: a warp loads them once, before its first pass.
Columns past the slice read its last row of B and are never stored.

Every thread calls ``mma`` equally often (the simulator needs it): the loops' trip
counts are compiled in or the same in every thread, and a pass with no pair is skipped
by the whole block together.

Memory traffic per CUDA block in use (``p <= block_size`` pairs): ``BLOCK_N * r`` of B,
once; ``p * r`` fp32 of the buffer (every column group reads them again, mostly from
L2); ``p * BLOCK_N`` outputs written (and read with ``add_inputs``). No GPU timing of it
is recorded yet (docs/benchmarks).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import four_float32_loader, loader, storer, word_halves
from .mma import FRAGMENT_WORDS, MMA_DTYPES, mma_into, split_f16_pair, split_pair
from .moe_blocks import block_in_use, read_pass, slice_and_group

__all__ = ["build_moe_mma_expand_kernel"]


@functools.cache
def build_moe_mma_expand_kernel(
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    rank: int,
    wide_x: bool,
    weighted: bool,
    add_inputs: bool,
):
    """The expand, specialised on the dtypes of B (bf16 or fp16) and of the output, the
    threads per block (whole warps), the 16-pair tiles of one pass (``m_tiles``), the
    8-column tiles of a warp (``n_tiles``), the rank (a multiple of 4), ``wide_x``: the
    caller's promise that every buffer row starts at a multiple of 16 bytes (a lane's
    four elements of a step in one load), and the two options of the op: the routing
    weight (``weighted``) and ``add_inputs``.

    They must be constants: the rank and the tiles size the fragment registers, and the
    loops over them are unrolled only when their trip counts are known; the options,
    known at compile time, leave no branch behind.
    """
    if w_dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor cores take bf16 or fp16 B, got {w_dtype}")
    if threads % 32:
        raise ValueError(f"threads must be whole warps, got {threads}")
    if rank % 4 or rank < 4:
        raise ValueError(f"B in int64 words takes a rank that is a multiple of 4, got {rank}")
    add_product = mma_into(torch.bfloat16)  # (fp16 B is split into bf16: module notes)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    load_four = four_float32_loader(wide_x)
    THREADS, WARPS, M_TILES, N_TILES = threads, threads // 32, m_tiles, n_tiles
    TILE_M, WARP_N = 16 * m_tiles, 8 * n_tiles
    BLOCK_N = WARPS * WARP_N  # columns a CUDA block owns
    RANK, K_STEPS = rank, (rank + 15) // 16
    WORDS = rank // 4  # words in a row of B
    ROWS = 2 * M_TILES  # pair rows a lane holds: g + 8 * i
    SPLIT_B = w_dtype == torch.float16
    B_FRAGMENTS = K_STEPS * N_TILES * 2  # b[(kk * N_TILES + nj) * 2 + h]: b0 (h 0), b1
    A_FRAGMENTS = K_STEPS * M_TILES * 4  # a[(kk * M_TILES + mi) * 4 + q]: a0 .. a3
    OUTPUTS = M_TILES * N_TILES * 4
    SCRATCH_WARPS = WARPS if SIMULATOR else 1
    WEIGHTED, ADD_INPUTS = weighted, add_inputs

    begin = prologue()

    @jit_kernel(THREADS)
    def moe_expand_mma(
        x, w0, w1, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, block_size,
        offset,
    ):  # fmt: skip
        # x: [S, P, r] fp32; w*: [L, E, N, r/4] int64 words; out: [P, W], slice s at
        # offset + s * N; weights: [P] routing weight of each pair, read when WEIGHTED
        begin()  # wait for the kernels before this one (dependent_launch)
        b, slot = cuda.blockIdx.x, cuda.blockIdx.y
        width = w0.shape[2]
        s, group_n0 = slice_and_group(width, BLOCK_N)  # the slice, the group's first column
        w = w0 if s == 0 else w1
        start, pairs, expert = block_in_use(
            b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:
            return  # the whole block leaves together, before any barrier
        num_pairs = out.shape[0]
        column0 = offset + s * width
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        n0 = group_n0 + warp * WARP_N  # the warp's first column
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]

        # B's fragments, once: the lane's row n0 + 8 nj + g, its word 4 kk + t of each step.
        b_hi = cuda.local.array(B_FRAGMENTS, uint32)  # bf16 B itself, or fp16 B's hi
        b_lo = cuda.local.array(B_FRAGMENTS, uint32)  # fp16 B's lo (unused for bf16)
        for nj in range(N_TILES):
            n = min(n0 + 8 * nj + g, width - 1)  # past the slice: never stored
            b_row = w[slot, expert, n]
            for kk in range(K_STEPS):
                k = 4 * kk + t
                word = b_row[k] if k < WORDS else int64(0)
                f = (kk * N_TILES + nj) * 2
                low, high = word_halves(word)
                if SPLIT_B:
                    b_hi[f], b_lo[f] = split_f16_pair(low)
                    b_hi[f + 1], b_lo[f + 1] = split_f16_pair(high)
                else:
                    b_hi[f], b_hi[f + 1] = low, high

        pair_of = cuda.local.array(ROWS, int64)  # the pair of tile row g + 8 i, -1: none
        a_hi = cuda.local.array(A_FRAGMENTS, uint32)
        a_lo = cuda.local.array(A_FRAGMENTS, uint32)
        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + q]
        for first in range(0, pairs, TILE_M):  # passes: entries first .. first + TILE_M - 1
            # passes with no pair are skipped by the whole block; pair_of: the lane's tile rows
            if not read_pass(
                pair_of,
                TILE_M,
                g,
                first,
                sorted_ids,
                slot,
                start,
                pairs,
                num_pairs,
                1,
                True,
                False,
            ):
                continue

            # The buffer rows' fragments, split: row g + 8 (i % 2) of m-tile i // 2 gives
            # a0 / a2 (i even) or a1 / a3 (i odd).
            for kk in range(K_STEPS):
                k = 16 * kk + 4 * t  # the lane's first rank of the step
                for i in range(ROWS):
                    v0, v1, v2, v3 = float32(0.0), float32(0.0), float32(0.0), float32(0.0)
                    if pair_of[i] >= 0 and k < RANK:  # (RANK a multiple of 4: k + 3 too)
                        v0, v1, v2, v3 = load_four(x[s, pair_of[i]], k)
                    f = (kk * M_TILES + i // 2) * 4 + i % 2
                    a_hi[f], a_lo[f] = split_pair(v0, v1)
                    a_hi[f + 2], a_lo[f + 2] = split_pair(v2, v3)

            for o in range(OUTPUTS):
                acc[o] = float32(0.0)
            for kk in range(K_STEPS):
                for mi in range(M_TILES):
                    fa = (kk * M_TILES + mi) * 4
                    for nj in range(N_TILES):
                        fb = (kk * N_TILES + nj) * 2
                        o = (mi * N_TILES + nj) * 4
                        # Small terms first, into one fp32 accumulator (module notes).
                        add_product(
                            acc, o, a_lo[fa], a_lo[fa + 1], a_lo[fa + 2], a_lo[fa + 3],
                            b_hi[fb], b_hi[fb + 1], my_scratch,
                        )  # fmt: skip
                        if SPLIT_B:
                            add_product(
                                acc, o, a_hi[fa], a_hi[fa + 1], a_hi[fa + 2], a_hi[fa + 3],
                                b_lo[fb], b_lo[fb + 1], my_scratch,
                            )  # fmt: skip
                        add_product(
                            acc, o, a_hi[fa], a_hi[fa + 1], a_hi[fa + 2], a_hi[fa + 3],
                            b_hi[fb], b_hi[fb + 1], my_scratch,
                        )  # fmt: skip

            # Lane's outputs: rows g, g + 8 of each m-tile, columns 2t, 2t + 1 of each n-tile.
            for i in range(ROWS):
                p = pair_of[i]
                if p >= 0:
                    weight = float32(weights[p]) if WEIGHTED else float32(1.0)
                    for nj in range(N_TILES):
                        for c in range(2):
                            n = n0 + 8 * nj + 2 * t + c
                            if n < width:
                                value = acc[((i // 2) * N_TILES + nj) * 4 + 2 * (i % 2) + c]
                                if WEIGHTED:
                                    value *= weight
                                if ADD_INPUTS:  # the old output is added last (the op's order)
                                    value += load_out(out[p, column0 + n])
                                out[p, column0 + n] = store_out(value)

    return moe_expand_mma
