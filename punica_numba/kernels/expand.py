"""The expand kernel: ``out[t, c_s + n] = (add ? out : 0) + x[s, t] @ B_s[slot(t)][n]``.

Work split (one block = one tile of tokens of one slot, one slice, some columns):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``THREADS`` output columns; groups stride by
  ``gridDim.z``, so narrower slices (GQA's k and v) simply have fewer groups.

Thread ``tid`` owns output column ``n`` for the tile's tokens: it reads row n of
B once (``r`` elements) and the tile's rows of x (the same for every thread, so the
loads are broadcasts), accumulates ``TILE_M`` dot products of length ``r`` in fp32
registers, and writes ``TILE_M`` outputs; neighbouring threads write neighbouring
columns. Every output element is written by exactly one thread, once.

Memory traffic per block: ``THREADS * r`` elements of B, ``TILE_M * r`` of x, and
``TILE_M * THREADS`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda
from .dtypes import loader, storer
from .segments import find_tile

__all__ = ["build_expand_kernel"]


@functools.cache
def build_expand_kernel(
    x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype, threads: int, tile_m: int
):
    """Compile-time specialisation on dtypes, threads per block and the token tile."""
    load_x, load_w = loader(x_dtype), loader(w_dtype)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, TILE_M = threads, tile_m

    @cuda.jit
    def expand(
        x,
        w0,
        w1,
        w2,
        out,
        slice_base,
        col0,
        col1,
        col2,
        sorted_tokens,
        counts,
        starts,
        lora_ids,
        add_inputs,
    ):
        # x: [S, M, r]; w*: [L, N_s, r]; out: [M, W]; col*: first output column of each slice.
        segment, first = find_tile(cuda.blockIdx.x, lora_ids, counts, TILE_M)
        if segment == -1:
            return
        slot = lora_ids[segment]
        rows = min(TILE_M, counts[segment] - first)
        s_local = cuda.blockIdx.y
        if s_local == 0:
            w = w0
            column0 = col0
        elif s_local == 1:
            w = w1
            column0 = col1
        else:
            w = w2
            column0 = col2
        s = slice_base + s_local
        width = w.shape[1]
        rank = w.shape[2]

        token = cuda.local.array(TILE_M, int64)
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = sorted_tokens[starts[segment] + first + min(j, rows - 1)]

        acc = cuda.local.array(TILE_M, float32)
        n_first = cuda.blockIdx.z * THREADS + cuda.threadIdx.x
        for n in range(n_first, width, cuda.gridDim.z * THREADS):  # n in [0, N_s)
            for j in range(TILE_M):
                acc[j] = float32(0.0)
            for k in range(rank):  # k in [0, r)
                wk = load_w(w[slot, n, k])
                for j in range(TILE_M):
                    acc[j] += load_x(x[s, token[j], k]) * wk
            column = column0 + n
            for j in range(TILE_M):
                if j < rows:
                    t = token[j]
                    value = acc[j]
                    if add_inputs:
                        value += load_out(out[t, column])
                    out[t, column] = store_out(value)

    return expand
