"""The tensor-core shrink (:mod:`.shrink_mma`) with K split over blocks: ``out[s, t, :] (+)=
scaling * x[t] @ A_s[slot(t)]^T``, a block per (tile, slice, rank group, run of K).

Each block of :mod:`.shrink_mma` walks the whole K, so its time is a chain of passes, each
waiting on its loads: at K=14336, 448 chunks over 16 warps of two chunks a pass make 14
passes, and the H200's tuned table (at cc380e6) has that kernel at about 12 µs whatever the
tokens, from T=1 to 128, where the bytes take 0.5-2 µs. Few tokens a slot make few blocks
too (T=32 over 8 LoRAs at r=32: 8 tiles x 4 groups of 8 ranks = 32 blocks for 132 SMs). Here
K's chunks of 32 elements are cut into ``splits`` runs of ``ceil(chunks / splits)``, a block
each along grid.z; a block's warps walk its run as in :mod:`.shrink_mma` (its parts:
:func:`.shrink_mma.mma_shrink_parts`), add their tiles in warp order, and store the block's
sums into the fp32 workspace of :mod:`.shrink_split` (``[split, slice, token, rank]``); the
last block of each (tile, slice, rank group) to arrive adds the runs' sums in order and
writes the output (:func:`.shrink_split.last_block_adds`, the row split shrink's own code:
one integer atomic a block, no float atomics, so the bits depend only on the warps, the
splits and K: the key ``("mma", threads, splits)``). Only that last block reads the old
outputs (``accumulate``). A run past the end of K (a short K in many chunks) walks nothing
and still counts in. On the H200 (v33, ``h200_v33_split_probe.json``) it won from K=9728
where the slots hold 16 tokens or more and the unsplit blocks are at most 32 (K=28672, r=16,
T=128 on one LoRA: 20.9 -> 9.6 µs) and lost with fewer tokens (it never took less than 5.6
µs at K=4096) or more blocks (:mod:`..launch` says where the heuristic takes it). Those
times carry a fill of the counters that each captured call made until 8e0a61b
(:mod:`.shrink_split`, "The workspace"): without it, on an H100, 4 runs of K took 8.36 µs
at K=14336, r=32, 32 tokens over 8 LoRAs, where the rows took 9.04.

**In one cluster.** On Hopper the runs of a tile can instead add up in one thread block
cluster, with no workspace: :mod:`.shrink_mma_cluster`.

Memory traffic per block: ``1 / splits`` of :mod:`.shrink_mma`'s x and A, and ``TILE_M *
TILE_N`` partial sums written; the last block of a group reads ``splits`` of them per output
and reads and writes the output.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .mma import FRAGMENT_WORDS
from .segments import read_tile, tile_and_slice, tile_token
from .shrink_mma import mma_shrink_parts
from .shrink_split import last_block_adds

__all__ = ["build_split_mma_shrink_kernel", "run_walker"]


@functools.cache
def run_walker(
    dtype, threads: int, m_tiles: int, n_tiles: int, wide: bool, ahead: int, splits: int
):
    """``(parts, walk_run)``: the parts of the tensor-core shrink (:func:`.shrink_mma
    .mma_shrink_parts`) and the device function ``walk_run(x, w, slot, token, partials,
    my_scratch) -> n0`` of a block of a split launch: its run of K (``blockIdx.z`` of
    ``splits``) over ``w[slot]``'s group of ranks (``blockIdx.y``), walked by its warps, their
    tiles in ``partials`` (then a barrier); its first rank. This kernel's and the cluster's
    (:mod:`.shrink_mma_cluster`)."""
    parts = mma_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, ahead=ahead)
    walk, tile_to_shared = parts.walk, parts.tile_to_shared
    OUTPUTS, TILE_N, SPLITS = parts.outputs, parts.tile_n, splits

    @cuda.jit(device=True, inline="always")
    def walk_run(x, w, slot, token, partials, my_scratch):
        n0 = cuda.blockIdx.y * TILE_N
        chunks = (x.shape[1] + 7) // 8
        per_split = (chunks + SPLITS - 1) // SPLITS  # chunks of 32 elements a block walks
        first_chunk = cuda.blockIdx.z * per_split
        end_chunk = min(chunks, first_chunk + per_split)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        acc = cuda.local.array(OUTPUTS, float32)
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        walk(x, w, slot, token, n0, g, t, warp, first_chunk, end_chunk, acc, my_scratch)
        tile_to_shared(acc, partials, warp, g, t)
        return n0

    return parts, walk_run


@functools.cache
def build_split_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    splits: int,
    accumulate: bool = True,
    wide: bool = True,
    ahead: int = 1,
):
    """:func:`.shrink_mma.build_mma_shrink_kernel`'s specialisation, and the runs K is cut
    into (``splits``, a block each along grid.z). The kernel takes the workspace of
    :func:`.shrink_split.split_workspace` after the slice count."""
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    parts, walk_run = run_walker(dtype, threads, m_tiles, n_tiles, wide, ahead, splits)
    warps_total = parts.warps_total
    THREADS, WARPS, ROWS = threads, parts.warps, parts.rows
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SCRATCH_WARPS = parts.scratch_warps

    begin = prologue()
    arrived_last, add_chunks = last_block_adds(splits, out_dtype, accumulate)

    @jit_kernel(THREADS)
    def shrink_split_k(
        x, w0, w1, w2, out, slice_base, slices, workspace, arrivals, tiles, sorted_tokens, scaling
    ):
        # As shrink_mma's kernel; workspace: fp32, at least [SPLITS, slices, M, R] flat; arrivals:
        # int32, at least [gridDim.x, gridDim.y] flat, all 0
        # grid: (tiles * slices, rank groups, SPLITS)
        begin()
        tile, s_local = tile_and_slice(cuda.blockIdx.x, slices)
        slot, position, rows, first_token = read_tile(tiles, tile)
        if slot == -1:
            return  # every chunk of this tile leaves, before any barrier or count
        if s_local == 0:  # by hand, as in shrink_mma
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        rank = w.shape[1]
        tid = cuda.threadIdx.x
        g = (tid % 32) // 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[tid // 32 if SIMULATOR else 0]
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)
        last = cuda.shared.array(1, int32)

        token = cuda.local.array(ROWS, int64)
        for i in range(ROWS):
            token[i] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * i)
        n0 = walk_run(x, w, slot, token, partials, my_scratch)

        # This chunk's sums into the workspace: [split, s_local, token, rank] ...
        plane = slices * x.shape[0] * rank  # elements of one split's [S, M, R]
        out_token = cuda.local.array(PER_THREAD, int64)  # -1: no output of this thread
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            out_token[j] = -1
            if e < TILE_M * TILE_N and row < rows and n0 + n < rank:
                out_token[j] = tile_token(sorted_tokens, position, rows, first_token, row)
                at = (s_local * x.shape[0] + out_token[j]) * rank + n0 + n
                workspace[cuda.blockIdx.z * plane + at] = warps_total(partials, row, n)
        # ... and the last block of the (tile, slice, rank group) adds them in order.
        counter = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y
        if not arrived_last(arrivals, counter, last):
            return
        for j in range(PER_THREAD):
            if out_token[j] >= 0:
                n = n0 + (tid + THREADS * j) % TILE_N
                at = (s_local * x.shape[0] + out_token[j]) * rank + n
                add_chunks(out, out_slice, out_token[j], n, workspace, plane, at, scaling)
        if tid == 0:
            arrivals[counter] = 0  # ready for the next launch (and graph replay)

    return shrink_split_k
