"""The tensor-core shrink with x and A staged in shared memory, each warp a few of the
block's ranks: ``out[s, t, :] (+)= scaling * x[t] @ A_s[slot(t)]^T`` as a small GEMM a block.

In :mod:`.shrink_mma` every warp of a block holds the block's whole tile of outputs and
walks its own chunks of K, reading its fragments of x and A straight from memory; the warps'
tiles are added at the end. So a block's rows of A are read once a tile of 16 (or 32)
tokens, and its rows of x once a group of ranks, and a lane's registers bound the group.
Where tokens a slot and ranks are both many that is what the time goes to. In the H200's grid
(``docs/benchmarks/h200_grid.json``, 23fb2ea) the shrinks at r=128 with hundreds of tokens
a slot reach 11-24 % of the copy bandwidth: Llama-3-70B's down projection at 8192 tokens over
8 LoRAs (K=28672) took 538 µs, while its rows of A, read again by each of 64 tiles a slot,
and x, read again by each of 2 rank groups, make about 4.7 GB through L2 (at ~10 TB/s,
about 470 µs); the DRAM floor is 115 µs.

Here the block's warps share the tile's operands instead of each reading its own:

* block: a tile of ``TILE_M = 16 * M_TILES`` tokens of one segment (the tile table), one
  slice, ``TILE_N = WARPS * 8 * N_TILES`` ranks from ``blockIdx.y * TILE_N``; warp ``w``
  owns ranks ``8 N_TILES w ..`` of them, for every token of the tile, over the block's
  whole stretch of K (its sums need no other warp's: nothing is added in shared memory);
* K in chunks of 32 elements (8 int64 words a row): a chunk's rows of x (``TILE_M``) and
  of A (``TILE_N``) are copied into one of ``STAGES`` stages of shared memory by all the
  block's threads, 16 bytes a copy (:mod:`.async_copy`: ``cp.async``, no register held),
  ``STAGES - 1`` chunks ahead of the one being multiplied; one barrier a chunk;
* a warp reads its fragments from the stage: each lane 16 bytes of a row of x a 16-row
  half-tile and of a row of A an 8-rank tile (a 64-byte row, so the 8 lanes of a quarter
  warp read 128 neighbouring bytes, every bank once), in :mod:`.shrink_mma`'s order ("Whole
  words": lane ``t`` takes words ``2t, 2t + 1`` of the chunk, the first for its first step);
* each lane stores its outputs itself: ``old + scaling * sum`` (``accumulate``) or the
  product alone.

:mod:`.shrink_mma_staged_split` is this kernel with K cut into runs, a block each, built from
the same parts (:func:`staged_shrink_parts`).

**Slices side by side** (``joint``). As in :mod:`.shrink_mma_joint`, a block may take the
launch's slices' ranks side by side (joint rank ``n`` is rank ``n - s r`` of slice ``s``): a
block a tile (``grid = (tiles, groups of joint ranks, 1)``), so that a QKV tile's rows of x are
read once, not once a slice. Here that costs nothing in the loop: which slice's A a copy reads
is settled when its address is worked out, once a block; the outputs are placed by the same
rule. The sums do not change (one warp's over K): the same key and bits.

**The same sums.** An output's sum is its chunks' products in order, each chunk's two steps
in order, in one warp: what one warp of :mod:`.shrink_mma` adds when it walks all of K (a
block of 32 threads, whose warps' total is its own), and with ``splits`` what one warp of
:mod:`.shrink_mma_split` adds. So the arithmetic key is ``("mma", 32)`` (with splits ``("mma",
32, splits)``), whatever the block's warps, and the bits are those kernels'.

**Traffic.** A block reads ``TILE_M * K`` elements of x and ``TILE_N * K`` of A, as
:mod:`.shrink_mma`'s, but its tile can be larger, the warps splitting its ranks rather than
its K: 32 tokens x 128 ranks with four warps of 32 ranks (32 outputs a lane, as a warp of
:mod:`.shrink_mma`'s 16 tokens x 64 ranks) reads A half as often and x half as often as
blocks of 16 x 64. The 70B down projection above would move about 2.4 GB through L2. On the
H200 (``h200_retime_staged_a685072.json``) staged blocks were the fastest on 18 of the tuned
table's 143 shrinks at r=64 and 128, all of 2048 tokens or more, 1.05-1.92x faster than its
picks before (QKV at r=128, 8192 tokens on one LoRA: 254.4 -> 132.5 µs); the table takes them
there.

**Deeper rings.** A chunk is 32 elements of K: a block of 64 x 128 multiplies one in about a
hundred cycles a warp, where a trip to memory takes over a thousand, so with three chunks
ahead a block waits on memory most of its time. Built with ``stages``, a block keeps that
many in dynamic shared memory (up to 227 KB on Hopper; :func:`punica_numba._cuda.jit_kernel`'s
``shared_bytes``): 12 stages of 64 x 128 hold 144 KB. The ring and the sums are the same, so
the bits are too. On an H100 (``h100_deep_rings_1ff097d.json``) they paid only at 8192 tokens
(64 x 128 in 12 stages at K=14336 on one LoRA: 222.5 -> 191.2 µs), and a block of 32 x 128
took 42 µs at K=4096 whatever its stages: a chunk costs its block about 330 ns of work
inside the SM (the wait, the barrier, the loads from the stage, the products in a chain),
not a trip to memory.

Shared memory: ``STAGES x (TILE_M + TILE_N) x 64`` bytes (40 KB for 32 x 128 in 4 stages), the
most stages of at most 8 that fit 48 KB: small blocks keep more chunks in flight (16 tokens x 64
ranks, 7 chunks ahead, 35 KB). On an H100 (lab notes, at 255c04c against 61de306) 8 stages
made blocks of 32 x 64 1.04x faster and 5 made those of 16 x 128 1.15x, in geometric mean over
128 shrinks each.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from numba import float32, int64, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .async_copy import (
    address_of,
    stage_base_of,
    stage_ring,
    stages_that_fit,
    words_copier,
)
from .dependent_launch import prologue
from .dtypes import loader, storer, word_halves, words_loader
from .mma import FRAGMENT_WORDS, mma_into
from .segments import joint_place, read_tile, tile_and_slice, tile_token

__all__ = [
    "StagedShrinkParts",
    "build_staged_mma_shrink_kernel",
    "staged_shrink_parts",
    "staged_stages",
]

#: Int64 words of a chunk's row: 32 elements of 16 bits.
CHUNK_WORDS = 8


def staged_stages(tile_m: int, tile_n: int, stages: int = 0) -> int:
    """The stages of shared memory a block of ``tile_m`` tokens and ``tile_n`` ranks keeps:
    ``stages`` 0, the most, up to 8, whose rows fit 48 KB declared in the kernel; else
    ``stages``, in dynamic shared memory (:func:`.async_copy.stages_that_fit`: a
    ``ValueError`` below 2 or past what a block may have)."""
    stage_bytes = (tile_m + tile_n) * CHUNK_WORDS * 8
    what = f"a staged shrink of {tile_m} tokens x {tile_n} ranks"
    return stages_that_fit(stage_bytes, what, stages)


@cuda.jit(device=True, inline="always")
def _row_code(x, w0, w1, w2, slot, s, index, of_x):
    """The simulator's source of a row: ``index`` for row ``index`` of x, ``-1 - (3 index +
    s)`` for row ``index`` of slice ``s``'s A of the slot."""
    return int64(index) if of_x else int64(-1 - (3 * index + s))


