"""The tensor-core expand with the buffer and B staged in shared memory: a block's warps share
a large tile's operands, copied ahead of the products.

:mod:`.expand_mma` reads its operands straight into registers. Past r=64 it walks the rank
in chunks of 64, and a chunk's words of B are loaded a rank step at a time, each load a trip
that the products wait for; its tiles are 16 (or 32) tokens, so a slot's rows of B are read
again for every 16 of its tokens. In the H200's grid (``docs/benchmarks/h200_grid.json``,
23fb2ea) the expands at r=128 and 256 with hundreds of tokens a slot reach 14-24 % of the
copy bandwidth, and in the tuner's trials at r=128 (``h200_expand_m_tiles_ad02648.json``:
QKV widths of 14336, 512 tokens on one LoRA, 129 µs where the output alone is 21 µs of
DRAM) tiles of 32 tokens were no faster than 16: not the bytes through L2, then, but the
waits.

Here a block copies its operands chunk by chunk into shared memory, ``STAGES - 1`` chunks
ahead of the one being multiplied (:mod:`.async_copy`: ``cp.async``, no register held), as
:mod:`.shrink_mma_staged` does for the shrink:

* block: a tile of ``TILE_M`` tokens of one segment (the tile table and the sorted tokens:
  no rows of tokens of its own, which the metadata would make for each tile size at every
  step), one slice (``blockIdx.y``), ``TILE_N`` output columns from ``blockIdx.z *
  TILE_N``; its warps are ``WARPS_M x WARPS_N``, warp ``(wm, wn)`` owning ``M_TILES``
  16-token tiles and ``N_TILES`` 8-column tiles of it (the warps split the tokens first, so
  that each buffer element is split into halves by one warp only);
* the rank in chunks of two rank steps (32 ranks): a chunk's elements of each of the tile's
  buffer rows (fp32, 128 bytes) and of each of the block's rows of B (64 bytes) are copied
  16 bytes at a time by all the block's threads; one barrier a chunk;
* a warp reads its fragments from the stage, splits the buffer's values as
  :mod:`.expand_mma` does ("Precision": bf16 ``hi + lo``, or with fp16 B each row scaled by a
  power of two of its own and split into fp16 ``hi + lo``) and adds ``lo @ B``, then ``hi @
  B``, step by step;
* the old outputs are added last and the sums rounded once, four neighbouring columns (or
  eight) a word, the columns renumbered as in :mod:`.expand_mma` ("Whole words").

**The same sums.** Lane ``t`` takes, in rank step ``kk``, the buffer elements ``4 K_STEPS t
+ 4 kk .. + 3`` and the same of B ("The rank in a lane's order" in :mod:`.expand_mma`), so a
chunk's stage holds, for each ``t``, the 8 neighbouring elements ``4 K_STEPS t + 8 c ..``
of each row: each fragment holds what :mod:`.expand_mma`'s holds, and each output adds the
same products in the same order (steps in order, ``lo`` before ``hi``), in one warp; the old
output last. So the arithmetic key is that kernel's, ``("mma",)``, and the bits are its bits.

**What it takes.** An fp32 buffer in contiguous rows that start at multiples of 16 bytes and
a rank that is a multiple of 32, with B's rows at multiples of 16 bytes (``wide_x`` and
``wide_b`` in :func:`..ops.operands.mma_expand_operands`): every copy then moves 16 aligned
bytes and no chunk reaches past the rank. Other calls take another configuration
(:func:`..ops.choice.choose_expand`).

**Shared memory.** A stage is ``TILE_M`` buffer rows of 144 bytes (128 and 16 of padding,
so that the 8 lanes of a quarter warp, two rows x four 16-byte pieces, meet every bank once)
and ``TILE_N`` rows of B of 64 bytes; the most stages, up to 8, that fit 48 KB
(:func:`staged_expand_stages`).

**Deeper rings.** 48 KB hold two stages of a block of 64 tokens x 128 columns (17 KB each):
at r=128, four chunks, each chunk's copies wait a trip to memory of their own, and the
block's products are few beside those trips. Built with ``stages``, a block keeps that many
stages in dynamic shared memory instead (up to 227 KB on Hopper; the launcher allows the
kernel them: :func:`punica_numba._cuda.jit_kernel`'s ``shared_bytes``): with one stage
more than the rank's chunks, every chunk is on its way before the first is multiplied. One
buffer holds both, the buffer's stages first; the ring, the copies and the sums are the
same, so the bits are too. Timed on an H100 (``h100_deep_rings_1ff097d.json``: the tuned
table's 57 expands at r=128, beside their picks) they were the fastest nowhere but by 0.6 %
once: five stages of 64 x 128 took what its two stages take (1.00-1.12x), and 64 x 256 lost
everywhere. So the launch table offers none; the blocks of this kernel wait on something
other than their copies (not measured apart), and ``stages`` stays for that search.

**Traffic.** A block reads ``TILE_M * r`` buffer elements and ``TILE_N * r`` of B for
``TILE_M * TILE_N`` outputs: with 64 x 64, B a quarter as often as :mod:`.expand_mma`'s
16-token tiles and the buffer no more often than its blocks of 64 columns. On the H200
(``h200_retime_staged_a685072.json``, lab notes) it was the fastest on 6 of the tuned table's 89
expands at r=64 and 128 (r=128, 512 and 2048 tokens on one LoRA: 1.06-1.16x) and slower on the
others (the table's picks took 0.54x its best time, in geometric mean): with 2-3 stages over a
rank of four chunks and two blocks an SM, most of a block's copy time is not hidden. Not yet
measured: where the time goes (a profile), more stages in dynamic shared memory.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint32, uint64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .async_copy import (
    address_of,
    stage_base_of,
    stage_ring,
    stages_that_fit,
    words_copier,
)
from .dependent_launch import prologue
from .dtypes import (
    four_float32_loader,
    word_halves,
    words_loader,
    words_storer,
)
from .expand_mma import output_column, output_word_maker
from .mma import (
    FRAGMENT_WORDS,
    MMA_DTYPES,
    abs_bits,
    f16_row_scale,
    largest_of_lane_group,
    mma_into,
    split_pair,
    split_to_f16,
)
from .segments import read_tile, slice_of, tile_token

__all__ = [
    "build_staged_mma_expand_kernel",
    "staged_expand_stages",
    "staged_expand_warps",
]

#: Rank steps of 16 a chunk holds (32 ranks).
CHUNK_STEPS = 2
#: float32 elements of a staged buffer row (32 and four of padding), and int64 words of a
#: staged row of B (32 elements of 16 bits).
X_PADDED_ROW, B_ROW = 36, 8


def staged_expand_stages(tile_m: int, tile_n: int, stages: int = 0) -> int:
    """The stages of shared memory a block of ``tile_m`` tokens and ``tile_n`` columns keeps:
    ``stages`` 0, the most, up to 8, that fit 48 KB declared in the kernel; else ``stages``,
    in dynamic shared memory (:func:`.async_copy.stages_that_fit`; a ``ValueError`` below 2
    or past what a block may have)."""
    stage_bytes = tile_m * X_PADDED_ROW * 4 + tile_n * B_ROW * 8
    what = f"a staged expand of {tile_m} tokens x {tile_n} columns"
    return stages_that_fit(stage_bytes, what, stages)


def staged_expand_warps(threads: int, tile_m: int, tile_n: int) -> tuple[int, int, int, int]:
    """``(warps_m, warps_n, m_tiles, n_tiles)``: how a block of ``threads`` splits its tile of
    ``tile_m`` tokens x ``tile_n`` columns among its warps (the tokens first: as many warps
    along them as there are 16-token tiles, up to every warp) and each warp's 16-token and
    8-column tiles. A ``ValueError`` where they do not divide, or a warp's 8-column tiles
    are not an even number (two tiles make a word of output)."""
    warps = threads // 32
    if threads % 32 or warps == 0 or tile_m % 16 or tile_m == 0:
        raise ValueError(f"a staged expand takes whole warps and 16-token tiles, got {threads}")
    warps_m = min(warps, tile_m // 16)
    warps_n = warps // warps_m
    if warps % warps_m or (tile_m // 16) % warps_m or tile_n % (16 * warps_n) or tile_n == 0:
        raise ValueError(
            f"a staged expand of {threads} threads cannot split {tile_m} tokens x {tile_n} "
            "columns into whole tiles a warp (an even number of 8-column tiles each)"
        )
    return warps_m, warps_n, tile_m // 16 // warps_m, tile_n // (8 * warps_n)


@cuda.jit(device=True, inline="always")
def _x_code(x, s, token, q):
    """The simulator's source of a buffer copy: the element's place in the slice's buffer."""
    return int64(token) * x.shape[2] + q


