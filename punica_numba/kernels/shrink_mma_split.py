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

**In one cluster** (``cluster``, compute capability 9.0). At a down projection with few
tokens a slot, more runs of K did not make the blocks faster (on an H100 at 34f92e6,
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

Memory traffic per block: ``1 / splits`` of :mod:`.shrink_mma`'s x and A, and ``TILE_M *
TILE_N`` partial sums written; the last block of a group reads ``splits`` of them per output
and reads and writes the output (in a cluster, run 0 reads the other runs' sums from their
shared memory, and reads and writes the output).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .cluster import PORTABLE_CLUSTER, cluster_device_functions
from .dependent_launch import prologue
from .dtypes import loader, storer
from .mma import FRAGMENT_WORDS
from .segments import read_tile, tile_and_slice, tile_token
from .shrink_mma import mma_shrink_parts
from .shrink_split import last_block_adds

__all__ = ["build_split_mma_shrink_kernel"]


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
    cluster: bool = False,
):
    """:func:`.shrink_mma.build_mma_shrink_kernel`'s specialisation, and the runs K is cut
    into (``splits``, a block each along grid.z). The kernel takes the workspace of
    :func:`.shrink_split.split_workspace` after the slice count; with ``cluster``, none: it
    is launched in clusters of the ``splits`` runs of a tile ("In one cluster"; GPU only,
    compute capability 9.0, ``splits`` from 2 to 8)."""
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    if cluster and (SIMULATOR or not 2 <= splits <= PORTABLE_CLUSTER):
        raise ValueError(
            f"a cluster takes 2-{PORTABLE_CLUSTER} runs of K on a GPU, got splits={splits}"
            + (" on the simulator" if SIMULATOR else "")
        )
    parts = mma_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, ahead=ahead)
    walk, tile_to_shared, warps_total = parts.walk, parts.tile_to_shared, parts.warps_total
    THREADS, WARPS, ROWS, OUTPUTS = threads, parts.warps, parts.rows, parts.outputs
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SCRATCH_WARPS = parts.scratch_warps
    SPLITS = splits

    begin = prologue()

    @cuda.jit(device=True, inline="always")
    def walk_run(x, w, slot, token, partials, my_scratch):
        """This block's run of K over ``w[slot]``'s group of ranks, walked by its warps,
        their tiles in ``partials`` (then a barrier); its first rank."""
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

    if cluster:
        return _cluster_kernel(parts, begin, walk_run, splits, out_dtype, accumulate)
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


def _cluster_kernel(parts, begin, walk_run, splits: int, out_dtype, accumulate: bool):
    """The kernel of "In one cluster": each run's sums stay in its block's shared memory,
    and the cluster's first block (run 0) adds them in order and writes the output."""
    cluster_sync, cluster_load = cluster_device_functions()
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    warps_total = parts.warps_total
    THREADS, WARPS, ROWS = 32 * parts.warps, parts.warps, parts.rows
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SUMS = TILE_M * TILE_N
    SPLITS, ACCUMULATE = splits, accumulate

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
