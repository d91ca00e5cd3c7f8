"""The MoE LoRA shrink, second rung: a block's pairs and its A in shared-memory tiles.

The same sums as :mod:`.moe_shrink` (each pair's input row times ``A[l, e]`` of its
block, stored into the fp32 buffer ``[S, P, r]``), organised as the small matrix
product it is: the block's ``pairs x K`` input rows times the ``r x K`` rows of A. The
block walks K in chunks of ``CHUNK``: its threads load the chunk of every pair's row
and of every row of A into shared memory, each element once and neighbouring threads
reading neighbouring elements; then each thread adds the chunk's products to its
outputs (a (pair, rank) entry each, several per thread), reading both operands from
shared memory. So each element of A is read from memory once per block, not once per
pair as the first rung reads it, and every load is coalesced.

Shared memory per block: ``(MAX_PAIRS + MAX_RANK) * (CHUNK + 1)`` fp32 (the ``+ 1``
keeps a warp's reads of one column of a tile on different banks), and the pairs' input
rows. A block of more than ``MAX_PAIRS`` pairs, or a rank past ``MAX_RANK``, is not
this kernel's (``ops.moe`` takes the first rung there).

Reads per block in use: ``pairs * K`` of x and ``r * K`` of A; writes ``pairs * r``.
Not yet measured on a GPU.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader
from .moe_blocks import block_in_use

__all__ = ["CHUNK", "MAX_PAIRS", "MAX_RANK", "build_moe_tiled_shrink_kernel"]

#: The most pairs a block may hold, and the largest rank (the tiles' sizes are compiled
#: in). vLLM's block sizes go from 16 to 64 pairs at Qwen3-30B-A3B's shape on the H200.
MAX_PAIRS, MAX_RANK = 64, 64
#: Elements of K a tile holds (the simulator's blocks are a few threads: small tiles).
CHUNK = 4 if SIMULATOR else 32
#: A tile's row: the chunk and one more element (a constant: Numba sizes shared arrays only
#: from constants, not from expressions of them).
_ROW = CHUNK + 1


@functools.cache
def build_moe_tiled_shrink_kernel(x_dtype: torch.dtype, w_dtype: torch.dtype, threads: int):
    """The tiled shrink, specialised on the dtypes and the threads per block."""
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    THREADS = threads
    # A thread's outputs: every (pair, rank) entry of the largest block, dealt out.
    OUTPUTS = -(-MAX_PAIRS * MAX_RANK // THREADS)
    begin = prologue()

    @jit_kernel(THREADS)
    def moe_shrink_tiled(
        x, w0, w1, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k, block_size, by_pair
    ):
        # x: [M or P, K]; w*: [L, E, r, K]; out: [S, P, r] fp32, stored;
        # sorted_ids: [L, EM]; expert_ids: [L, NB]; num_post_pad: [L]; enabled: [>= L]
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, s = cuda.blockIdx.y, cuda.blockIdx.z
        w = w0 if s == 0 else w1
        start, pairs, expert = block_in_use(
            cuda.blockIdx.x, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids,
            w.shape[1],
        )  # fmt: skip
        if expert == -1:
            return
        rank, hidden = w.shape[2], w.shape[3]
        num_pairs = out.shape[1]
        tid = cuda.threadIdx.x

        rows = cuda.shared.array(MAX_PAIRS, int64)  # each pair's input row, -1: padding
        x_tile = cuda.shared.array((MAX_PAIRS, _ROW), float32)  # [pairs, CHUNK]
        a_tile = cuda.shared.array((MAX_RANK, _ROW), float32)  # [r, CHUNK]
        i = tid
        while i < pairs:  # i in [0, pairs)
            pair = sorted_ids[slot, start + i]
            rows[i] = -1
            if 0 <= pair < num_pairs:
                rows[i] = pair if by_pair else pair // top_k
            i += THREADS
        acc = cuda.local.array(OUTPUTS, float32)  # acc[q]: output tid + q * THREADS
        mine = -(-pairs * rank // THREADS)  # (at most OUTPUTS)
        for q in range(mine):
            acc[q] = float32(0.0)
        cuda.syncthreads()

        for k0 in range(0, hidden, CHUNK):  # the chunk k0 .. k0 + CHUNK - 1 of K
            e = tid
            while e < pairs * CHUNK:  # the pairs' rows, CHUNK elements each
                i, kk = e // CHUNK, e % CHUNK
                value = float32(0.0)
                if rows[i] >= 0 and k0 + kk < hidden:
                    value = load_x(x[rows[i], k0 + kk])
                x_tile[i, kk] = value
                e += THREADS
            e = tid
            while e < rank * CHUNK:  # the rows of A, CHUNK elements each
                j, kk = e // CHUNK, e % CHUNK
                value = float32(0.0)
                if k0 + kk < hidden:
                    value = load_w(w[slot, expert, j, k0 + kk])
                a_tile[j, kk] = value
                e += THREADS
            cuda.syncthreads()
            for q in range(mine):  # this thread's (pair, rank) entries
                o = tid + q * THREADS
                if o < pairs * rank:
                    i, j = o // rank, o % rank
                    partial = float32(0.0)
                    for kk in range(CHUNK):
                        partial += x_tile[i, kk] * a_tile[j, kk]
                    acc[q] += partial
            cuda.syncthreads()  # (the next chunk overwrites the tiles)

        for q in range(mine):
            o = tid + q * THREADS
            if o < pairs * rank:
                i, j = o // rank, o % rank
                if rows[i] >= 0:
                    out[s, sorted_ids[slot, start + i], j] = acc[q]

    return moe_shrink_tiled
