"""The tensor-core shrink (:mod:`.shrink_mma`) with a layer's slices side by side: a block
takes a tile's ranks of every slice, so that it reads the tile's rows of x once, not once a
slice.

:mod:`.shrink_mma` gives each slice blocks of its own (``blockIdx.x = tile * slices +
slice``): the three blocks of a QKV tile find x's rows in L2 after the first, but each still
reads all of them. Where a block's K is long and its ranks few, those reads are most of its
work: at r=16 a block of every rank reads 16 rows of x and 16 rows of A a tile. In the H200's
grid (``docs/benchmarks/h200_grid.json``, 23fb2ea) the shrinks of 8192 tokens whose floor is
mostly x reach 77-87 % of the copy bandwidth on one slice (Qwen3-4B's and BLOOM's down at
r=8 over 256 LoRAs, 16 warps of every rank) and 30-53 % on three (BLOOM's QKV at r=8 over 256
LoRAs, the same blocks, 53 %; Llama-3-8B's at r=16 over 8 LoRAs, 58.5 µs for a floor of 17.5,
8 warps of a slice's 16 ranks; at 2048 tokens 32.3 µs for 5.0, 16 warps of 8 ranks, x read
six times). Here a block's ranks are the slices' side by side, joint rank ``n`` being rank
``n - s r`` of slice ``s`` (``S r`` joint ranks in all):

* block: tile ``blockIdx.x``, and ``8 * N_TILES`` joint ranks from ``blockIdx.y * TILE_N``;
  a group may straddle slices (r=16 QKV in groups of 24: ranks 0-15 of q and 0-7 of k, then
  8-15 of k and 0-15 of v), since each lane reads the row of A of its own joint rank (a
  branch a load: :func:`.shrink_mma._row_side_by_side`); a group past the joint ranks
  (several launches' slices, the last one fewer) leaves at once;
* the walk over K, the warps' sums in shared memory and the stores are :mod:`.shrink_mma`'s
  (:func:`.shrink_mma.mma_shrink_parts` with ``joint``), and each output's sum is the same:
  the steps of its chunks in order, a warp's chunks in order, then the warps in order, none
  of which depends on which other ranks share its block. So its bits are those of
  :mod:`.shrink_mma` at the same threads (the arithmetic key ``("mma", threads)``).

Memory traffic per block: ``TILE_M * K`` elements of x, ``TILE_N * K`` of A (joint ranks,
from L2 after the first tile of a slot), ``TILE_M * TILE_N`` outputs (read too when
``accumulate``). At r=16, QKV, T=8192 over 8 LoRAs, in groups of 48 (every joint rank), the
512 tiles read x's 67 MB once and A's 48 rows once a tile: 268 MB through L2, where blocks of
one slice's 16 ranks read 402 MB (x three times). Counts, not measurements: the H200 has not
timed this kernel yet.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, storer
from .mma import FRAGMENT_WORDS
from .segments import joint_place, read_tile, tile_token
from .shrink_mma import mma_shrink_parts

__all__ = ["build_joint_mma_shrink_kernel"]


@functools.cache
def build_joint_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    accumulate: bool = True,
    wide: bool = True,
):
    """:func:`.shrink_mma.build_mma_shrink_kernel`'s specialisation, with ``n_tiles``
    8-rank tiles of the slices' joint ranks a block (``blockIdx.y`` numbers the block's
    group). The kernel takes the same arguments; its grid is ``(tiles, joint rank groups,
    1)``."""
    parts = mma_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, joint=True)
    walk, tile_to_shared, warps_total = parts.walk, parts.tile_to_shared, parts.warps_total
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, WARPS, ROWS, OUTPUTS = threads, parts.warps, parts.rows, parts.outputs
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SCRATCH_WARPS = parts.scratch_warps
    ACCUMULATE = accumulate

    begin = prologue()

    @jit_kernel(THREADS)
    def shrink_joint(x, w0, w1, w2, out, slice_base, slices, tiles, sorted_tokens, scaling):
        # x: [M, K/4] int64 words; w*: [L, R, K/4] words; out: [S, M, R]; tiles: [B, 4]
        # grid: (tiles, joint rank groups, 1)
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_tile(tiles, cuda.blockIdx.x)
        rank = w0.shape[1]
        ranks = slices * rank  # joint ranks: the slices' side by side
        n0 = cuda.blockIdx.y * TILE_N  # the block's first joint rank
        if slot == -1 or n0 >= ranks:
            return
        w = (w0, w1, w2, slices)
        chunks = (x.shape[1] + 7) // 8  # 32 elements = 8 words per chunk
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)

        token = cuda.local.array(ROWS, int64)  # row g + 8 * i of the tile
        for i in range(ROWS):
            token[i] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * i)
        # The outputs this thread will store, and (accumulate) their old values, now.
        out_token = cuda.local.array(PER_THREAD, int64)
        old = cuda.local.array(PER_THREAD, float32)
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            out_token[j] = tile_token(sorted_tokens, position, rows, first_token, row)
            old[j] = float32(0.0)
            if ACCUMULATE and e < TILE_M * TILE_N:
                s, r = joint_place(min(n0 + n, ranks - 1), rank)
                old[j] = load_out(out[slice_base + s, out_token[j], r])

        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + i]
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        walk(x, w, slot, token, n0, g, t, warp, 0, chunks, acc, my_scratch)

        tile_to_shared(acc, partials, warp, g, t)
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            if e < TILE_M * TILE_N and row < rows and n0 + n < ranks:
                total = warps_total(partials, row, n)
                s, r = joint_place(n0 + n, rank)
                out[slice_base + s, out_token[j], r] = store_out(old[j] + scaling * total)

    return shrink_joint
