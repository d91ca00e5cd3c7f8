"""The tensor-core split shrink (:mod:`.shrink_mma_split`) with a tile's runs of K added up in one
thread block cluster: ``out[s, t, :] (+)= scaling * x[t] @ A_s[slot(t)]^T``, a block per (tile,
slice, rank group, run of K), the runs of a (tile, slice, rank group) one cluster.

**Why.** At a down projection with few tokens a slot, more runs of K did not make the blocks
faster (on an H100 at 34f92e6,
``h100_split_configs_34f92e6.json``: K=14336, r=32, 32 tokens over 8 LoRAs, 7.8-9.2 µs for
4, 8, 16 or 32 runs, 8-16 warps, 8-16 ranks a block, where moving the bytes at the copy
bandwidth takes under 3): what a block does after its walk does not shrink with it. That
is a chain of trips through L2: the sums stored, ``threadfence``, the count, and the last
block's reads. On Hopper the runs of a tile can instead be one *thread block cluster*
(:mod:`.cluster`): the ``splits`` blocks along grid.z are placed together on one GPC, each
leaves its sums in its own shared memory, all wait at one cluster barrier, and run 0 reads
the others' sums over the SMs' network (distributed shared memory), adds them in the same
order, ``((s_0 + s_1) + s_2) + ...``, and writes ``old + scaling * sum``: the same bits as
the workspace's form (one arithmetic key), with no workspace, no counter and no fence. A
second barrier keeps every block until run 0 has read it. Run 0 asks for its outputs'
tokens and old values before its walk, so that they are no trip after the sums. Clusters
hold at most 8 blocks on every GPU that has them: 2-8 runs.

GPU only (compute capability 9.0; :mod:`.cluster`): the simulator cannot run it, and
:mod:`..launch` offers it only on the GPU.

Memory traffic per block: ``1 / splits`` of :mod:`.shrink_mma`'s x and A; run 0 also reads
the other runs' ``TILE_M * TILE_N`` sums from their shared memory, and reads and writes the
output.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .cluster import PORTABLE_CLUSTER, cluster_device_functions
from .dependent_launch import prologue
from .dtypes import loader, storer
from .mma import FRAGMENT_WORDS
from .segments import read_tile, tile_and_slice, tile_token
from .shrink_mma_split import run_walker

__all__ = ["build_cluster_mma_shrink_kernel"]


@functools.cache
def build_cluster_mma_shrink_kernel(
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
    """:func:`.shrink_mma_split.build_split_mma_shrink_kernel`'s specialisation (the same
    arguments), launched in clusters of the ``splits`` runs of a tile (2 to 8); the kernel
    takes no workspace."""
    if SIMULATOR or not 2 <= splits <= PORTABLE_CLUSTER:
        raise ValueError(
            f"a cluster takes 2-{PORTABLE_CLUSTER} runs of K on a GPU, got splits={splits}"
            + (" on the simulator" if SIMULATOR else "")
        )
    parts, walk_run = run_walker(dtype, threads, m_tiles, n_tiles, wide, ahead, splits)
    cluster_sync, cluster_load = cluster_device_functions()
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    warps_total = parts.warps_total
    THREADS, WARPS, ROWS = threads, parts.warps, parts.rows
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SUMS = TILE_M * TILE_N
    SPLITS, ACCUMULATE = splits, accumulate

    begin = prologue()

    @jit_kernel(THREADS, cluster=SPLITS)
    def shrink_cluster_k(x, w0, w1, w2, out, slice_base, slices, tiles, sorted_tokens, scaling):
        # As shrink_split_k without a workspace; grid: (tiles * slices, rank groups, SPLITS),
        # in clusters of the SPLITS runs of a tile, slice and rank group (1, 1, SPLITS)
        begin()
        tile, s_local = tile_and_slice(cuda.blockIdx.x, slices)
        slot, position, rows, first_token = read_tile(tiles, tile)
        if slot == -1:
            return  # the whole cluster leaves (its blocks share the tile), before any barrier
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
        scratch = cuda.shared.array((1, 32, FRAGMENT_WORDS), uint32)
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)
        sums = cuda.shared.array(SUMS, float32)  # this run's sums, which run 0 reads

        token = cuda.local.array(ROWS, int64)
        for i in range(ROWS):
            token[i] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * i)
        # Run 0 stores the outputs: it asks for their tokens and old values now, so that
        # they are no trip to memory after the sums.
        first = cuda.blockIdx.z == 0
        out_token = cuda.local.array(PER_THREAD, int64)  # -1: no output of this thread
        old = cuda.local.array(PER_THREAD, float32)
        n0 = cuda.blockIdx.y * TILE_N
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            out_token[j] = -1
            old[j] = float32(0.0)
            if first and e < SUMS and row < rows and n0 + n < rank:
                out_token[j] = tile_token(sorted_tokens, position, rows, first_token, row)
                if ACCUMULATE:
                    old[j] = load_out(out[out_slice, out_token[j], n0 + n])
        walk_run(x, w, slot, token, partials, scratch[0])
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            if e < SUMS:
                sums[e] = warps_total(partials, e // TILE_N, e % TILE_N)
        cluster_sync()  # every run's sums are in its block's shared memory
        runs = cuda.local.array(SPLITS, float32)
        for j in range(PER_THREAD):
            if out_token[j] >= 0:
                e = tid + THREADS * j
                for c in range(SPLITS):  # every run's sum asked for before any is added
                    runs[c] = cluster_load(sums, e, c)
                total = runs[0]
                for c in range(1, SPLITS):  # then runs 1, 2, ..., SPLITS - 1, in order
                    total += runs[c]
                n = n0 + e % TILE_N
                out[out_slice, out_token[j], n] = store_out(old[j] + scaling * total)
        cluster_sync()  # no block leaves while run 0 may still read its sums

    return shrink_cluster_k
