"""MoE LoRA kernels: shrink and expand over the blocks of (token, expert) pairs.

The pairs come sorted by slot and expert into blocks of ``block_size`` (vLLM's layout,
:mod:`punica_numba.moe_meta`): row l of ``sorted_token_ids`` holds slot l's pairs,
block b of it is expert ``expert_ids[l, b]``'s, and a CUDA block takes one of those
blocks of one row and one slice:

* ``blockIdx.x``: the block b of the row (past the row's blocks, or of expert -1: the
  CUDA block leaves at once; the grid is the bound, so it needs no look at the device);
* ``blockIdx.y``: the row, the slot l (a slot that ``adapter_enabled`` turns off leaves);
* ``blockIdx.z``: the slice (gate and up of w13; w2 has one).

These are the first rung: every output is one thread's dot product, no shared memory,
no tensor cores. The shrink's thread takes a (pair, rank) output and reads a row of
``A[l, e]`` (K elements) and the pair's input row; the expand's thread takes a column
and, for each pair of the block, reads a row of ``B[l, e]`` (r elements) and the pair's
buffer row. The block's pairs share A and B, so those rows come from L1 and L2 after
the first pair. Deterministic: every output is written by one thread, once.

Memory traffic per launch, at most (P pairs, S slices, n_le blocks in use):
shrink reads n_le * S * r * K of A, P * K of x (per pair; per token for w13, where the
rows repeat), writes S * P * r; expand reads n_le * S * N * r of B and S * P * r of the
buffer, reads and writes S * P * N of the output.
"""

from __future__ import annotations

import functools

import torch
from numba import float32

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, storer

__all__ = [
    "MAX_MOE_SLICES",
    "block_in_use",
    "build_moe_expand_kernel",
    "build_moe_shrink_kernel",
]

#: Slices one launch takes: w13's gate and up (two weight arguments; w2 passes its one
#: twice, and launches one slice).
MAX_MOE_SLICES = 2


@cuda.jit(device=True)
def block_in_use(b, slot, block_size, num_post_pad, enabled, expert_ids, num_experts):
    """``(start, expert)`` of block b of row ``slot``: its first entry in the row, and its
    expert, or -1 when the CUDA block has nothing to do (past the row's last block, a
    slot turned off, expert -1, or an expert the weights do not hold)."""
    start = b * block_size
    if start >= num_post_pad[slot] or enabled[slot] == 0:
        return start, -1
    expert = expert_ids[slot, b]
    if expert < 0 or expert >= num_experts:
        return start, -1
    return start, expert


@functools.cache
def build_moe_shrink_kernel(x_dtype: torch.dtype, w_dtype: torch.dtype, threads: int):
    """The shrink, specialised on the dtypes and the threads per block."""
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def moe_shrink(
        x, w0, w1, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k, block_size, by_pair
    ):
        # x: [M or P, K]; w*: [L, E, r, K]; out: [S, P, r] fp32, stored;
        # sorted_ids: [L, EM]; expert_ids: [L, NB]; num_post_pad: [L]; enabled: [>= L]
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, s = cuda.blockIdx.y, cuda.blockIdx.z
        w = w0 if s == 0 else w1
        start, expert = block_in_use(
            cuda.blockIdx.x, slot, block_size, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:
            return
        rank, hidden = w.shape[2], w.shape[3]
        num_pairs = out.shape[1]
        # (within the row, whatever num_post_pad says: align_pairs' never passes it)
        pairs = min(block_size, sorted_ids.shape[1] - start)
        o = cuda.threadIdx.x
        while o < pairs * rank:  # o in [0, pairs * r): (pair i, rank j)
            i, j = o // rank, o % rank
            pair = sorted_ids[slot, start + i]
            if 0 <= pair < num_pairs:  # (padding is num_pairs)
                row = pair if by_pair else pair // top_k
                acc = float32(0.0)
                for k in range(hidden):  # k in [0, K)
                    acc += load_x(x[row, k]) * load_w(w[slot, expert, j, k])
                out[s, pair, j] = acc
            o += THREADS

    return moe_shrink


@functools.cache
def build_moe_expand_kernel(
    x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype, threads: int
):
    """The expand, specialised on the dtypes and the threads per block."""
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    load_weight = loader(torch.float32)
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def moe_expand(
        x, w0, w1, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, block_size,
        offset, weighted, add_inputs,
    ):  # fmt: skip
        # x: [S, P, r] fp32; w*: [L, E, N, r]; out: [P, W], slice s at offset + s * N;
        # weights: [P] routing weight of each pair, read when ``weighted``; the old output
        # is added when ``add_inputs``
        begin()
        slot, s = cuda.blockIdx.y, cuda.blockIdx.z
        w = w0 if s == 0 else w1
        start, expert = block_in_use(
            cuda.blockIdx.x, slot, block_size, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:
            return
        width, rank = w.shape[2], w.shape[3]
        num_pairs = out.shape[0]
        column0 = offset + s * width
        pairs = min(block_size, sorted_ids.shape[1] - start)
        n = cuda.threadIdx.x
        while n < width:  # n in [0, N): this thread's column
            for i in range(pairs):  # the block's pairs
                pair = sorted_ids[slot, start + i]
                if 0 <= pair < num_pairs:
                    acc = float32(0.0)
                    for j in range(rank):  # j in [0, r)
                        acc += load_x(x[s, pair, j]) * load_w(w[slot, expert, n, j])
                    if weighted:
                        acc *= load_weight(weights[pair])
                    if add_inputs:
                        acc += load_out(out[pair, column0 + n])
                    out[pair, column0 + n] = store_out(acc)
            n += THREADS

    return moe_expand