@cuda.jit(device=True, inline="always")
def _copy_by_code(staged, base, to, code, q, x, w0, w1, w2, slot):
    """On the simulator: words ``q``, ``q + 1`` of the row ``code`` names, copied now."""
    if code >= 0:
        row = x[code]
    else:
        s, index = (-1 - code) % 3, (-1 - code) // 3
        if s == 0:
            row = w0[slot, index]
        elif s == 1:
            row = w1[slot, index]
        else:
            row = w2[slot, index]
    staged[to], staged[to + 1] = row[q], row[q + 1]


@functools.cache
def _copies(wide: bool):
    """``(row_source, stage_base, copy)``: ``row_source(x, w0, w1, w2, slot, s, index, of_x)
    -> int64`` names row ``index`` of x (``of_x``) or of slice ``s``'s A of the slot, once;
    ``stage_base(staged)`` the shared array, once; ``copy(staged, base, to, source, q, x, w0,
    w1, w2, slot)`` starts copying words ``q``, ``q + 1`` of that row to ``staged[to]``,
    ``[to + 1]``. On the GPU the names are addresses and the copy a ``cp.async``
    (:mod:`.async_copy`); on the simulator a code and a plain copy."""
    stage_base = stage_base_of()
    if SIMULATOR:
        return _row_code, stage_base, _copy_by_code
    address, copy_words = address_of(), words_copier(wide)

    @cuda.jit(device=True, inline="always")
    def row_address(x, w0, w1, w2, slot, s, index, of_x):
        if of_x:
            return address(x[index], 0)
        if s == 0:
            return address(w0[slot, index], 0)
        if s == 1:
            return address(w1[slot, index], 0)
        return address(w2[slot, index], 0)

    @cuda.jit(device=True, inline="always")
    def copy_from_address(staged, base, to, source, q, x, w0, w1, w2, slot):
        copy_words(base + uint32(8 * to), source + 8 * q)

    return row_address, stage_base, copy_from_address


