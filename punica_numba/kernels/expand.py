"""The expand kernel: ``out[t, c_s + n] = (add ? out : 0) + x[s, t] @ B_s[slot(t)][n]``.

Work split (one block = one tile of tokens of one slot, one slice, some columns):

* ``blockIdx.x``: a tile of up to ``TILE_M`` tokens of one segment, looked up in the
  tile table (:mod:`.segments`);
* ``blockIdx.y``: the slice, among the (at most ``MAX_SLICES``) slices of this launch;
* ``blockIdx.z``: the first group of ``THREADS * VEC`` output columns; groups stride
  by ``gridDim.z``, so narrower slices (GQA's k and v) simply have fewer groups.

Each thread owns ``VEC`` output columns for the tile's tokens, ``SPAN`` (a warp's
32) apart, so that a warp's 32 threads own 32 neighbouring columns ``VEC`` times
over: their loads of B rows and their stores are neighbours. A thread reads its
``VEC`` rows of B (``r`` elements each, in 8-byte words when packed) and the
tile's rows of x (the same for every thread, so the loads are broadcasts),
accumulates ``TILE_M * VEC`` dot products of length ``r`` in fp32 registers, and
writes ``TILE_M * VEC`` outputs. Every output element is written by exactly one
thread, once; a thread reads its old outputs before anything else, so that trip
to memory overlaps the loads of B and x.

Why several columns per thread (v5, docs/benchmarks): with one, every product
needs its own load of x, and on the H200 the kernel is bound by issuing
instructions, not by memory (T=4096 on one LoRA: 82 % of the SMs' issue rate,
5 % of the memory bandwidth). With ``VEC`` columns one load of x feeds ``VEC``
products. (A trial that gave a thread ``VEC`` *adjacent* columns, to store them
as one 8-byte word, lost: a warp's loads of B then spread over four times the
cache lines, 275d10f.)

Memory traffic per block: ``THREADS * VEC * r`` elements of B, ``TILE_M * r`` of
x, and ``TILE_M * THREADS * VEC`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader
from .segments import read_tile, slice_of, tile_token

__all__ = ["COMPILED_WORDS", "build_expand_kernel"]

#: Rows of B with at most this many words (r <= 16 in bf16/fp16, packed) have their
#: length compiled into the kernel: the loop over the rank then has a known trip count,
#: which the compiler unrolls, issuing a row's loads together (H200, r=16: T=1 3.01 ->
#: 2.75 µs, T=256 distinct 16.7 -> 14.8). Longer rows keep a loop of run-time length:
#: unrolled, r=64 lost (T=1 5.4 -> 6.0 µs; T=64 distinct, 4 columns a thread, 28 -> 42).
COMPILED_WORDS = 4


@functools.cache
def build_expand_kernel(
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    packed: bool,
    vec: int,
    words: int = 0,
):
    """Compile-time specialisation on dtypes, threads per block, the token tile, whether
    B arrives as packed int64 words, the output columns per thread, and ``words``: the
    words in one row of B (the rank, or the rank / PACK when packed), at most
    :data:`COMPILED_WORDS`, or 0 to read it from B at run time. (A deployment serves
    one rank: vLLM pads every adapter to ``max_lora_rank``.)"""
    if not 0 <= words <= COMPILED_WORDS:
        raise ValueError(f"words must be in [0, {COMPILED_WORDS}] (0: at run time), got {words}")
    load_x, load_out, store_out = loader(x_dtype), loader(out_dtype), storer(out_dtype)
    load_w = word_loader(w_dtype, packed)
    THREADS, TILE_M, PACK, VEC = threads, tile_m, packing(w_dtype, packed), vec
    SPAN = min(32, threads)  # a warp's neighbouring columns (the simulator's blocks are small)
    OUTPUTS = TILE_M * VEC  # a thread's outputs (a local array's size must be a constant)
    W_WORD = memory_type(w_dtype, packed)
    # Words of B loaded together. A thread with one token and several columns has a
    # big body of loads per word, which otherwise wait one word at a time (r=64, T=256
    # distinct: 284 µs with one word per step, 83 with four, measured before the rank
    # was compiled in). With several tokens the products of a word hide the next word's
    # loads, and four words' registers cost more than they save (T=4096 on one LoRA: 76
    # µs with one word per step, 91 with four).
    UNROLL_K = 4 if tile_m == 1 and vec > 1 else 1
    STEP_WORDS = UNROLL_K * VEC
    WORDS = words  # 0: read from B

    begin = prologue()

    @jit_kernel(THREADS)
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs):
        # x: [S, M, r]; w*: [L, N_s, r/PACK] words; out: [M, W]; col*: first column of a slice
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_tile(tiles, cuda.blockIdx.x)
        if slot == -1:
            return
        s_local = cuda.blockIdx.y
        w, column0 = slice_of(s_local, w0, w1, w2, col0, col1, col2)
        s = slice_base + s_local
        width = w.shape[1]
        words = WORDS if WORDS else w.shape[2]  # of one row of B

        token = cuda.local.array(TILE_M, int64)  # the tile's token rows
        for j in range(TILE_M):  # j in [0, TILE_M), unrolled
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)

        acc = cuda.local.array(OUTPUTS, float32)  # acc[j * VEC + c]: token j, column c
        old = cuda.local.array(OUTPUTS, float32)
        row = cuda.local.array(VEC, int64)  # the thread's columns, clamped into the slice
        b_words = cuda.local.array(STEP_WORDS, W_WORD)  # a step's words of those rows
        b_k = cuda.local.array(VEC, float32)
        tid = cuda.threadIdx.x
        mine = (tid // SPAN) * SPAN * VEC + tid % SPAN  # the thread's first column in a group
        # A while loop, not range(): range's trip count with a run-time step is a
        # division routine ahead of the first loads (expand_mma's notes).
        n0 = cuda.blockIdx.z * THREADS * VEC
        while n0 < width:
            for c in range(VEC):  # columns n0 + mine + SPAN * c: a warp's are neighbours
                row[c] = min(n0 + mine + SPAN * c, width - 1)
            # Read the old outputs first: their trip to memory overlaps the loads of B
            # and x instead of following them. (Rows past the tile repeat a token, and
            # columns past the slice the last column: in bounds, never stored.)
            if add_inputs:
                for j in range(TILE_M):
                    for c in range(VEC):
                        old[j * VEC + c] = load_out(out[token[j], column0 + row[c]])
            for p in range(OUTPUTS):
                acc[p] = float32(0.0)
            for k0 in range(0, words, UNROLL_K):  # words k0 .. k0 + UNROLL_K - 1 of B
                # Every load of the step first, so they are in flight together; past the
                # rank: a repeat of the last word, never used. (With one word per step
                # these bounds are compiled out: v5's bound checks there cost 0.1-0.8 µs.)
                for u in range(UNROLL_K):
                    last = min(k0 + u, words - 1) if UNROLL_K > 1 else k0
                    for c in range(VEC):
                        b_words[u * VEC + c] = w[slot, row[c], last]
                for u in range(UNROLL_K):
                    if UNROLL_K == 1 or k0 + u < words:
                        k = k0 + u
                        for lane in range(PACK):  # the elements of one word, unrolled
                            for c in range(VEC):
                                b_k[c] = load_w(b_words[u * VEC + c], lane)
                            for j in range(TILE_M):  # one load of x feeds VEC products
                                xv = load_x(x[s, token[j], k * PACK + lane])
                                for c in range(VEC):
                                    acc[j * VEC + c] += xv * b_k[c]
            if add_inputs:  # the old output is added last (the op's order)
                for p in range(OUTPUTS):
                    acc[p] += old[p]
            for j in range(TILE_M):
                if j < rows:
                    for c in range(VEC):
                        n = n0 + mine + SPAN * c
                        if n < width:
                            out[token[j], column0 + n] = store_out(acc[j * VEC + c])
            n0 += cuda.gridDim.z * THREADS * VEC

    return expand
