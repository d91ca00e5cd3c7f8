"""The expand kernel: ``out[t, c_s + n] = (add ? out : 0) + x[s, t] @ B_s[slot(t)][n]``.

Work split (one block = one tile of tokens of one slot, one slice, some columns):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment, looked up in the
  tile table (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``THREADS`` output columns; groups stride by
  ``gridDim.z``, so narrower slices (GQA's k and v) simply have fewer groups.

Thread ``tid`` owns output column ``n`` for the tile's tokens: it reads row n of
B once (``r`` elements, in 8-byte words when packed) and the tile's rows of x
(the same for every thread, so the loads are broadcasts), accumulates ``TILE_M``
dot products of length ``r`` in fp32 registers, and writes ``TILE_M`` outputs;
neighbouring threads write neighbouring columns. Every output element is written
by exactly one thread, once; a thread reads its old outputs before anything
else, so that trip to memory overlaps the loads of B and x.

Memory traffic per block: ``THREADS * r`` elements of B, ``TILE_M * r`` of x, and
``TILE_M * THREADS`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda
from .dtypes import loader, packing, storer, word_loader
from .segments import read_tile, tile_token

__all__ = ["build_expand_kernel"]


@functools.cache
def build_expand_kernel(
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    packed: bool,
):
    """Compile-time specialisation on dtypes, threads per block, the token tile, and
    whether B arrives as packed int64 words."""
    load_x, load_out, store_out = loader(x_dtype), loader(out_dtype), storer(out_dtype)
    load_w = word_loader(w_dtype, packed)
    THREADS, TILE_M, PACK = threads, tile_m, packing(w_dtype, packed)

    @cuda.jit
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs):
        # x: [S, M, r]; w*: [L, N_s, r/PACK] words; out: [M, W]; col*: first column of a slice
        slot, position, rows, first_token = read_tile(tiles)
        if slot == -1:
            return
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
        words = w.shape[2]

        token = cuda.local.array(TILE_M, int64)  # the tile's token rows
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)

        acc = cuda.local.array(TILE_M, float32)
        old = cuda.local.array(TILE_M, float32)
        n_first = cuda.blockIdx.z * THREADS + cuda.threadIdx.x
        for n in range(n_first, width, cuda.gridDim.z * THREADS):  # n in [0, N_s)
            column = column0 + n
            # Read the old outputs first: their trip to memory overlaps the loads of B
            # and x instead of following them. (Rows past the tile repeat a token: in
            # bounds, never stored.)
            if add_inputs:
                for j in range(TILE_M):
                    old[j] = load_out(out[token[j], column])
            for j in range(TILE_M):
                acc[j] = float32(0.0)
            for k in range(words):  # k in [0, r/PACK)
                ww = w[slot, n, k]
                for lane in range(PACK):  # the elements of one word, unrolled
                    wk = load_w(ww, lane)
                    for j in range(TILE_M):
                        acc[j] += load_x(x[s, token[j], k * PACK + lane]) * wk
            if add_inputs:  # the old output is added last (the op's order)
                for j in range(TILE_M):
                    acc[j] += old[j]
            for j in range(TILE_M):
                if j < rows:
                    out[token[j], column] = store_out(acc[j])

    return expand
