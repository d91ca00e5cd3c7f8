"""The expand kernel: ``out[t, c_s + n] = (add ? out : 0) + x[s, t] @ B_s[slot(t)][n]``.

Work split (one block = one tile of tokens of one slot, one slice, some columns):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment, looked up in the
  tile table (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``THREADS * VEC`` output columns; groups stride
  by ``gridDim.z``, so narrower slices (GQA's k and v) simply have fewer groups.

Thread ``tid`` owns ``VEC`` neighbouring output columns ``n .. n + VEC - 1`` for the
tile's tokens: it reads those rows of B once (``r`` elements each, in 8-byte words
when packed) and the tile's rows of x (the same for every thread, so the loads are
broadcasts), accumulates ``TILE_M * VEC`` dot products of length ``r`` in fp32
registers, and writes ``TILE_M * VEC`` outputs; neighbouring threads write
neighbouring columns. Every output element is written by exactly one thread, once;
a thread reads its old outputs before anything else, so that trip to memory
overlaps the loads of B and x.

Why more than one column per thread (v5, docs/benchmarks): a thread's life is a chain
of dependent trips to memory (tile table, token rows, operands, output), and with one
column per thread the GPU runs out of threads to overlap them long before it runs out
of bandwidth. With ``VEC`` columns a thread keeps ``VEC`` times more loads in flight
per chain, and when the output allows it (``PACK_OUT``: bf16 or fp32, rows of whole
8-byte words) it reads and writes a token's ``VEC`` outputs as ``VEC / PACK_OUT``
8-byte words instead of ``VEC`` 2- or 4-byte elements.

Memory traffic per block: ``THREADS * VEC * r`` elements of B, ``TILE_M * r`` of x,
and ``TILE_M * THREADS * VEC`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda
from .dtypes import loader, memory_type, packing, storer, word_loader, word_packer
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
    vec: int = 1,
    packed_out: bool = False,
):
    """Compile-time specialisation on dtypes, threads per block, the token tile, whether
    B arrives as packed int64 words, the columns per thread, and whether the output
    arrives as int64 words (then ``vec`` must be a multiple of the elements per word)."""
    load_x, store_out = loader(x_dtype), storer(out_dtype)
    load_w = word_loader(w_dtype, packed)
    W_WORD = memory_type(w_dtype, packed)
    THREADS, TILE_M, PACK, VEC = threads, tile_m, packing(w_dtype, packed), vec
    PACK_OUT = packing(out_dtype, packed_out)  # output elements per word (1: elements)
    OUT_WORDS = VEC // PACK_OUT  # a token's words of output in one thread
    OUTPUTS = TILE_M * VEC  # a thread's outputs (a local array's size must be a constant)
    if OUT_WORDS * PACK_OUT != VEC:
        raise ValueError(f"vec={vec} is not a whole number of output words of {PACK_OUT}")
    load_out_word = word_loader(out_dtype, packed_out)
    pack_out = word_packer(out_dtype) if packed_out else None

    @cuda.jit
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs):
        # x: [S, M, r]; w*: [L, N_s, r/PACK] words; out: [M, W/PACK_OUT] words;
        # col*: first column of a slice
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

        acc = cuda.local.array(OUTPUTS, float32)  # acc[j * VEC + c]: token j, column n + c
        old = cuda.local.array(OUTPUTS, float32)
        b_words = cuda.local.array(VEC, W_WORD)  # word k of the VEC rows of B
        b_k = cuda.local.array(VEC, float32)
        groups = (width + VEC - 1) // VEC  # of VEC columns
        first_group = cuda.blockIdx.z * THREADS + cuda.threadIdx.x
        for g in range(first_group, groups, cuda.gridDim.z * THREADS):
            n = g * VEC  # the thread's first column; n + c for c in [0, VEC)
            # Read the old outputs first: their trip to memory overlaps the loads of B
            # and x instead of following them. Rows past the tile repeat a token and
            # columns past the slice repeat the last one: in bounds, never stored.
            # (With words, a slice's width is a whole number of words, so a word is
            # wholly inside it or wholly past it.)
            if add_inputs:
                for j in range(TILE_M):
                    for q in range(OUT_WORDS):
                        column = column0 + min(n + q * PACK_OUT, width - PACK_OUT)
                        word = out[token[j], column // PACK_OUT]
                        for lane in range(PACK_OUT):
                            old[j * VEC + q * PACK_OUT + lane] = load_out_word(word, lane)
            for p in range(OUTPUTS):
                acc[p] = float32(0.0)
            for k in range(words):  # k in [0, r/PACK)
                for c in range(VEC):
                    b_words[c] = w[slot, min(n + c, width - 1), k]
                for lane in range(PACK):  # the elements of one word, unrolled
                    for c in range(VEC):
                        b_k[c] = load_w(b_words[c], lane)
                    for j in range(TILE_M):
                        xv = load_x(x[s, token[j], k * PACK + lane])
                        for c in range(VEC):
                            acc[j * VEC + c] += xv * b_k[c]
            if add_inputs:  # the old output is added last (the op's order)
                for p in range(OUTPUTS):
                    acc[p] += old[p]
            for j in range(TILE_M):
                if j < rows:
                    for q in range(OUT_WORDS):
                        first = n + q * PACK_OUT
                        if first < width:
                            if PACK_OUT == 1:
                                out[token[j], column0 + first] = store_out(acc[j * VEC + q])
                            else:
                                word = int64(0)
                                for lane in range(PACK_OUT):
                                    word = pack_out(word, lane, acc[j * VEC + q * PACK_OUT + lane])
                                out[token[j], (column0 + first) // PACK_OUT] = word

    return expand
