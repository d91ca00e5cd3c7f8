"""The shrink kernel: ``out[s, t, :] += scaling * x[t] @ A_s[slot(t)]^T``, segment by segment.

Work split (one block = one tile of tokens of one slot, one slice, some ranks):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``TILE_N`` ranks; groups stride by ``gridDim.z``.

Inside a block, thread ``tid`` walks the hidden dimension ``k = tid, tid + THREADS, ...``
and keeps ``TILE_M * TILE_N`` partial dot products in registers; the block then adds
the partials of its threads with a tree in shared memory (a fixed order, so the
result is the same bits on every run: no atomics). Each output element is written
by exactly one thread: read, add, write.

Memory traffic per block: ``TILE_M`` rows of x (``TILE_M * K`` elements) and
``TILE_N`` rows of A (``TILE_N * K``), each read once; ``TILE_M * TILE_N`` outputs.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda
from .dtypes import loader
from .segments import find_tile

__all__ = ["MAX_SLICES", "build_shrink_kernel"]

#: Slices one launch covers. The weights of each slice arrive as separate arguments
#: (Numba kernels take no arrays of arrays), so the number is fixed; vLLM's layers use
#: at most 3 (q/k/v). More slices take more launches.
MAX_SLICES = 3


@functools.cache
def build_shrink_kernel(
    x_dtype: torch.dtype, w_dtype: torch.dtype, threads: int, tile_m: int, tile_n: int
):
    """Compile-time specialisation: dtypes, threads per block and tile sizes are constants.

    They must be constants because they size local (register) and shared arrays and
    the loops over them, which Numba unrolls only when the trip count is known.
    """
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the tree reduction, got {threads}")
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    THREADS, TILE_M, TILE_N = threads, tile_m, tile_n
    PARTIALS = TILE_M * TILE_N  # dot products one block computes per rank group

    @cuda.jit
    def shrink(x, w0, w1, w2, out, slice_base, sorted_tokens, counts, starts, lora_ids, scaling):
        # x: [M, K]; w*: [L, R, K]; out: [S, M, R] (fp32 in practice); metadata int32.
        segment, first = find_tile(cuda.blockIdx.x, lora_ids, counts, TILE_M)
        if segment == -1:
            return  # the whole block leaves together, before any barrier
        slot = lora_ids[segment]
        rows = min(TILE_M, counts[segment] - first)  # valid tokens in this tile
        s_local = cuda.blockIdx.y
        if s_local == 0:
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        rank = w.shape[1]
        hidden = x.shape[1]
        tid = cuda.threadIdx.x

        # The tile's token rows; a short tile repeats its last token so that every
        # load stays in bounds (those rows are never stored).
        token = cuda.local.array(TILE_M, int64)
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = sorted_tokens[starts[segment] + first + min(j, rows - 1)]

        partial = cuda.local.array(PARTIALS, float32)
        xk = cuda.local.array(TILE_M, float32)
        tree = cuda.shared.array((PARTIALS, THREADS), float32)

        for n0 in range(cuda.blockIdx.z * TILE_N, rank, cuda.gridDim.z * TILE_N):
            for p in range(PARTIALS):
                partial[p] = float32(0.0)
            for k in range(tid, hidden, THREADS):  # k in [0, K), strided by THREADS
                for j in range(TILE_M):
                    xk[j] = load_x(x[token[j], k])
                for q in range(TILE_N):  # rank n0 + q
                    n = min(n0 + q, rank - 1)  # past the rank: a harmless repeat
                    wk = load_w(w[slot, n, k])
                    for j in range(TILE_M):
                        partial[j * TILE_N + q] += xk[j] * wk

            # Sum the THREADS partials of each dot product: a tree in shared memory.
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

            if tid < PARTIALS:
                j = tid // TILE_N
                n = n0 + tid % TILE_N
                if j < rows and n < rank:
                    t = token[j]
                    out[out_slice, t, n] += scaling * tree[tid, 0]
            cuda.syncthreads()  # the tree is reused by the next rank group

    return shrink
