"""The MoE LoRA expand: each pair's fp32 buffer row times its slot's and expert's B, into y.

A CUDA block takes one block of pairs of one row and one slice (:mod:`.moe_blocks`); a
thread owns one output column and, for every pair of the block, adds the dot product of
the pair's buffer row (r) with a row of ``B[l, e]``, weighted by the router for w2, into
the pair's row of the output (or stores it, without ``add_inputs``). Reads per block in
use: N rows of B (r each), the block's buffer rows; reads and writes block_size * N
outputs.
"""

from __future__ import annotations

import functools

import torch
from numba import float32

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, storer
from .moe_blocks import block_in_use

__all__ = ["build_moe_expand_kernel"]


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
        start, pairs, expert = block_in_use(
            cuda.blockIdx.x, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids,
            w.shape[1],
        )  # fmt: skip
        if expert == -1:
            return
        width, rank = w.shape[2], w.shape[3]
        num_pairs = out.shape[0]
        column0 = offset + s * width
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
