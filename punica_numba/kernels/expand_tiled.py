"""The tiled expand kernel: the same op as :mod:`.expand`, for many tokens per slot.

When a slot has many tokens (prefill), the row kernel's thread reads row n of B
and a tile of x for every output column it owns: each x element is loaded once
per column, so loads, not arithmetic, bound it. This kernel stages both operands
in shared memory, chunk by chunk along the rank, and lets each thread reuse
what it reads from there for a small register tile of outputs:

* block: ``TILE_M`` tokens of one segment x ``TILE_N`` output columns of one slice
  (``blockIdx.x`` = tile of the tile table, ``.y`` = slice, ``.z`` = first column
  group; groups stride by ``gridDim.z``);
* threads form a ``GRID_M x GRID_N`` grid; thread (tm, tn) owns the ``MICRO_M x
  MICRO_N`` outputs at tokens ``tm + GRID_M*i`` and columns ``tn + GRID_N*q``, so a
  warp's 32 neighbouring threads own 32 neighbouring columns (coalesced stores);
* the tile's token rows are read once into shared memory (:func:`.segments.tile_token`);
* per chunk of ``CHUNK`` ranks: the block loads (all loads first, so they are in
  flight together) and copies ``TILE_M x CHUNK`` elements of x
  and ``TILE_N x CHUNK`` of B into shared memory as fp32 (rows past the tile or the
  rank padded with zeros), then every thread does ``MICRO_M * MICRO_N`` FMAs for
  ``MICRO_M + MICRO_N`` shared loads per rank.

The arithmetic order of each output is the row kernel's: one fp32 accumulator,
starting at 0, adding ``x[k] * B[n, k]`` for k = 0, 1, ..., r-1 (the zero padding
adds exact zeros), then the old output when ``add_inputs``. So both kernels give
the same bits, and the launch heuristic may pick either.

Unlike the row kernel, this one reads the old outputs only after the products. A
trial (v4, docs/benchmarks) read them first, and let each thread read its own token
rows instead of sharing them: the old outputs then stay in ``MICRO`` more registers
through the chunk loop, and on the H200 the 16 x 128 tile took 120 µs instead of 107
at T=4096 over 64 LoRAs (12.5 instead of 9.9 at T=256 over 16).

Memory traffic per block: ``TILE_M * r`` elements of x, ``TILE_N * r`` of B,
``TILE_M * TILE_N`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader
from .segments import read_tile, slice_of, tile_token

__all__ = ["build_tiled_expand_kernel"]


@functools.cache
def build_tiled_expand_kernel(
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    tile_n: int,
    micro_m: int,
    micro_n: int,
    chunk: int,
    packed: bool,
):
    """Compile-time specialisation: dtypes, the block's thread grid and tiles, the rank
    chunk staged at once, and whether B arrives as packed int64 words."""
    load_x, load_out, store_out = loader(x_dtype), loader(out_dtype), storer(out_dtype)
    load_w = word_loader(w_dtype, packed)
    PACK = packing(w_dtype, packed)
    TILE_M, TILE_N, MICRO_M, MICRO_N, CHUNK = tile_m, tile_n, micro_m, micro_n, chunk
    GRID_M, GRID_N = tile_m // micro_m, tile_n // micro_n
    WORDS_PER_ROW = CHUNK // PACK  # words of one B row in one chunk
    X_LOADS = TILE_M * CHUNK // threads  # x elements each thread stages per chunk
    W_LOADS = TILE_N * WORDS_PER_ROW // threads  # B words each thread stages per chunk
    if (
        GRID_M * MICRO_M != tile_m
        or GRID_N * MICRO_N != tile_n
        or GRID_M * GRID_N != threads
        or CHUNK % PACK
        or X_LOADS * threads != TILE_M * CHUNK
        or W_LOADS * threads != TILE_N * WORDS_PER_ROW
    ):
        raise ValueError(
            f"inconsistent tiled expand shape: threads={threads} tile={tile_m}x{tile_n} "
            f"micro={micro_m}x{micro_n} chunk={chunk} pack={PACK}"
        )
    MICRO = MICRO_M * MICRO_N
    X_ELEMENT, W_WORD = memory_type(x_dtype, False), memory_type(w_dtype, packed)

    begin = prologue()

    @jit_kernel(threads)
    def expand_tiled(
        x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs
    ):
        # x: [S, M, r]; w*: [L, N_s, r/PACK] words; out: [M, W]; col*: first column of a slice
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_tile(tiles, cuda.blockIdx.x)
        if slot == -1:
            return  # the whole block leaves together, before any barrier
        s_local = cuda.blockIdx.y
        w, column0 = slice_of(s_local, w0, w1, w2, col0, col1, col2)
        s = slice_base + s_local
        width = w.shape[1]
        words = w.shape[2]
        rank = x.shape[2]
        tid = cuda.threadIdx.x
        tm = tid // GRID_N
        tn = tid % GRID_N

        token = cuda.shared.array(TILE_M, int64)  # the tile's token rows
        xs = cuda.shared.array((CHUNK, TILE_M), float32)  # x chunk, transposed
        ws = cuda.shared.array((CHUNK, TILE_N), float32)  # B chunk, transposed
        for j in range(tid, TILE_M, threads):
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)
        cuda.syncthreads()

        acc = cuda.local.array(MICRO, float32)
        x_regs = cuda.local.array(X_LOADS, X_ELEMENT)  # a chunk's loads, in flight together
        w_regs = cuda.local.array(W_LOADS, W_WORD)
        xr = cuda.local.array(MICRO_M, float32)
        wr = cuda.local.array(MICRO_N, float32)
        # A while loop, not range(): range's trip count with a run-time step is a
        # division routine ahead of the first loads (expand_mma's notes).
        n0 = cuda.blockIdx.z * TILE_N
        while n0 < width:
            for p in range(MICRO):
                acc[p] = float32(0.0)
            for k0 in range(0, rank, CHUNK):
                # Stage the chunk: every load first (into registers), then every shared
                # store, so the loads are in flight together. Element e of x is (row
                # e // CHUNK, rank k0 + e % CHUNK); word e of B is (column n0 + e //
                # WORDS_PER_ROW, word e % WORDS_PER_ROW). Past the rank: a repeat of the
                # last element, zeroed when stored; past the slice: a harmless repeat.
                for u in range(X_LOADS):
                    e = tid + u * threads
                    x_regs[u] = x[s, token[e // CHUNK], min(k0 + e % CHUNK, rank - 1)]
                for u in range(W_LOADS):
                    e = tid + u * threads
                    n = min(n0 + e // WORDS_PER_ROW, width - 1)
                    w_regs[u] = w[slot, n, min(k0 // PACK + e % WORDS_PER_ROW, words - 1)]
                for u in range(X_LOADS):
                    e = tid + u * threads
                    kk = e % CHUNK
                    value = load_x(x_regs[u])
                    xs[kk, e // CHUNK] = value if k0 + kk < rank else float32(0.0)
                for u in range(W_LOADS):
                    e = tid + u * threads
                    kw = e % WORDS_PER_ROW
                    inside = k0 // PACK + kw < words
                    for lane in range(PACK):
                        value = load_w(w_regs[u], lane)
                        ws[kw * PACK + lane, e // WORDS_PER_ROW] = value if inside else float32(0.0)
                cuda.syncthreads()
                for kk in range(CHUNK):  # unrolled: MICRO FMAs per MICRO_M + MICRO_N loads
                    for i in range(MICRO_M):
                        xr[i] = xs[kk, tm + GRID_M * i]
                    for q in range(MICRO_N):
                        wr[q] = ws[kk, tn + GRID_N * q]
                    for i in range(MICRO_M):
                        for q in range(MICRO_N):
                            acc[i * MICRO_N + q] += xr[i] * wr[q]
                cuda.syncthreads()  # the chunk buffers are refilled next
            # Every old output is read before the first store (see .expand); rows and
            # columns past the tile repeat in-bounds ones and are never stored.
            if add_inputs:
                for i in range(MICRO_M):
                    t = token[tm + GRID_M * i]
                    for q in range(MICRO_N):
                        n = min(n0 + tn + GRID_N * q, width - 1)
                        acc[i * MICRO_N + q] += load_out(out[t, column0 + n])
            for i in range(MICRO_M):
                j = tm + GRID_M * i
                if j < rows:
                    t = token[j]
                    for q in range(MICRO_N):
                        n = n0 + tn + GRID_N * q
                        if n < width:
                            out[t, column0 + n] = store_out(acc[i * MICRO_N + q])
            n0 += cuda.gridDim.z * TILE_N

    return expand_tiled
