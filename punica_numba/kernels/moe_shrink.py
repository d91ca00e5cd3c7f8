"""The MoE LoRA shrink: each pair's input row times its slot's and expert's A, into fp32.

A CUDA block takes one block of pairs of one row and one slice (:mod:`.moe_blocks`); a
thread takes a (pair, rank) output of the buffer ``[S, P, r]``, a dot product of length
K over a row of ``A[l, e]`` and the pair's input row (the token's for w13, the pair's
own for w2), and stores it. Reads per block in use: r rows of A (K each), the block's
input rows; writes block_size * r outputs.
"""

from __future__ import annotations

import functools

import torch
from numba import float32

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader
from .moe_blocks import block_in_use

__all__ = ["build_moe_shrink_kernel"]


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
        start, pairs, expert = block_in_use(
            cuda.blockIdx.x, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids,
            w.shape[1],
        )  # fmt: skip
        if expert == -1:
            return
        rank, hidden = w.shape[2], w.shape[3]
        num_pairs = out.shape[1]
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