class StagedShrinkParts(NamedTuple):
    """What the staged shrinks (this one and :mod:`.shrink_mma_staged_split`) share."""

    # (x, w0, w1, w2, slices, tiles, sorted_tokens, acc, lane_token, run, runs) ->
    # (leaves, s_local, n0, rows): the block's sums of run ``run`` of ``runs`` of K
    block_sums: object
    # (mi, nj, i, n0) -> (p, r, n): output i of the lane's product tile (mi, nj) is acc[p],
    # of the token lane_token[r], the block's rank n
    place: object
    # (n, s_local, rank, slices) -> (s, j, stored): the block's rank n is rank j of slice s
    rank_of: object
    outputs: int  # fp32 sums a lane holds
    m_tiles: int
    n_tiles: int  # 8-rank tiles of a warp
    lane_rows: int  # token rows of a lane's outputs (g + 8 r)
    shared_bytes: int  # the stages' dynamic shared memory (0: declared in the kernel)


@functools.cache
def staged_shrink_parts(
    dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    wide: bool,
    joint: bool = False,
    stages: int = 0,
) -> StagedShrinkParts:
    """The parts of a staged shrink of x and A of ``dtype``, ``threads // 32`` warps,
    ``m_tiles`` 16-token tiles a block and ``n_tiles`` 8-rank tiles a *warp*, 16-byte copies
    or 8 (``wide``: every row of x and A starts at a multiple of 16 bytes). ``joint``: a
    block's ranks are the launch's slices' side by side (see "Slices side by side").
    ``stages``: 0, the stages that 48 KB declared in the kernel hold, or that many in the
    launch's dynamic shared memory ("Deeper rings")."""
    if threads % 32 or threads <= 0:
        raise ValueError(f"threads must be whole warps, got {threads}")
    add_product = mma_into(dtype)
    two_words = words_loader(True)  # (a stage's rows are 64 bytes, at a multiple of 16)
    row_source, stage_base, copy_words = _copies(wide)
    THREADS, WARPS, M_TILES, N_TILES = threads, threads // 32, m_tiles, n_tiles
    TILE_M, WARP_N = 16 * m_tiles, 8 * n_tiles
    TILE_N = WARP_N * WARPS
    ROWS = TILE_M + TILE_N  # a stage's rows: the tile's rows of x, then the block's of A
    STAGES = staged_stages(TILE_M, TILE_N, stages)
    STAGE_WORDS = ROWS * CHUNK_WORDS
    STAGED_WORDS = STAGES * STAGE_WORDS
    SHARED_BYTES = 8 * STAGED_WORDS if stages else 0
    COPIES = -(-ROWS * 4 // THREADS)  # 16-byte copies a thread starts a stage
    PAIRS = ROWS * 4  # 16-byte pairs of words in a stage
    LANE_ROWS = 2 * M_TILES  # token rows of a lane's fragments and outputs: g + 8 r
    X_WORDS, A_WORDS = 2 * LANE_ROWS, 2 * N_TILES  # words of a lane's fragments of a chunk
    OUTPUTS = M_TILES * N_TILES * 4
    SCRATCH_WARPS = WARPS if SIMULATOR else 1
    ALIGNMENT = None if SIMULATOR else 16  # (the simulator takes no alignment)
    JOINT = joint

    @cuda.jit(device=True, inline="always")
    def rank_of(n, s_local, rank, slices):
        """``(s, j, stored)``: the block's rank ``n`` is rank ``j`` of slice ``s``, stored or
        past the ranks (its products never stored): one slice's ranks, or (``JOINT``) the
        slices' side by side."""
        if JOINT:
            s, j = joint_place(n, rank)
            return s, j, n < slices * rank
        return s_local, n, n < rank

    @cuda.jit(device=True, inline="always")
    def sources(x, w0, w1, w2, slot, s_local, slices, tile, n0, tid, source):
        """Where each of the thread's copies reads, worked out once: pair ``tid + THREADS i``
        of a stage is words ``2 (tid % 4)``, ``+ 1`` of a chunk of its row, the row
        ``(tid + THREADS i) // 4`` of the stage: a token's row of x (``tile``: the sorted
        tokens, position, rows and first token), or a rank's of A (past the ranks the last
        one, whose products are never stored)."""
        sorted_tokens, position, rows, first_token = tile
        last = (slices if JOINT else 1) * w0.shape[1] - 1
        for i in range(COPIES):
            row = (tid + THREADS * i) // 4
            if row < TILE_M:
                token = tile_token(sorted_tokens, position, rows, first_token, row)
                source[i] = row_source(x, w0, w1, w2, slot, 0, token, True)
            else:
                s, j, _ = rank_of(min(n0 + row - TILE_M, last), s_local, w0.shape[1], slices)
                source[i] = row_source(x, w0, w1, w2, slot, s, j, False)

    @cuda.jit(device=True, inline="always")
    def start_stage(stage, chunk, copying):
        """Start copying chunk ``chunk``'s rows into stage ``stage`` (zeros past K). A pair's
        place in the stage is word ``2 (tid + THREADS i)``: row ``(tid + THREADS i) // 4``,
        words ``2 (tid % 4)``, ``+ 1``, the words the pair is copied from."""
        staged, base, x, w0, w1, w2, slot, source, tid = copying
        q = CHUNK_WORDS * chunk + 2 * (tid % 4)  # the thread's first word of the chunk
        first = stage * STAGE_WORDS + 2 * tid
        if q < x.shape[1]:  # and so is q + 1: K's words are even
            for i in range(COPIES):
                if tid + THREADS * i < PAIRS:
                    to = first + 2 * THREADS * i
                    copy_words(staged, base, to, source[i], q, x, w0, w1, w2, slot)
        else:
            for i in range(COPIES):
                if tid + THREADS * i < PAIRS:
                    to = first + 2 * THREADS * i
                    staged[to], staged[to + 1] = int64(0), int64(0)

    @cuda.jit(device=True, inline="always")
    def multiply_stage(stage, multiplying):
        """Add the warp's products of one staged chunk: its first step, then its second."""
        staged, warp, g, t, acc, scratch = multiplying
        xw = cuda.local.array(X_WORDS, int64)  # [lane row, word of the pair]
        aw = cuda.local.array(A_WORDS, int64)  # [rank tile, word of the pair]
        x_at = stage * STAGE_WORDS + CHUNK_WORDS * g + 2 * t  # row g
        a_at = stage * STAGE_WORDS + CHUNK_WORDS * (TILE_M + WARP_N * warp + g) + 2 * t
        for i in range(LANE_ROWS):  # rows g + 8 i
            xw[2 * i], xw[2 * i + 1] = two_words(staged, x_at + 8 * CHUNK_WORDS * i)
        for nj in range(N_TILES):  # ranks 8 nj + g of the warp's
            aw[2 * nj], aw[2 * nj + 1] = two_words(staged, a_at + 8 * CHUNK_WORDS * nj)
        for step in range(2):
            for mi in range(M_TILES):
                a0, a2 = word_halves(xw[4 * mi + step])  # row g + 16 mi
                a1, a3 = word_halves(xw[4 * mi + 2 + step])  # row g + 8 + 16 mi
                for nj in range(N_TILES):
                    b0, b1 = word_halves(aw[2 * nj + step])
                    add_product(acc, (mi * N_TILES + nj) * 4, a0, a1, a2, a3, b0, b1, scratch)

    fill, turn = stage_ring(STAGES, start_stage, multiply_stage)

    if SHARED_BYTES:

        @cuda.jit(device=True, inline="always")
        def stage_array():
            """The stages, in the launch's dynamic shared memory."""
            return cuda.shared.array(0, int64, alignment=ALIGNMENT)[:STAGED_WORDS]

    else:

        @cuda.jit(device=True, inline="always")
        def stage_array():
            """The stages, declared here (at most 48 KB)."""
            return cuda.shared.array(STAGED_WORDS, int64, alignment=ALIGNMENT)

    @cuda.jit(device=True, inline="always")
    def walk(x, w0, w1, w2, slot, source, first_chunk, end_chunk, tid, warp, g, t, acc, scratch):
        """The block's chunks ``first_chunk .. end_chunk - 1``, through the stages
        (:func:`.async_copy.stage_ring`)."""
        staged = stage_array()
        base = stage_base(staged)
        copying = (staged, base, x, w0, w1, w2, slot, source, tid)
        fill(first_chunk, end_chunk, copying)
        turn(first_chunk, end_chunk, copying, (staged, warp, g, t, acc, scratch))

    @cuda.jit(device=True, inline="always")
    def block_sums(x, w0, w1, w2, slices, tiles, sorted_tokens, acc, lane_token, run, runs):
        if JOINT:  # a tile a block, the slices' ranks side by side along y
            tile, s_local = cuda.blockIdx.x, 0
        else:
            tile, s_local = tile_and_slice(cuda.blockIdx.x, slices)
        slot, position, rows, first_token = read_tile(tiles, tile)
        n0 = cuda.blockIdx.y * TILE_N
        if slot == -1 or (JOINT and n0 >= slices * w0.shape[1]):
            return True, s_local, n0, rows
        chunks = (x.shape[1] + CHUNK_WORDS - 1) // CHUNK_WORDS
        per_run = (chunks + runs - 1) // runs
        first_chunk = run * per_run
        end_chunk = min(chunks, first_chunk + per_run)
        tid = cuda.threadIdx.x
        warp, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]
        source = cuda.local.array(COPIES, int64)
        tile_rows = (sorted_tokens, position, rows, first_token)
        sources(x, w0, w1, w2, slot, s_local, slices, tile_rows, n0, tid, source)
        for r in range(LANE_ROWS):
            lane_token[r] = tile_token(sorted_tokens, position, rows, first_token, g + 8 * r)
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        walk(x, w0, w1, w2, slot, source, first_chunk, end_chunk, tid, warp, g, t, acc, my_scratch)
        return False, s_local, n0, rows

    @cuda.jit(device=True, inline="always")
    def place(mi, nj, i, n0):
        """Output ``i`` of the lane's product tile ``(mi, nj)``, ``(g + 8 (i // 2), 2t + i %
        2)`` of it: its index in ``acc``, the index of its row in ``lane_token``, its rank."""
        tid = cuda.threadIdx.x
        n = n0 + WARP_N * (tid // 32) + 8 * nj + 2 * (tid % 4) + i % 2
        return (mi * N_TILES + nj) * 4 + i, 2 * mi + i // 2, n

    return StagedShrinkParts(
        block_sums, place, rank_of, OUTPUTS, M_TILES, N_TILES, LANE_ROWS, SHARED_BYTES
    )


@functools.cache
def build_staged_mma_shrink_kernel(
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    m_tiles: int,
    n_tiles: int,
    joint: bool = False,
    accumulate: bool = True,
    wide: bool = True,
    stages: int = 0,
):
    """Compile-time specialisation: the dtype of x and A (bf16 or fp16), the output's,
    warps per block (``threads // 32``), 16-token tiles per block, 8-rank tiles per *warp*
    (the block's ranks: ``threads // 32 * 8 * n_tiles``, ``blockIdx.y`` numbering its
    group), whether a block's ranks are the slices' side by side (``joint``: a block a
    tile, grid ``(tiles, groups of joint ranks, 1)``), whether the products are added to the
    output or stored, and whether every row of x and A starts at a multiple of 16 bytes
    (``wide``: 16-byte copies, else 8), and the stages (0: what 48 KB declared in the kernel
    hold; else that many in dynamic shared memory).

    The kernel takes x as ``[T, K/4]`` and A as ``[L, r, K/4]`` int64 words of four
    elements (K a multiple of 8), as :func:`.shrink_mma.build_mma_shrink_kernel`'s."""
    parts = staged_shrink_parts(dtype, threads, m_tiles, n_tiles, wide, joint, stages)
    block_sums, place, rank_of = parts.block_sums, parts.place, parts.rank_of
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, OUTPUTS, LANE_ROWS, ACCUMULATE = threads, parts.outputs, parts.lane_rows, accumulate
    M_TILES, N_TILES = parts.m_tiles, parts.n_tiles

    begin = prologue()

    @jit_kernel(THREADS, shared_bytes=parts.shared_bytes)
    def shrink(x, w0, w1, w2, out, slice_base, slices, tiles, sorted_tokens, scaling):
        # x: [M, K/4] int64 words; w*: [L, R, K/4] words; out: [S, M, R]; tiles: [B, 4]
        # grid: (tiles * slices, rank groups, 1)
        begin()  # wait for the kernels before this one (dependent_launch)
        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + i]
        lane_token = cuda.local.array(LANE_ROWS, int64)
        leaves, s_local, n0, rows = block_sums(
            x, w0, w1, w2, slices, tiles, sorted_tokens, acc, lane_token, 0, 1
        )
        if leaves:
            return
        rank, g = w0.shape[1], cuda.threadIdx.x % 32 // 4
        for mi in range(M_TILES):  # (nested loops of constant trips unroll: acc stays in
            for nj in range(N_TILES):  # registers)
                for i in range(4):
                    p, r, n = place(mi, nj, i, n0)
                    s, j, stored = rank_of(n, s_local, rank, slices)
                    if g + 8 * r < rows and stored:
                        old = float32(0.0)
                        if ACCUMULATE:
                            old = load_out(out[slice_base + s, lane_token[r], j])
                        total = old + scaling * acc[p]
                        out[slice_base + s, lane_token[r], j] = store_out(total)

    return shrink
