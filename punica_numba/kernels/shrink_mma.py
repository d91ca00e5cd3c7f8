"""The tensor-core shrink: the op of :mod:`.shrink`, 16 tokens of one slot at a time.

With many tokens per slot the FFMA shrink spends its time on arithmetic, not memory
(T=4096 on one LoRA: 51 µs, 16 % of the copy bandwidth, in v6; 24.7 µs here, v7). A warp's
``mma.sync`` (:mod:`.mma`) does 16 tokens x 8 ranks x 16 hidden elements at once, and
x and A are 16-bit already, so the products are exact and nothing is split:

* block: a tile of ``16 * M_TILES`` tokens of one segment (``blockIdx.x``, the tile
  table), one slice (``.y``), every rank (``8 * N_TILES`` >= r);
* the hidden dimension is cut in steps of 16; warp ``w`` takes steps ``w, w + WARPS,
  ...`` (so the block's warps read neighbouring stretches of each row), loading
  ``UNROLL`` steps' fragments before it multiplies any, for more loads in flight;
* both operands keep the hidden dimension contiguous, so each fragment register is
  one 32-bit load of two neighbouring elements (``[.., K/2]`` int32 views), no shared
  memory;
* the warps' partial tiles are added in shared memory, in warp order, and each output
  is written by one thread: ``old + scaling * sum`` (``accumulate``) or the product
  alone.

The order of the sum (the tensor cores' within a step, then steps in order per warp,
then warps in order) is fixed for a given number of warps: its arithmetic key is
``("mma", threads)``. Every step ``w + j * WARPS`` is visited by every warp's loop,
past the end with zero fragments, so that all threads call ``mma`` equally often (the
simulator needs it).

Memory traffic per block: ``TILE_M * K`` elements of x, ``r * K`` of A (from L2 after
the first tile of a slot), ``TILE_M * r`` outputs (read too when ``accumulate``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int32, int64, uint32

from .._cuda import SIMULATOR, cuda
from .dtypes import loader, storer
from .mma import FRAGMENT_WORDS, mma_m16n8k16
from .segments import read_tile, tile_token

__all__ = ["build_mma_shrink_kernel"]


@functools.cache
def build_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    accumulate: bool = True,
):
    """Compile-time specialisation: the dtype of x and A (bf16 or fp16), the output's,
    warps per block (``threads // 32``), 16-token tiles per block, 8-rank tiles (``8 *
    n_tiles >= r``), and whether the products are added to the output or stored.

    The kernel takes x as ``[T, K/2]`` and A as ``[L, r, K/2]`` int32 pairs (K even)."""
    if threads % 32:
        raise ValueError(f"threads must be whole warps, got {threads}")
    mma = mma_m16n8k16(dtype)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, WARPS, M_TILES, N_TILES = threads, threads // 32, m_tiles, n_tiles
    TILE_M, TILE_N = 16 * m_tiles, 8 * n_tiles
    ROWS = 2 * M_TILES  # token rows a lane reads: g + 8 * i
    # Steps loaded before any is used: up to 32 registers of fragments per lane (r=16:
    # 4 steps; r=64: 1).
    UNROLL = max(1, 32 // (2 * ROWS + 2 * N_TILES))
    STRIDE = WARPS * UNROLL  # steps one pass of the block covers
    X_WORDS, W_WORDS = UNROLL * ROWS * 2, UNROLL * N_TILES * 2  # fragment registers held
    OUTPUTS = M_TILES * N_TILES * 4
    PER_THREAD = -(-TILE_M * TILE_N // THREADS)  # outputs each thread stores
    SCRATCH_WARPS = WARPS if SIMULATOR else 1
    ACCUMULATE = accumulate

    @cuda.jit
    def shrink(x, w0, w1, w2, out, slice_base, tiles, sorted_tokens, scaling):
        # x: [M, K/2] int32 pairs; w*: [L, R, K/2] pairs; out: [S, M, R]; tiles: [4, B]
        slot, position, rows, first_token = read_tile(tiles)
        if slot == -1:
            return
        s_local = cuda.blockIdx.y
        if s_local == 0:
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        rank = w.shape[1]
        pairs = x.shape[1]
        steps = (pairs + 7) // 8  # 16 elements = 8 pairs per step
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)

        token = cuda.local.array(ROWS, int64)  # row g + 8 * i of the tile
        for i in range(ROWS):
            token[i] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * i)
        # The outputs this thread will store, and (accumulate) their old values, now:
        # that trip to memory overlaps the products.
        out_token = cuda.local.array(PER_THREAD, int64)
        old = cuda.local.array(PER_THREAD, float32)
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            out_token[j] = tile_token(sorted_tokens, position, rows, first_token, row)
            old[j] = float32(0.0)
            if ACCUMULATE and e < TILE_M * TILE_N:
                old[j] = load_out(out[out_slice, out_token[j], min(n, rank - 1)])

        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + i]
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        xa = cuda.local.array(X_WORDS, int32)  # [u, row, a0-or-a2]
        wb = cuda.local.array(W_WORDS, int32)  # [u, n tile, b0-or-b1]
        for first in range(0, steps, STRIDE):
            for u in range(UNROLL):  # every load of the pass first
                q = 8 * (first + u * WARPS + warp) + t  # pair of k = 16 step + 2t
                for i in range(ROWS):
                    xa[(u * ROWS + i) * 2] = x[token[i], q] if q < pairs else 0
                    xa[(u * ROWS + i) * 2 + 1] = x[token[i], q + 4] if q + 4 < pairs else 0
                for nj in range(N_TILES):
                    n = min(8 * nj + g, rank - 1)  # B's column g: rank n (past r: unused)
                    wb[(u * N_TILES + nj) * 2] = w[slot, n, q] if q < pairs else 0
                    wb[(u * N_TILES + nj) * 2 + 1] = w[slot, n, q + 4] if q + 4 < pairs else 0
            for u in range(UNROLL):
                for mi in range(M_TILES):
                    a = (u * ROWS + 2 * mi) * 2  # rows g (a0, a2) and g + 8 (a1, a3)
                    for nj in range(N_TILES):
                        b = (u * N_TILES + nj) * 2
                        p = (mi * N_TILES + nj) * 4
                        acc[p], acc[p + 1], acc[p + 2], acc[p + 3] = mma(
                            xa[a],
                            xa[a + 2],
                            xa[a + 1],
                            xa[a + 3],
                            wb[b],
                            wb[b + 1],
                            acc[p],
                            acc[p + 1],
                            acc[p + 2],
                            acc[p + 3],
                            my_scratch,
                        )

        for mi in range(M_TILES):
            for nj in range(N_TILES):
                for i in range(4):  # (g + 8 * (i // 2), 2t + i % 2) of the product tile
                    row = 16 * mi + g + 8 * (i // 2)
                    partials[warp, row, 8 * nj + 2 * t + i % 2] = acc[(mi * N_TILES + nj) * 4 + i]
        cuda.syncthreads()
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            if e < TILE_M * TILE_N and row < rows and n < rank:
                total = partials[0, row, n]
                for v in range(1, WARPS):
                    total += partials[v, row, n]
                out[out_slice, out_token[j], n] = store_out(old[j] + scaling * total)

    return shrink
