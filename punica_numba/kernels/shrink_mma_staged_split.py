"""The staged tensor-core shrink (:mod:`.shrink_mma_staged`) with K split over blocks:
``out[s, t, :] (+)= scaling * x[t] @ A_s[slot(t)]^T``, a block per (tile, slice, rank group,
run of K).

A staged block's tile is large (32 tokens x 128 ranks), so a call has few of them: BLOOM's QKV
at r=128, 512 tokens on one LoRA, makes 16 tiles x 3 slices = 48 blocks for 132 SMs, each
walking all 14336 elements of K. Here K's chunks of 32 elements are cut into ``splits`` runs, a
block each along grid.z, as :mod:`.shrink_mma_split` cuts :mod:`.shrink_mma`'s: each block walks
its run through the stages (:func:`.shrink_mma_staged.staged_shrink_parts`), stores its sums
into the fp32 workspace of :mod:`.shrink_split` (``[run, slice, token, rank]``), and the last
block of each (tile, slice, rank group) to arrive adds the runs' sums in order and writes the
output (:func:`.shrink_split.last_block_adds`). An output's sum is then what one warp of
:mod:`.shrink_mma_split` adds over the same runs: the key ``("mma", 32, splits)``.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .shrink_mma_staged import staged_shrink_parts
from .shrink_split import last_block_adds

__all__ = ["build_split_staged_mma_shrink_kernel"]


@functools.cache
def build_split_staged_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    splits: int,
    accumulate: bool = True,
    wide: bool = True,
    stages: int = 0,
):
    """:func:`.shrink_mma_staged.build_staged_mma_shrink_kernel`'s specialisation, and the
    runs K is cut into (``splits``, a block each along grid.z). The kernel takes the
    workspace of :func:`.shrink_split.split_workspace` after the slice count."""
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    parts = staged_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, stages=stages)
    block_sums, place = parts.block_sums, parts.place
    arrived_last, add_chunks = last_block_adds(splits, out_dtype, accumulate)
    THREADS, OUTPUTS, LANE_ROWS, SPLITS = threads, parts.outputs, parts.lane_rows, splits
    M_TILES, N_TILES = parts.m_tiles, parts.n_tiles

    begin = prologue()

    @jit_kernel(THREADS, shared_bytes=parts.shared_bytes)
    def shrink_split_k(
        x, w0, w1, w2, out, slice_base, slices, workspace, arrivals, tiles, sorted_tokens, scaling
    ):
        # As the staged kernel's; workspace: fp32, at least [SPLITS, slices, M, R] flat;
        # arrivals: int32, at least [gridDim.x, gridDim.y] flat, all 0
        # grid: (tiles * slices, rank groups, SPLITS)
        begin()
        acc = cuda.local.array(OUTPUTS, float32)
        lane_token = cuda.local.array(LANE_ROWS, int64)
        leaves, s_local, n0, rows = block_sums(
            x, w0, w1, w2, slices, tiles, sorted_tokens, acc, lane_token, cuda.blockIdx.z, SPLITS
        )
        if leaves:
            return  # every run of this tile leaves, before any barrier or count
        last = cuda.shared.array(1, int32)
        rank, g = w0.shape[1], cuda.threadIdx.x % 32 // 4
        plane = slices * x.shape[0] * rank  # elements of one run's [S, M, R]
        for mi in range(M_TILES):  # this run's sums into the workspace ...
            for nj in range(N_TILES):
                for i in range(4):
                    p, r, n = place(mi, nj, i, n0)
                    if g + 8 * r < rows and n < rank:
                        at = (s_local * x.shape[0] + lane_token[r]) * rank + n
                        workspace[cuda.blockIdx.z * plane + at] = acc[p]
        counter = cuda.blockIdx.x * cuda.gridDim.y + cuda.blockIdx.y
        if not arrived_last(arrivals, counter, last):
            return
        s = slice_base + s_local
        for mi in range(M_TILES):  # ... and the last block adds the runs' sums in order
            for nj in range(N_TILES):
                for i in range(4):
                    _, r, n = place(mi, nj, i, n0)
                    if g + 8 * r < rows and n < rank:
                        at = (s_local * x.shape[0] + lane_token[r]) * rank + n
                        add_chunks(out, s, lane_token[r], n, workspace, plane, at, scaling)
        if cuda.threadIdx.x == 0:
            arrivals[counter] = 0  # ready for the next launch (and graph replay)

    return shrink_split_k
