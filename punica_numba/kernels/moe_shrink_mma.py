"""The MoE LoRA shrink, fourth rung: a block of pairs times ``A[l, e]`` on the tensor cores.

The same sums as :mod:`.moe_shrink` (each pair's input row times ``A[l, e]`` of its block,
stored into the fp32 buffer ``[S, P, r]``). From a few hundred tokens on one to four
adapters an (adapter, expert) block holds up to ``block_size`` pairs (16 at vLLM's
default), and the block's products are a small matrix product, ``D[pairs, r] =
rows(x)[pairs, K] @ A[l, e]^T``: what a warp's ``mma.sync m16n8k16`` does (:mod:`.mma`),
16 pairs x 8 ranks x 16 elements of K in one instruction, with 16-bit x and A as they
are (exact products, fp32 sums), as :mod:`.shrink_mma` does for the linear shrink.

Work split:

* ``blockIdx.x``: the block b of pairs of the row (:mod:`.moe_blocks`), and
  ``blockIdx.y`` the row, the slot l; or, on a compact grid, units of ``BLOCKS``
  neighbouring blocks of a row, those in use, ``x, x + gridDim.x, ...``
  (:func:`.moe_blocks.unit_walker`);
* ``blockIdx.z``: the slice s and a group of ``TILE_N = 8 * N_TILES`` ranks, ``z = s * G
  + g`` with ``G = ceil(r / TILE_N)`` groups a slice; or, ``JOINT``, a group of the
  slices' ranks side by side (``z = g``, ``G = ceil(S r / TILE_N)``): w13's gate and up
  in one CUDA block, which then reads each pair's row of x once, not once a slice;
* a CUDA block walks its blocks in runs that share an expert (neighbouring blocks of a
  row often do: the align step cuts one (slot, expert)'s pairs into blocks side by
  side), and a run's entries together, so that with ``BLOCKS`` > 1 and passes of
  several 16-pair tiles a chunk of A is loaded once for up to ``TILE_M`` pairs;
* inside a CUDA block the block's entries go in passes of ``TILE_M = 16 * M_TILES``
  (one pass at ``block_size <= TILE_M``); in a pass, K is cut in chunks of 32 elements
  (8 int64 words of four) and warp ``w`` takes chunks ``w, w + WARPS, ...``, adding
  ``M_TILES x N_TILES`` product tiles of its own;
* the warps' partial tiles meet in shared memory and are added in warp order, and each
  output is stored by one thread (a sum in an order fixed by ``WARPS``: deterministic).

**Fragments from memory.** As in :mod:`.shrink_mma` ("Whole words"), lane ``t`` of a
chunk loads words ``2t`` and ``2t + 1`` of each of its rows (16 bytes, one load where
``wide``), each word four neighbouring elements of K: its low half plays the elements
``2t, 2t + 1`` of a step of 16, its high half ``2t + 8, 2t + 9``; x and A take the same
order, and a dot product does not care which. x's rows are the block's pairs' (a token's
row for w13, the pair's own for w2), A's rows ``n0 + 8 nj + g`` (past the rank the last
row again, never stored). Past K's last word a lane feeds zeros, and so does a row of
padding (an entry ``>= P``, or past the block): no load for it, and no store.

**Ahead** (version 6's builds). A warp's chunks are a chain: a chunk's loads, then its
products, which wait for them, then the next chunk's loads. With ``ahead`` a warp holds two
chunks' words and asks for the next chunk's before it multiplies this one's, so that a
chunk's loads are in flight while the one before is multiplied (:mod:`.shrink_mma` does the
same, where the H200 took T=4096 on one LoRA from 21.3 to 15.3 µs with it and 16-byte
loads). The same chunks in the same order: the same bits. The price is a second chunk's
words in registers (for sm_90 the shipped w13 build takes 254 instead of 176).

Every thread calls ``mma`` equally often (the simulator needs it, :mod:`.mma`): every
warp walks the same chunk count (past the last chunk with zero fragments), and a pass
with no pair at all is skipped by the whole block together (each thread reads the same
entries).

Memory traffic per pass (``p <= TILE_M`` pairs): ``TILE_N * K`` of A (from L2 after the
first rank group), ``p * K`` of x, ``p * TILE_N`` fp32 stores. So the L2 moves about ``P
* K * G_all + n_runs * S * r * K`` elements a call (``G_all``: the rank groups of all
slices, 1 where ``JOINT`` takes all of them; ``n_runs``: the runs of passes), and both
terms shrink with ``JOINT`` and ``BLOCKS``: w13 of Qwen3-30B-A3B at 2048 tokens on one
adapter (16,384 pairs in about 1,100 blocks of 16, K = 2048, r = 16) moves about 280 MB
one block and one slice a CUDA block, 210 MB ``JOINT``, 140 MB ``JOINT`` with runs of
2 blocks and 110 MB with runs of 4 (an estimate from these counts, not a measurement).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32, uint64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import word_halves, words_loader
from .mma import FRAGMENT_WORDS, MMA_DTYPES, mma_into
from .moe_blocks import MOST_SLOTS_AT_ONCE, block_in_use, read_pass, slice_and_group, unit_walker

__all__ = ["build_moe_mma_shrink_kernel"]


@cuda.jit(device=True, inline="always")
def _unsigned(i):
    return uint64(i)


@cuda.jit(device=True, inline="always")
def _as_it_is(i):
    return i


@functools.cache
def build_moe_mma_shrink_kernel(
    dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    wide: bool,
    blocks: int = 1,
    joint: bool = False,
    compact: bool = False,
    slots_at_once: int = MOST_SLOTS_AT_ONCE,
    ahead: bool = False,
):
    """The shrink, specialised on the dtype of x and A (bf16 or fp16), the threads per
    block (whole warps), the 16-pair tiles of one pass (``m_tiles``), the 8-rank tiles of
    one rank group (``n_tiles``), and ``wide``: the caller's promise that every row of x
    and A is a whole number of 16-byte pairs of words starting at a multiple of 16 bytes
    (one load for a lane's two words; else two, each checked against the row's end).

    ``blocks``: the blocks of a row a unit of the grid holds (runs of one expert go in
    passes together); ``joint``: one CUDA block takes every slice's ranks, side by side (a
    lane reads the row of A of its own rank, so an 8-rank tile may hold ranks of both);
    ``compact``: the grid's CUDA blocks along x walk the units in use
    (:func:`.moe_blocks.unit_walker`, reading ``slots_at_once`` slots' counts at once),
    else take block ``blockIdx.x`` of row ``blockIdx.y`` (one block a unit); ``ahead``: a
    warp loads its next chunk's words before it multiplies this chunk's ("Ahead").

    They must be constants: they size the fragment registers and the loops over them,
    which Numba unrolls only when the trip count is known.

    The kernel takes x as ``[M or P, K/4]`` and A as ``[L, E, r, K/4]`` int64 words of
    four elements (K a multiple of 4).
    """
    if dtype not in MMA_DTYPES:
        raise ValueError(f"the tensor cores take bf16 or fp16 operands, got {dtype}")
    if threads % 32:
        raise ValueError(f"threads must be whole warps, got {threads}")
    add_product = mma_into(dtype)
    unit_of = unit_walker(slots_at_once)
    two_words = words_loader(wide)
    THREADS, WARPS, M_TILES, N_TILES = threads, threads // 32, m_tiles, n_tiles
    TILE_M, TILE_N = 16 * m_tiles, 8 * n_tiles
    ROWS = 2 * M_TILES  # pair rows a lane reads: g + 8 * i
    X_WORDS, A_WORDS = 2 * ROWS, 2 * N_TILES  # a lane's words of one chunk
    OUTPUTS = M_TILES * N_TILES * 4  # a lane's outputs of its warp's tiles
    SCRATCH_WARPS = WARPS if SIMULATOR else 1
    WIDE = wide
    if blocks > 1 and not compact:
        raise ValueError(f"runs of {blocks} blocks take a compact grid")
    BLOCKS, JOINT, COMPACT, AHEAD = blocks, joint, compact, ahead
    # Whether a pass's emptiness is found by one barrier (``syncthreads_or``) over the rows
    # each lane reads anyway, rather than by every thread reading every entry: for version
    # 6's builds (a compact grid, both slices), whose passes can be 64 entries long;
    # version 5's keep the reads that were timed (moe_blocks.read_pass).
    JOINED = COMPACT or JOINT
    # Version 6's builds index x and A unsigned (no check for a negative index: every index
    # here is one; for sm_90 the shipped w13 build with its next chunk ahead 255 registers
    # and 16 bytes of spills -> 254 and none); version 5's keep the code that was timed.
    index = _unsigned if COMPACT else _as_it_is

    @cuda.jit(device=True, inline="always")
    def words_at(row, q, words, present):
        """Words ``q, q + 1`` of a row (zeros past its end, or for a row not ``present``)."""
        if not present or q >= words:
            return int64(0), int64(0)
        if WIDE:  # (a row of an even number of words: q + 1 is inside too)
            return two_words(row, q)
        return row[q], row[q + 1] if q + 1 < words else int64(0)

    begin = prologue()

    @cuda.jit(device=True, inline="always")
    def run_of(b, end, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, experts):
        """``(start, entries, expert, next_b)``: the run of blocks from block b, up to block
        ``end`` (the unit's end), that share b's expert, its first entry and entry count,
        and the block after it; expert -1 where block b has nothing to do
        (:func:`.moe_blocks.block_in_use`)."""
        if b >= expert_ids.shape[1]:  # (a unit may pass the row's blocks)
            return 0, 0, -1, end
        start, pairs, expert = block_in_use(
            b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, experts
        )
        next_b = b + 1
        if expert != -1:
            in_use = min(num_post_pad[slot], sorted_ids.shape[1])  # entries of the row in use
            while (
                next_b < end
                and next_b < expert_ids.shape[1]
                and next_b * block_size < in_use
                and expert_ids[slot, next_b] == expert
            ):
                pairs = min(pairs + block_size, sorted_ids.shape[1] - start)
                next_b += 1
        return start, pairs, expert, next_b

    @cuda.jit(device=True, inline="always")
    def slice_of(rank_index, rank):
        """``(s, j)``: the slice and its rank of the CUDA block's rank ``rank_index``: with
        ``JOINT`` the slices' ranks side by side (at most two slices), else the z slice's."""
        if JOINT and rank_index >= rank:
            return 1, rank_index - rank
        return 0, rank_index

    @cuda.jit(device=True, inline="always")
    def load_a(aw, w, w1, slot, expert, n0, ranks, rank, q, words, g):
        """The lane's words of A for each 8-rank tile of the chunk at word q: rows of ``w``
        (the z slice's), or, ``JOINT``, of w0 (``w``) or w1, whichever slice the lane's
        rank lies in (a branch a load, not a choice of arrays)."""
        for nj in range(N_TILES):
            sj, n = slice_of(min(n0 + 8 * nj + g, ranks - 1), rank)  # past: never stored
            row = (index(slot), index(expert), index(n))
            if sj == 0:
                aw[2 * nj], aw[2 * nj + 1] = words_at(w[row], q, words, True)
            else:
                aw[2 * nj], aw[2 * nj + 1] = words_at(w1[row], q, words, True)

    @cuda.jit(device=True, inline="always")
    def load_chunk(xw, aw, x, w, w1, slot, expert, n0, ranks, rank, row_of, chunk, t, g):
        """The lane's words of chunk ``chunk`` (zeros past K's end: no load), of its rows
        of x and of A."""
        words = x.shape[1]
        q = 8 * chunk + 2 * t  # the lane's first word of the chunk
        for i in range(ROWS):
            xw[2 * i], xw[2 * i + 1] = words_at(
                x[index(max(row_of[i], 0))], q, words, row_of[i] >= 0
            )
        load_a(aw, w, w1, slot, expert, n0, ranks, rank, q, words, g)

    @cuda.jit(device=True, inline="always")
    def multiply_chunk(xw, aw, acc, my_scratch):
        """Add one chunk's products to the warp's tiles: the chunk's first words, then its
        second."""
        for step in range(2):
            for mi in range(M_TILES):
                # rows g, g + 8: a0, a1 (low halves), a2, a3 (high halves)
                a0, a2 = word_halves(xw[2 * (2 * mi) + step])
                a1, a3 = word_halves(xw[2 * (2 * mi + 1) + step])
                for nj in range(N_TILES):
                    b0, b1 = word_halves(aw[2 * nj + step])
                    o = (mi * N_TILES + nj) * 4
                    add_product(acc, o, a0, a1, a2, a3, b0, b1, my_scratch)

    @cuda.jit(device=True, inline="always")
    def passes(
        x, w, w1, out, sorted_ids, slot, start, pairs, expert, s, n0, ranks, rank, top_k,
        by_pair, partials, my_scratch, row_of, xw, aw, xn, an, acc,
    ):  # fmt: skip
        """The passes of ``pairs`` entries from ``start``, all of ``expert``: each pass's
        products on the tensor cores, the warps' partial tiles added in shared memory, and
        each output stored by one thread."""
        num_pairs = out.shape[1]
        words = x.shape[1]
        chunks = (words + 7) // 8  # 32 elements = 8 words a chunk
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        for first in range(0, pairs, TILE_M):  # passes: entries first .. first + TILE_M - 1
            # passes with no pair are skipped by the whole block; row_of: the lane's rows
            if not read_pass(
                row_of, TILE_M, g, first, sorted_ids, slot, start, pairs, num_pairs, top_k,
                by_pair, JOINED,
            ):  # fmt: skip
                continue
            for o in range(OUTPUTS):
                acc[o] = float32(0.0)

            # every warp the same trips, chunks c0 + warp for c0 = 0, WARPS, ...
            if AHEAD:  # two sets of words in turn: the next chunk's loads fly meanwhile
                load_chunk(xw, aw, x, w, w1, slot, expert, n0, ranks, rank, row_of, warp, t, g)
                c0 = 0
                while c0 < chunks:
                    ahead_chunk = c0 + WARPS + warp
                    load_chunk(
                        xn, an, x, w, w1, slot, expert, n0, ranks, rank, row_of, ahead_chunk, t, g
                    )
                    multiply_chunk(xw, aw, acc, my_scratch)
                    c0 += WARPS
                    if c0 >= chunks:
                        break
                    ahead_chunk = c0 + WARPS + warp
                    load_chunk(
                        xw, aw, x, w, w1, slot, expert, n0, ranks, rank, row_of, ahead_chunk, t, g
                    )
                    multiply_chunk(xn, an, acc, my_scratch)
                    c0 += WARPS
            else:
                for c0 in range(0, chunks, WARPS):
                    load_chunk(xw, aw, x, w, w1, slot, expert, n0, ranks, rank, row_of, c0 + warp,
                               t, g)  # fmt: skip
                    multiply_chunk(xw, aw, acc, my_scratch)

            for mi in range(M_TILES):
                for nj in range(N_TILES):
                    for q4 in range(4):  # (g + 8 (q4 // 2), 2t + q4 % 2) of the product tile
                        row = 16 * mi + g + 8 * (q4 // 2)
                        column = 8 * nj + 2 * t + q4 % 2
                        partials[warp, row, column] = acc[(mi * N_TILES + nj) * 4 + q4]
            cuda.syncthreads()
            for e in range(tid, TILE_M * TILE_N, THREADS):  # e in [0, TILE_M * TILE_N)
                row, column = e // TILE_N, e % TILE_N
                entry = first + row
                if entry < pairs and n0 + column < ranks:
                    p = sorted_ids[slot, start + entry]
                    if 0 <= p < num_pairs:
                        total = partials[0, row, column]
                        for v in range(1, WARPS):  # the warps' partials, in warp order
                            total += partials[v, row, column]
                        sj, j = slice_of(n0 + column, rank)
                        out[s + sj, p, j] = total
            cuda.syncthreads()  # the partials are reused by the next pass

    @jit_kernel(THREADS)
    def moe_shrink_mma(
        x, w0, w1, out, sorted_ids, expert_ids, num_post_pad, enabled, top_k, block_size, by_pair
    ):
        # x: [M or P, K/4] int64 words; w*: [L, E, r, K/4] words; out: [S, P, r] fp32,
        # stored; sorted_ids: [L, EM]; expert_ids: [L, NB]; num_post_pad: [L]; enabled: [>= L]
        begin()  # wait for the kernels before this one (dependent_launch)
        rank = w0.shape[2]
        if JOINT:  # every slice's ranks in one row of rank groups (module notes)
            s = 0
            ranks = out.shape[0] * rank
            n0 = cuda.blockIdx.z * TILE_N  # the group's first rank of the slices side by side
        else:
            s, n0 = slice_and_group(rank, TILE_N)  # the slice, the group's first rank
            ranks = rank
        w = w0 if s == 0 else w1  # (JOINT: w0, and load_a takes w1 where a rank is its)
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[cuda.threadIdx.x // 32 if SIMULATOR else 0]
        partials = cuda.shared.array((WARPS, TILE_M, TILE_N), float32)
        row_of = cuda.local.array(ROWS, int64)  # the input row of tile row g + 8 i, -1: none
        xw = cuda.local.array(X_WORDS, int64)  # xw[i * 2 + step]
        aw = cuda.local.array(A_WORDS, int64)  # aw[nj * 2 + step]
        xn = cuda.local.array(X_WORDS, int64)  # (AHEAD) the other chunk's words
        an = cuda.local.array(A_WORDS, int64)
        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + q]

        if not COMPACT:  # block blockIdx.x of row blockIdx.y: its expert, or leave
            slot = cuda.blockIdx.y
            start, pairs, expert = block_in_use(
                cuda.blockIdx.x, slot, block_size, sorted_ids, num_post_pad, enabled,
                expert_ids, w.shape[1],
            )  # fmt: skip
            if expert == -1:
                return  # the whole CUDA block together
            passes(
                x, w, w1, out, sorted_ids, slot, start, pairs, expert, s, n0, ranks, rank,
                top_k, by_pair, partials, my_scratch, row_of, xw, aw, xn, an, acc,
            )  # fmt: skip
            return
        v = cuda.blockIdx.x  # a compact grid (moe_blocks.unit_walker): units of BLOCKS blocks
        while True:
            slot, b = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, BLOCKS)
            if slot == -1:
                break
            end = b + BLOCKS
            while b < end:  # runs of blocks of one expert
                start, pairs, expert, b = run_of(
                    b, end, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids,
                    w0.shape[1],
                )  # fmt: skip
                if expert != -1:  # (the whole CUDA block together: every thread reads it)
                    passes(
                        x, w, w1, out, sorted_ids, slot, start, pairs, expert, s, n0, ranks,
                        rank, top_k, by_pair, partials, my_scratch, row_of, xw, aw, xn, an,
                        acc,
                    )  # fmt: skip
            v += cuda.gridDim.x

    return moe_shrink_mma