@cuda.jit(device=True, inline="always")
def _b_code(b_rows, n, q):
    """The simulator's source of a copy of B: the word's place in the slot's rows."""
    return int64(n) * b_rows.shape[1] + q


@cuda.jit(device=True, inline="always")
def _copy_x_now(xs, base, to, source, q, x, s):
    """On the simulator: the four buffer elements ``q`` past the named one, copied now."""
    row = x[s, source // x.shape[2]]
    for i in range(4):
        xs[to + i] = row[source % x.shape[2] + q + i]


@cuda.jit(device=True, inline="always")
def _copy_b_now(bs, base, to, source, q, b_rows):
    """On the simulator: the two words of B ``q`` past the named one, copied now."""
    row = b_rows[source // b_rows.shape[1]]
    at = source % b_rows.shape[1] + q
    bs[to], bs[to + 1] = row[at], row[at + 1]


@functools.cache
def _copies():
    """``(x_source, b_source, stage_base, copy_x, copy_b)``: ``x_source(x, s, token, q)``
    names element ``q`` of the token's buffer row and ``b_source(b_rows, n, q)`` word ``q``
    of row ``n`` of B, once; ``stage_base(staged)`` a shared array; ``copy_x(xs, base, to,
    source, q, x, s)`` starts copying 16 bytes from element ``q`` past the named one to
    ``xs[to]`` (``copy_b`` the same for two words of B). On the GPU the names are addresses
    and the copies ``cp.async``; on the simulator the row and a plain copy."""
    stage_base = stage_base_of()
    if SIMULATOR:
        return _x_code, _b_code, stage_base, _copy_x_now, _copy_b_now
    address, copy16 = address_of(), words_copier(True)

    @cuda.jit(device=True, inline="always")
    def x_source(x, s, token, q):
        return address(x[s, token], q)

    @cuda.jit(device=True, inline="always")
    def b_source(b_rows, n, q):
        return address(b_rows[n], q)

    @cuda.jit(device=True, inline="always")
    def copy_x(xs, base, to, source, q, x, s):
        copy16(base + uint32(4 * to), source + 4 * q)

    @cuda.jit(device=True, inline="always")
    def copy_b(bs, base, to, source, q, b_rows):
        copy16(base + uint32(8 * to), source + 8 * q)

    return x_source, b_source, stage_base, copy_x, copy_b


@functools.cache
def build_staged_mma_expand_kernel(
    threads: int,
    tile_m: int,
    tile_n: int,
    k_steps: int,
    wide: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    stages: int = 0,
):
    """Compile-time specialisation: warps per block (``threads // 32``), the block's tile of
    ``tile_m`` tokens x ``tile_n`` columns (:func:`staged_expand_warps`), the rank in steps
    of 16 (``k_steps``, even: the rank a multiple of 32), ``wide`` (16-byte words of output:
    a warp's 8-column tiles a multiple of 4; the caller's promise that output rows start at
    multiples of 16 bytes and slices start and end at multiples of 8 columns) and the dtype
    of B and of the output (bf16, or fp16 on the f16 tensor cores, the buffer's rows scaled),
    and ``stages``: 0, the stages that fit 48 KB of shared memory declared in the kernel, or
    that many in dynamic shared memory ("Deeper rings").

    The kernel takes what :func:`.expand_mma.build_mma_expand_kernel`'s takes, but the sorted
    tokens in place of each tile's row of tokens, and an fp32 buffer in contiguous rows at
    multiples of 16 bytes and B's rows at multiples of 16 bytes ("What it takes" in the
    module notes)."""
    if dtype not in MMA_DTYPES:
        raise ValueError(f"B and the output must be bf16 or fp16, got {dtype}")
    if k_steps <= 0 or k_steps % CHUNK_STEPS:
        raise ValueError(f"a staged expand takes a rank of whole chunks of 32, got {k_steps} steps")
    WARPS_M, WARPS_N, M_TILES, N_TILES = staged_expand_warps(threads, tile_m, tile_n)
    if wide and N_TILES % 4:
        raise ValueError(f"16-byte words take 4 tiles each: a warp has {N_TILES}")
    SCALED = dtype == torch.float16  # each buffer row scaled into fp16's range, split in fp16
    new_word = output_word_maker(N_TILES, SCALED, SCALED)  # (fp16: its rows scaled)
    add_product = mma_into(dtype)
    load_four = four_float32_loader(True)
    two_words = words_loader(True)  # (a stage's rows of B are 64 bytes, at a multiple of 16)
    RUN = 4 if wide else 2  # tiles whose columns a lane holds side by side
    PAIR = RUN // 2  # output words a lane reads or writes at once
    load_pair, store_pair = words_loader(wide), words_storer(wide)
    x_source, b_source, stage_base, copy_x, copy_b = _copies()
    THREADS, K_STEPS, CHUNKS = threads, k_steps, k_steps // CHUNK_STEPS
    KQ = 4 * k_steps  # buffer elements of a row one lane multiplies, over every rank step
    TILE_M, TILE_N, WARP_M, WARP_N = tile_m, tile_n, 16 * M_TILES, 8 * N_TILES
    STAGES = staged_expand_stages(TILE_M, TILE_N, stages)
    X_STAGE, B_STAGE = TILE_M * X_PADDED_ROW, TILE_N * B_ROW  # a stage's floats, words
    X_STAGED, B_STAGED = STAGES * X_STAGE, STAGES * B_STAGE  # (compile-time sizes)
    # Dynamic: one buffer, the buffer's stages first (a stage's bytes are a multiple of 16).
    SHARED_BYTES = 4 * X_STAGED + 8 * B_STAGED if stages else 0
    B_FROM = X_STAGED // 2  # the int64 word of the dynamic buffer where B's stages start
    X_COPIES, B_COPIES = TILE_M * 8, TILE_N * 4  # 16-byte copies of a stage
    COPIES = -(-(X_COPIES + B_COPIES) // THREADS)  # a thread's, a stage
    ROWS = 2 * M_TILES  # token rows of a lane: g + 8 * (i % 2) of its m-tile i // 2
    WORDS = N_TILES // 2  # output words a lane holds a row
    OUTPUTS = M_TILES * N_TILES * 4
    A_WORDS = M_TILES * 8  # a step's fragments of a lane: lo (4), then hi (4), an m-tile
    B_WORDS = 2 * N_TILES  # a chunk's words of B of a lane: two steps a tile
    SCALES = ROWS if SCALED else 1
    SCRATCH_WARPS = THREADS // 32 if SIMULATOR else 1
    ALIGNMENT = None if SIMULATOR else 16

    @cuda.jit(device=True, inline="always")
    def sources(x, s, b_rows, tile, n_block, last_n, tid, source):
        """Where each of the thread's copies reads, worked out once: copy ``p = tid +
        THREADS i`` of a stage is, below ``X_COPIES``, 16 bytes of buffer row ``p // 8`` of
        the tile (lane ``t = p % 8 // 2``'s elements, the chunk's first or second four), else
        16 bytes of row ``(p - X_COPIES) // 4`` of the block's rows of B (lane ``t``'s two
        words), rows past the slice repeating its last. ``tile``: the sorted tokens and the
        tile's position, rows and first token."""
        sorted_tokens, position, rows, first_token = tile
        for i in range(COPIES):
            p = tid + THREADS * i
            if p < X_COPIES:
                q = p % 8
                token = tile_token(sorted_tokens, position, rows, first_token, p // 8)
                source[i] = x_source(x, s, token, KQ * (q // 2) + 4 * (q % 2))
            elif p < X_COPIES + B_COPIES:
                n = min(n_block + uint64((p - X_COPIES) // 4), last_n)
                source[i] = b_source(b_rows, n, K_STEPS * ((p - X_COPIES) % 4))

    @cuda.jit(device=True, inline="always")
    def start_stage(stage, chunk, copying):
        """Start copying chunk ``chunk``'s elements into stage ``stage``: a buffer row's
        pieces at floats ``X_PADDED_ROW * row + 4 q``, a row of B's at words ``B_ROW * n +
        2 t``."""
        xs, x_base, bs, b_base, source, tid, x, s, b_rows = copying
        for i in range(COPIES):
            p = tid + THREADS * i
            if p < X_COPIES:
                to = stage * X_STAGE + X_PADDED_ROW * (p // 8) + 4 * (p % 8)
                copy_x(xs, x_base, to, source[i], 8 * chunk, x, s)
            elif p < X_COPIES + B_COPIES:
                pb = p - X_COPIES
                to = stage * B_STAGE + B_ROW * (pb // 4) + 2 * (pb % 4)
                copy_b(bs, b_base, to, source[i], 2 * chunk, b_rows)

    @cuda.jit(device=True, inline="always")
    def row_scales(scale, back, x, s, token, t, my_scratch):
        """SCALED: each of the lane's rows' scale and its inverse (:func:`.mma.f16_row_scale`)
        from the row's largest magnitude: of the lane's elements (read from the buffer
        itself, before the first chunk), then of the four lanes that share the row."""
        for i in range(ROWS):
            row = x[s, token[i]]
            largest = float32(0.0)
            for kk in range(K_STEPS):
                v0, v1, v2, v3 = load_four(row, KQ * t + 4 * kk)
                largest = max(largest, max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3))))
            scale[i], back[i] = f16_row_scale(largest_of_lane_group(abs_bits(largest), my_scratch))

    @cuda.jit(device=True, inline="always")
    def multiply_stage(stage, multiplying):
        """Add the warp's products of one staged chunk, step by step: for each tile, ``lo @
        B`` then ``hi @ B``."""
        xs, bs, wm, wn, g, t, acc, a, bw, scale, my_scratch = multiplying
        for nj in range(N_TILES):  # the lane's words of B, both steps: column g of tile nj
            n = WARP_N * wn + output_column(nj, g, RUN)
            bw[2 * nj], bw[2 * nj + 1] = two_words(bs, stage * B_STAGE + B_ROW * n + 2 * t)
        for j in range(CHUNK_STEPS):
            for mi in range(M_TILES):  # the A fragments of the step: rows g, g + 8
                for half in range(2):
                    row = WARP_M * wm + 16 * mi + g + 8 * half
                    at = stage * X_STAGE + X_PADDED_ROW * row + 8 * t + 4 * j
                    v0, v1, v2, v3 = load_four(xs, at)
                    base = 8 * mi
                    if SCALED:
                        f = scale[2 * mi + half]
                        a[base + 4 + half], a[base + half] = split_to_f16(v0 * f, v1 * f)
                        a[base + 6 + half], a[base + 2 + half] = split_to_f16(v2 * f, v3 * f)
                    else:
                        a[base + 4 + half], a[base + half] = split_pair(v0, v1)
                        a[base + 6 + half], a[base + 2 + half] = split_pair(v2, v3)
            for nj in range(N_TILES):
                b0, b1 = word_halves(bw[2 * nj + j])
                for mi in range(M_TILES):
                    p = (mi * N_TILES + nj) * 4
                    for term in range(2):  # lo first, then hi
                        q = 8 * mi + 4 * term
                        add_product(acc, p, a[q], a[q + 1], a[q + 2], a[q + 3], b0, b1, my_scratch)

    if SHARED_BYTES:

        @cuda.jit(device=True, inline="always")
        def stage_arrays():
            """The buffer's stages and B's, in the launch's dynamic shared memory."""
            xs = cuda.shared.array(0, float32, alignment=ALIGNMENT)
            words = cuda.shared.array(0, int64, alignment=ALIGNMENT)
            return xs[:X_STAGED], words[B_FROM : B_FROM + B_STAGED]

    else:

        @cuda.jit(device=True, inline="always")
        def stage_arrays():
            """The buffer's stages and B's, declared here (at most 48 KB)."""
            xs = cuda.shared.array(X_STAGED, float32, alignment=ALIGNMENT)
            bs = cuda.shared.array(B_STAGED, int64, alignment=ALIGNMENT)
            return xs, bs

    fill, turn = stage_ring(STAGES, start_stage, multiply_stage)
    begin = prologue()

    @jit_kernel(THREADS, shared_bytes=SHARED_BYTES)
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs):
        # x: [S, M, r] fp32; w*: [L, N_s, r/4] int64 words; out: [M, W/4] int64 words;
        # col*: the word of a slice's first column; tiles: [B, 4] the tile table
        # grid: (tiles, slices, column groups)
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_tile(tiles, cuda.blockIdx.x)
        s_local = cuda.blockIdx.y
        w, word0 = slice_of(s_local, w0, w1, w2, col0, col1, col2)
        width = w.shape[1]  # a multiple of 4 (of 8 with ``wide``)
        n_block = uint64(cuda.blockIdx.z * TILE_N)
        if slot == -1 or n_block >= uint64(width):
            return
        s = slice_base + s_local
        b_rows = w[slot]
        last_n = uint64(width - 1)
        tid = cuda.threadIdx.x
        warp, lane = tid >> 5, tid & 31
        wm, wn = warp // WARPS_N, warp % WARPS_N
        g, t = lane >> 2, lane & 3
        tile = (sorted_tokens, position, rows, first_token)
        scratch = cuda.shared.array((SCRATCH_WARPS, 32, FRAGMENT_WORDS), uint32)
        my_scratch = scratch[warp if SIMULATOR else 0]
        xs, bs = stage_arrays()
        x_base, b_base = stage_base(xs), stage_base(bs)
        source = cuda.local.array(COPIES, int64)
        sources(x, s, b_rows, tile, n_block, last_n, tid, source)
        copying = (xs, x_base, bs, b_base, source, tid, x, s, b_rows)
        fill(0, CHUNKS, copying)  # the first chunks on their way ...

        token = cuda.local.array(ROWS, int64)  # ... while the lane finds its rows
        for i in range(ROWS):
            j = WARP_M * wm + 16 * (i // 2) + g + 8 * (i % 2)
            token[i] = tile_token(sorted_tokens, position, rows, first_token, j)
        scale = cuda.local.array(SCALES, float32)
        back = cuda.local.array(SCALES, float32)
        if SCALED:
            row_scales(scale, back, x, s, token, t, my_scratch)
        acc = cuda.local.array(OUTPUTS, float32)  # acc[(mi * N_TILES + nj) * 4 + q]
        for p in range(OUTPUTS):
            acc[p] = float32(0.0)
        a = cuda.local.array(A_WORDS, uint32)
        bw = cuda.local.array(B_WORDS, int64)  # [tile, step]
        turn(0, CHUNKS, copying, (xs, bs, wm, wn, g, t, acc, a, bw, scale, my_scratch))

        # Word v of row i holds tiles 2v and 2v + 1 (or 4v .. 4v + 3 as a pair of words):
        # lane t's columns of each, in the row's half of its m-tile ("Whole words").
        n0 = n_block + uint64(WARP_N * wn)
        last_start = uint64(word0 + ((width - 4) >> 2) - (PAIR - 1))  # the slice's last pair
        first_word = uint64(word0 + PAIR * t) + (n0 >> uint64(2))
        for i in range(ROWS):
            mi, half = i // 2, i % 2
            if WARP_M * wm + 16 * mi + g + 8 * half < rows:
                row = out[token[i]]
                for v in range(0, WORDS, PAIR):
                    word = first_word + uint64(4 * v)
                    if word <= last_start:
                        if PAIR == 2:
                            old0, old1 = int64(0), int64(0)
                            if add_inputs:
                                old0, old1 = load_pair(row, word)
                            first = new_word(acc, old0, back, mi, half, i, v)
                            second = new_word(acc, old1, back, mi, half, i, v + 1)
                            store_pair(row, word, first, second)
                        else:
                            old0 = row[word] if add_inputs else int64(0)
                            row[word] = new_word(acc, old0, back, mi, half, i, v)

    return expand
