"""The tensor-core shrink: the op of :mod:`.shrink`, 16 tokens of one slot at a time.

With many tokens per slot the FFMA shrink spends its time on arithmetic, not memory
(T=4096 on one LoRA: 51 µs, 16 % of the copy bandwidth, in v6; 24.7 µs in v7, 17.5 here,
v9). A warp's ``mma.sync`` (:mod:`.mma`) does 16 tokens x 8 ranks x 16 hidden elements
at once, and x and A are 16-bit already, so the products are exact and nothing is split:

* block: a tile of ``16 * M_TILES`` tokens of one segment (the tile table), one slice,
  and ``8 * N_TILES`` ranks starting at ``blockIdx.y * 8 * N_TILES`` (one group covers
  every rank, or, where the tiles are few or the rank is past 64, several groups share
  the work: r=64 with 16 tiles gives 16 blocks of every rank, or 64 of 16 ranks; see
  "Ranks"); the blocks of a tile's slices are neighbours (``blockIdx.x = tile * slices
  + slice``, :func:`.segments.tile_and_slice`), so a QKV layer's three slices read the
  tile's rows of x from DRAM once, not three times (a block of a later rank group reads
  them again, mostly from L2);
* the hidden dimension is cut in chunks of 32 (two steps of 16); warp ``w`` takes
  chunks ``w, w + WARPS, ...`` (so the block's warps read neighbouring stretches of
  each row), ``UNROLL`` chunks a pass, and it loads the next pass's fragments before it
  multiplies this pass's, so that one pass's loads are in flight while the other's
  products run;
* both operands keep the hidden dimension contiguous and are read 16 bytes at a time
  (two int64 words of four elements, ``[.., K/4]`` views; 8 bytes at a time where a row
  starts 8 bytes past a multiple of 16), straight into fragment registers, with no
  shared memory (see "Whole words" below);
* the warps' partial tiles are added in shared memory, in warp order, and each output
  is written by one thread: ``old + scaling * sum`` (``accumulate``) or the product
  alone.

The order of the sum (the tensor cores' within a step, then steps in order per warp,
then warps in order) is fixed for a given number of warps, whatever the rank group (a
product tile's column does not depend on its other columns): its arithmetic key is
``("mma", threads)``. Every chunk ``w + j * WARPS`` is visited by every warp's loop,
past the end with zero fragments, so that all threads call ``mma`` equally often (the
simulator needs it).

**Whole words.** The fragment layout (:mod:`.mma`) gives lane ``t`` of a row the
elements ``2t, 2t + 1`` (register a0) and ``2t + 8, 2t + 9`` (a2) of each step of 16:
two 4-byte loads per row, and each warp-wide load asks for 8 rows x 16 bytes. But a
dot product does not care in which order its k come, only that x and A agree: so the
kernel hands the tensor cores each step's elements in another order, in which lane
``t`` holds *neighbouring* elements. Of a chunk of 32, lane ``t`` loads the 16 bytes
``8t .. 8t + 7``: its first word (elements ``8t .. 8t + 3``: low half in a0, high half
in a2, and the same for A's b0, b1) feeds the chunk's first step, its second word the
second step. One load per row fills four registers, and a warp's 4 lanes of a row read
64 neighbouring bytes: a quarter of the load instructions of pairs. (8-byte words alone,
one step at a time, gave T=4096 on one LoRA 24.2 -> 21.3 µs; with the next pass loaded
ahead and 16-byte loads, 15.3: ``docs/benchmarks/h200_v9_candidates.json``.)

**Ranks.** A block holds ``M_TILES * N_TILES * 4`` fp32 outputs a lane in registers and
its warps' partial tiles (``WARPS x TILE_M x TILE_N`` fp32) in shared memory, so what a
block costs grows with its group of ranks, not with the rank. Blocks of every rank (one
group, ``blockIdx.y = 0``) take ranks up to 64 (``ops.operands.MMA_ONE_BLOCK_RANK``: at
r=64 a lane holds 32 outputs, 16 KB of partial tiles with 4 warps). Blocks of rank groups
of ``TILE_N = 8 * N_TILES`` take any rank the ops give them (up to
``ops.operands.MMA_MAX_RANK``, 256): a block per group along grid.y (r=256 in groups of
8 ranks: 32 blocks, where CUDA allows 65535), block ``y`` taking ranks ``8 N_TILES y ..``;
each group reads the tile's rows of x again (mostly from L2). A rank that is not a
multiple of the group (r=100 in groups of 16: six and a group of 4; or not of 8: r=68)
leaves the last group short: its rows of A past the rank repeat the last row (the
products of those columns are never stored) and its outputs past the rank are neither
read nor written. The sums of a rank group are those of blocks of every rank: the same
bits (the key ``("mma", threads)``).

**Passes ahead** (``ahead``). With one pass on its way while a warp multiplies the other,
a warp has at most one pass's loads in flight: at r=16 with 16-token tiles 1 KB of x (2
chunks x 2 rows x 16 bytes x 32 lanes) and as much of A. An H100's profile of the table's
one-LoRA prefill at r=16 (``docs/benchmarks/h100_ncu_79f3af9.json``: 4096 tokens, 8 warps a
block, two blocks an SM) had a warp waiting on memory 12 of its ~14 cycles between issues,
with DRAM at 54 % of its peak. ``ahead=2`` keeps three passes' words and loads two ahead of
the one multiplied: twice the bytes in flight, for more registers (there 72 -> 128). The
chunks, their order and each warp's sums are those of ``ahead=1`` (past the end both
multiply passes of zeros, which leave a sum as it is: the same bits, the same key). On that
H100 (7ffe03b, lab notes) it did not help the prefill (17.5 µs against 14.8), and was the
fastest of all on 6 of 92 shrinks at r=16 and 32, by 1.02-1.13x.

**Split K.** :mod:`.shrink_mma_split` is this kernel with K cut into runs, a block each,
built from the same parts (:func:`mma_shrink_parts`).

Memory traffic per block: ``TILE_M * K`` elements of x, ``TILE_N * K`` of A (from L2
after the first tile of a slot), ``TILE_M * TILE_N`` outputs (read too when
``accumulate``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from numba import float32, int64, uint32, uint64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, storer, word_halves, words_loader
from .mma import FRAGMENT_WORDS, mma_into
from .segments import joint_place, read_tile, tile_and_slice, tile_token
from .shrink import number_factor, row_factor

__all__ = ["MmaShrinkParts", "build_mma_shrink_kernel", "mma_shrink_parts"]


class MmaShrinkParts(NamedTuple):
    """What the tensor-core shrinks (this one and :mod:`.shrink_mma_split`) share: the
    device functions of a block's walk over K and of its warps' sum, and the sizes they
    fix."""

    # (x, w, slot, token, n0, g, t, warp, first, end, acc, scratch): chunks [first, end)
    walk: object
    tile_to_shared: object  # (acc, partials, warp, g, t): a warp's tiles, then a barrier
    warps_total: object  # (partials, row, n): one output's sum over the warps, in warp order
    rows: int  # token rows a lane reads (g + 8 i)
    outputs: int  # fp32 outputs a lane holds
    per_thread: int  # outputs each thread stores
    scratch_warps: int  # warps of the simulator's product scratch (1 on the GPU)
    warps: int
    tile_m: int
    tile_n: int


@cuda.jit(device=True, inline="always")
def _last_rank_of_one_slice(w, n):
    """``n``, or past one slice's rank (``w``: ``[L, r, K/4]`` words) its last rank (whose
    products are never stored)."""
    return min(n, w.shape[1] - 1)


@cuda.jit(device=True, inline="always")
def _row_of_one_slice(w, slot, n):
    return w[slot, n]


@cuda.jit(device=True, inline="always")
def _last_rank_side_by_side(w, n):
    """``n``, or past the slices' ranks side by side (``w``: ``(w0, w1, w2, slices)``) the
    last of them (never stored)."""
    return min(n, w[3] * w[0].shape[1] - 1)


@cuda.jit(device=True, inline="always")
def _row_side_by_side(w, slot, n):
    """The row of A of joint rank ``n`` (:func:`.segments.joint_place`)."""
    s, j = joint_place(n, w[0].shape[1])
    slot, j = uint64(slot), uint64(j)
    if s == 0:
        return w[0][slot, j]
    if s == 1:
        return w[1][slot, j]
    return w[2][slot, j]


@functools.cache
def mma_shrink_parts(
    dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    wide: bool,
    joint: bool = False,
    ahead: int = 1,
) -> MmaShrinkParts:
    """The parts of a tensor-core shrink of x and A of ``dtype``, ``threads // 32`` warps,
    16-token and 8-rank tiles, 16-byte loads or 8 (``wide``): see the module's notes.
    ``joint``: the walk's ``w`` is ``(w0, w1, w2, slices)`` and its ranks are the slices'
    side by side (:mod:`.shrink_mma_joint`), else one slice's A. ``ahead``: the passes whose
    loads are on their way while a warp multiplies one, 1 or 2 ("Passes ahead")."""
    if threads % 32:
        raise ValueError(f"threads must be whole warps, got {threads}")
    if ahead not in (1, 2):
        raise ValueError(f"ahead takes 1 or 2 passes, got {ahead}")
    add_product = mma_into(dtype)
    two_words = words_loader(wide)
    clamp = _last_rank_side_by_side if joint else _last_rank_of_one_slice
    a_row = _row_side_by_side if joint else _row_of_one_slice
    THREADS, WARPS, M_TILES, N_TILES = threads, threads // 32, m_tiles, n_tiles
    TILE_M, TILE_N = 16 * m_tiles, 8 * n_tiles
    ROWS = 2 * M_TILES  # token rows a lane reads: g + 8 * i
    # Chunks of 32 elements (two steps) loaded in one pass: up to 16 words (32 registers)
    # of fragments per lane (r=16: 2 chunks; r=64: 1). The next pass's words are loaded
    # while this pass multiplies.
    UNROLL = max(1, 8 // (ROWS + N_TILES))
    STRIDE = WARPS * UNROLL  # chunks one pass of the block covers
    X_WORDS, W_WORDS = 2 * UNROLL * ROWS, 2 * UNROLL * N_TILES  # words held per pass
    OUTPUTS = M_TILES * N_TILES * 4
    PER_THREAD = -(-TILE_M * TILE_N // THREADS)  # outputs each thread stores
    SCRATCH_WARPS = WARPS if SIMULATOR else 1
    AHEAD = ahead
    THIRD_X, THIRD_W = (X_WORDS, W_WORDS) if AHEAD == 2 else (1, 1)  # a third pass's words

    @cuda.jit(device=True)
    def load_pass(x, w, slot, token, n0, g, t, chunk, xw, ww, end):
        """A warp's words of one pass (its first chunk ``chunk``; zero from word ``end`` on):
        words 2t, 2t + 1 of each chunk, of the lane's token rows and of A's rows ``n0 + 8 nj
        + g`` (past the rank, the last row again: B's columns there are never stored)."""
        for u in range(UNROLL):
            q = 8 * (chunk + u * WARPS) + 2 * t
            inside = q < end  # and so is q + 1: ``end`` is even
            for i in range(ROWS):
                v = (u * ROWS + i) * 2
                xw[v], xw[v + 1] = two_words(x[token[i]], q) if inside else (int64(0), int64(0))
            for nj in range(N_TILES):
                n = clamp(w, n0 + 8 * nj + g)
                v = (u * N_TILES + nj) * 2
                ww[v], ww[v + 1] = (
                    two_words(a_row(w, slot, n), q) if inside else (int64(0), int64(0))
                )

    @cuda.jit(device=True)
    def multiply_pass(xw, ww, acc, scratch):
        """Add one pass's products to the warp's tiles: each chunk's first step (the first
        word of each pair), then its second."""
        for u in range(UNROLL):
            for step in range(2):
                for mi in range(M_TILES):
                    # Rows g, g + 8: a0, a1 (low halves), a2, a3 (high halves).
                    a0, a2 = word_halves(xw[(u * ROWS + 2 * mi) * 2 + step])
                    a1, a3 = word_halves(xw[(u * ROWS + 2 * mi + 1) * 2 + step])
                    for nj in range(N_TILES):
                        b0, b1 = word_halves(ww[(u * N_TILES + nj) * 2 + step])
                        p = (mi * N_TILES + nj) * 4
                        add_product(acc, p, a0, a1, a2, a3, b0, b1, scratch)

    @cuda.jit(device=True, inline="always")
    def walk(x, w, slot, token, n0, g, t, warp, first_chunk, end_chunk, acc, my_scratch):
        """Add the warp's products of chunks ``first_chunk .. end_chunk - 1`` into ``acc``:
        chunks ``first_chunk + warp``, ``+ WARPS``, ..., ``UNROLL`` of them a pass."""
        end = min(x.shape[1], 8 * end_chunk)  # the first word not read
        # Two passes' words, used in turn: while one pass multiplies, the other's loads
        # are on their way (a copy from one to the other would wait for them instead).
        x_even = cuda.local.array(X_WORDS, int64)  # [u, row, word of the pair]
        w_even = cuda.local.array(W_WORDS, int64)  # [u, n tile, word of the pair]
        x_odd = cuda.local.array(X_WORDS, int64)
        w_odd = cuda.local.array(W_WORDS, int64)
        load_pass(x, w, slot, token, n0, g, t, first_chunk + warp, x_even, w_even, end)
        if AHEAD == 1:
            for first in range(first_chunk, end_chunk, 2 * STRIDE):
                load_pass(x, w, slot, token, n0, g, t, first + STRIDE + warp, x_odd, w_odd, end)
                multiply_pass(x_even, w_even, acc, my_scratch)
                load_pass(
                    x, w, slot, token, n0, g, t, first + 2 * STRIDE + warp, x_even, w_even, end
                )
                multiply_pass(x_odd, w_odd, acc, my_scratch)
        else:  # ("Passes ahead") three passes' words in turn, two on their way
            x_third = cuda.local.array(THIRD_X, int64)
            w_third = cuda.local.array(THIRD_W, int64)
            load_pass(x, w, slot, token, n0, g, t, first_chunk + STRIDE + warp, x_odd, w_odd, end)
            for first in range(first_chunk, end_chunk, 3 * STRIDE):
                chunk = first + 2 * STRIDE + warp
                load_pass(x, w, slot, token, n0, g, t, chunk, x_third, w_third, end)
                multiply_pass(x_even, w_even, acc, my_scratch)
                chunk = first + 3 * STRIDE + warp
                load_pass(x, w, slot, token, n0, g, t, chunk, x_even, w_even, end)
                multiply_pass(x_odd, w_odd, acc, my_scratch)
                chunk = first + 4 * STRIDE + warp
                load_pass(x, w, slot, token, n0, g, t, chunk, x_odd, w_odd, end)
                multiply_pass(x_third, w_third, acc, my_scratch)

    @cuda.jit(device=True, inline="always")
    def tile_to_shared(acc, partials, warp, g, t):
        """The warp's product tiles into its plane of ``partials`` (``[warp, row, rank]``)."""
        for mi in range(M_TILES):
            for nj in range(N_TILES):
                for i in range(4):  # (g + 8 * (i // 2), 2t + i % 2) of the product tile
                    row = 16 * mi + g + 8 * (i // 2)
                    partials[warp, row, 8 * nj + 2 * t + i % 2] = acc[(mi * N_TILES + nj) * 4 + i]
        cuda.syncthreads()

    @cuda.jit(device=True, inline="always")
    def warps_total(partials, row, n):
        """One output's sum over the block's warps, in warp order."""
        total = partials[0, row, n]
        for v in range(1, WARPS):
            total += partials[v, row, n]
        return total

    return MmaShrinkParts(
        walk,
        tile_to_shared,
        warps_total,
        ROWS,
        OUTPUTS,
        PER_THREAD,
        SCRATCH_WARPS,
        WARPS,
        TILE_M,
        TILE_N,
    )


@functools.cache
def build_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    accumulate: bool = True,
    wide: bool = True,
    x_rows: int = 1,
    ahead: int = 1,
    row_scaled: bool = False,
):
    """Compile-time specialisation: the dtype of x and A (bf16 or fp16), the output's,
    warps per block (``threads // 32``), 16-token tiles per block, 8-rank tiles per block
    (``blockIdx.y`` numbers the block's group of ``8 * n_tiles`` ranks), whether the
    products are added to the output or stored, and whether every row of x and A starts
    at a multiple of 16 bytes (``wide``: 16-byte loads).

    The kernel takes x as ``[T, K/4]`` and A as ``[L, r, K/4]`` int64 words of four
    elements (K a multiple of 8). ``x_rows``: the output rows that share a row of x, row
    ``t`` of the output reading row ``t // x_rows`` (MoE LoRA's pairs of a token, its
    ``top_k``: :mod:`..ops.moe_dense`); 1 for the dense op (the same code: a division by
    one is no instruction). ``ahead``: the passes of loads on their way ("Passes ahead").
    ``row_scaled``: ``scaling`` is an fp32 array, a factor an output row (MoE LoRA's router
    weights, as the row shrink's build of :mod:`.shrink` takes them), in a kernel that
    stores."""
    if row_scaled and accumulate:
        raise ValueError("row_scaled takes a kernel that stores")
    parts = mma_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, ahead=ahead)
    walk, tile_to_shared, warps_total = parts.walk, parts.tile_to_shared, parts.warps_total
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, WARPS, ROWS, OUTPUTS = threads, parts.warps, parts.rows, parts.outputs
    TILE_M, TILE_N, PER_THREAD = parts.tile_m, parts.tile_n, parts.per_thread
    SCRATCH_WARPS = parts.scratch_warps
    ACCUMULATE, X_ROWS = accumulate, x_rows
    scaled = row_factor if row_scaled else number_factor  # the factor of an output row

    begin = prologue()

    @jit_kernel(THREADS)
    def shrink(x, w0, w1, w2, out, slice_base, slices, tiles, sorted_tokens, scaling):
        # x: [M, K/4] int64 words; w*: [L, R, K/4] words; out: [S, M, R]; tiles: [B, 4]
        # grid: (tiles * slices, rank groups, 1)
        begin()  # wait for the kernels before this one (dependent_launch)
        tile, s_local = tile_and_slice(cuda.blockIdx.x, slices)
        slot, position, rows, first_token = read_tile(tiles, tile)
        if slot == -1:
            return
        # By hand, not segments.slice_of, as in the row shrink (.shrink): on the H200 machine
        # the two forms compile to different code here too (QKV 4096/64: 124 registers against
        # 106, 26.4-27.4 µs against 32.2-32.3; h200_v28_candidates.json).
        if s_local == 0:
            w = w0
        elif s_local == 1:
            w = w1
        else:
            w = w2
        out_slice = slice_base + s_local
        rank = w.shape[1]
        n0 = cuda.blockIdx.y * TILE_N  # the block's first rank
        chunks = (x.shape[1] + 7) // 8  # 32 elements = 8 words per chunk
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)

        token = cuda.local.array(ROWS, int64)  # row g + 8 * i of the tile
        for i in range(ROWS):
            token[i] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * i) // X_ROWS
        # The outputs this thread will store, and (accumulate) their old values, now:
        # that trip to memory overlaps the products.
        out_token = cuda.local.array(PER_THREAD, int64)
        old = cuda.local.array(PER_THREAD, float32)
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            out_token[j] = tile_token(sorted_tokens, position, rows, first_token, row)
            old[j] = float32(0.0)
            if ACCUMULATE and e < TILE_M * TILE_N:
                old[j] = load_out(out[out_slice, out_token[j], min(n0 + n, rank - 1)])

        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + i]
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        walk(x, w, slot, token, n0, g, t, warp, 0, chunks, acc, my_scratch)

        tile_to_shared(acc, partials, warp, g, t)
        for j in range(PER_THREAD):
            e = tid + THREADS * j
            row, n = e // TILE_N, e % TILE_N
            if e < TILE_M * TILE_N and row < rows and n0 + n < rank:
                total = scaled(scaling, out_token[j]) * warps_total(partials, row, n)
                out[out_slice, out_token[j], n0 + n] = store_out(old[j] + total)

    return shrink
