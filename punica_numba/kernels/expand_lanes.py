"""The lane-split expand: the op of :mod:`.expand`, each row of B read by several lanes.

The row expand (:mod:`.expand`) gives each thread whole output columns: a thread reads
its row of B word by word, and a warp's load asks for one word of each of 32 rows.
At r=16 a row is 32 bytes and that is fine; at r=64 it is 128 bytes, a thread's
products wait on 16 words in turn, and one token per slot (decode, where each token
reads its own B) reaches 29-40 % of the copy bandwidth (v9: T=64 distinct 28 µs,
T=256 distinct 83). Here a row of B is cut among ``LANES`` neighbouring lanes instead:

* block: a tile of ``TILE_M`` tokens of one segment (the tile table), one slice
  (``blockIdx.y``), groups of ``COLUMNS`` output columns from ``blockIdx.z`` on,
  strided by ``gridDim.z``;
* a row of B of ``W`` words (int64 words of 4 bf16/fp16 or 2 fp32 elements where the
  rows allow, else single elements) is read by ``LANES`` lanes, ``LW = W / LANES``
  neighbouring words each (:func:`lanes_per_row`: as many lanes as leave each two
  words, one 16-byte load); a warp reads ``32 / LANES`` neighbouring rows at once,
  that is 512 neighbouring bytes, and ``VEC`` such passes (a block's passes are
  ``THREADS / LANES`` rows apart);
* each lane reads, once per block, its ``LW`` words' worth of each token's row of x
  (the same elements for every column), multiplies, and sums its part of each dot
  product in order; the ``LANES`` parts are then added by a butterfly of warp shuffles
  (offsets ``LANES / 2, ..., 1``), which leaves every lane of the group with the same
  sum; the group's first lane adds the old output (``add_inputs``) and stores.

Every load of a block (x, B, old outputs) is issued before any is used: at decode the
kernel's time is about one trip to memory after the tile table's. On the H200 (v10, r=64,
one token per slot): T=1 5.0 -> 3.25 µs, T=64 28.2 -> 16.8, T=256 82.9 -> 53.5 (62 % of
the copy bandwidth). At r=16 the row expand's 4 columns a thread stay ahead from T=16
on. A row that would leave a lane more than :data:`MAX_LANE_WORDS` words (an odd
rank read element by element, say) goes to the row expand (:func:`splits`).

The order of the sum depends only on ``W`` (so on the rank and whether B is packed),
not on the block's shape: every lane-split configuration gives the same bits
(arithmetic key ``("lanes",)``), though not those of the row expand. The simulator has
no shuffles; there the parts go through shared memory and the group's first lane adds
them in the butterfly's order.

Where the weight stacks hold one slot, blocks of one token load B before they know the
token's slot, as the row shrink's do (:mod:`.shrink`, "One slot"): block b takes token
b, and loads its buffer row, old outputs and slot 0's rows of B together with the
token's slot, so that a one-token expand waits for one trip to memory instead of two.
The same products in the same order: the same bits.

Memory traffic per block: ``COLUMNS * r`` elements of B, ``TILE_M * r`` of x, and
``TILE_M * COLUMNS`` outputs (read too when ``add_inputs``).
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, memory_type, packing, storer, word_loader, words_loader
from .segments import read_tile, slice_of, tile_token, token_of_block

__all__ = ["build_lanes_expand_kernel", "lanes_columns", "lanes_per_row", "splits"]

#: Lanes of a warp: the most that can share one row of B.
WARP = 32


def lanes_per_row(words: int) -> int:
    """How many lanes share a row of ``words`` words: the largest power of two, at most a
    warp's 32, that divides ``words`` and leaves each lane at least two (one 16-byte
    load); 1 for a row of one word. r=16 in packed bf16 (4 words): 2; r=64: 8."""
    lanes = 1
    while 2 * lanes <= WARP and words % (2 * lanes) == 0 and words // (2 * lanes) >= 2:
        lanes *= 2
    return lanes


#: The most words of a row one lane reads (and holds, per column, in registers). Rows
#: that leave a lane more (a row of 36 bf16 is 9 words; an odd rank of 2-byte elements
#: read one by one is that many "words") go to the row expand.
MAX_LANE_WORDS = 8


def splits(words: int) -> bool:
    """Whether rows of ``words`` words suit the lane-split expand (at most
    :data:`MAX_LANE_WORDS` a lane)."""
    return words // lanes_per_row(words) <= MAX_LANE_WORDS


def lanes_columns(threads: int, vec: int, words: int) -> int:
    """Output columns one block covers per group: ``vec`` passes of a row per lane group."""
    return threads // lanes_per_row(words) * vec


@functools.cache
def build_lanes_expand_kernel(
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    tile_m: int,
    vec: int,
    packed: bool,
    words: int,
    wide: bool = False,
    one_slot: bool = False,
):
    """Compile-time specialisation on dtypes, threads per block (whole warps), the token
    tile, the passes per lane group (``vec`` columns a group), whether B arrives as
    packed int64 words, the words in one row of B (the rank, or rank / PACK when
    packed), packed, whether every row of B starts at a multiple of 16 bytes
    (``wide``: 16-byte loads), and ``one_slot``: the weight stacks hold one slot, and a
    block of one token loads its rows of B before it knows its token's slot (module
    notes; ``tile_m`` must be 1). The kernel's ``tiles`` argument is then
    ``token_lora_mapping``, and the grid has a block per token."""
    if threads % WARP:
        raise ValueError(f"threads must be whole warps, got {threads}")
    if one_slot and tile_m != 1:
        raise ValueError(f"one_slot needs tiles of one token, got tile_m={tile_m}")
    if words < 1:
        raise ValueError(f"words must be at least 1, got {words}")
    load_x, load_out, store_out = loader(x_dtype), loader(out_dtype), storer(out_dtype)
    load_w = word_loader(w_dtype, packed)
    PACK, W_WORD = packing(w_dtype, packed), memory_type(w_dtype, packed)
    THREADS, TILE_M, VEC = threads, tile_m, vec
    LANES = lanes_per_row(words)
    LW = words // LANES  # words of a row one lane reads
    PAIRS = packed and LW % 2 == 0  # read as pairs: one 16-byte load each where wide
    two_words = words_loader(wide and packed)
    XPART = LW * PACK  # elements of a row of x one lane multiplies
    GROUPS = THREADS // LANES  # lane groups of a block: rows of B per pass
    STEPS = LANES.bit_length() - 1  # of the butterfly: offsets LANES / 2, ..., 1
    COLUMNS = GROUPS * VEC
    OUTPUTS = TILE_M * VEC
    ONE_SLOT = one_slot
    read_work = token_of_block if one_slot else read_tile  # a block's token(s) and slot
    X_ELEMENTS, PART_WORDS = TILE_M * XPART, VEC * LW  # (local arrays need constant sizes)
    SHUFFLE = not SIMULATOR
    FULL_MASK = 0xFFFFFFFF

    begin = prologue()

    @jit_kernel(THREADS)
    def expand(x, w0, w1, w2, out, slice_base, col0, col1, col2, tiles, sorted_tokens, add_inputs):
        # x: [S, M, r]; w*: [L, N_s, W] words; out: [M, width]; col*: first column of a slice
        # (one slot: tiles is token_lora_mapping, [M], and block b takes token b, whose
        # slot is tested only where the block stores)
        begin()  # wait for the kernels before this one (dependent_launch)
        slot, position, rows, first_token = read_work(tiles, cuda.blockIdx.x)
        if not ONE_SLOT and slot == -1:
            return
        s_local = cuda.blockIdx.y
        w, column0 = slice_of(s_local, w0, w1, w2, col0, col1, col2)
        s = slice_base + s_local
        width = w.shape[1]
        tid = cuda.threadIdx.x
        lane, group = tid % LANES, tid // LANES  # a warp's groups are neighbouring rows
        first_word = lane * LW

        token = cuda.local.array(TILE_M, int64)
        for j in range(TILE_M):
            token[j] = tile_token(sorted_tokens, position, rows, first_token, j)
        xs = cuda.local.array(X_ELEMENTS, float32)  # [j, e]: the lane's part
        for j in range(TILE_M):
            for e in range(XPART):
                xs[j * XPART + e] = load_x(x[s, token[j], first_word * PACK + e])

        row = cuda.local.array(VEC, int64)
        part = cuda.local.array(PART_WORDS, W_WORD)  # [v, i]: the lane's words of row v
        acc = cuda.local.array(OUTPUTS, float32)  # [j, v]
        old = cuda.local.array(OUTPUTS, float32)
        parts = cuda.shared.array((1 if SHUFFLE else THREADS, OUTPUTS), float32)

        # A while loop, not range(): range's trip count with a run-time step is a
        # division routine ahead of the first loads (expand_mma's notes).
        n0 = cuda.blockIdx.z * COLUMNS
        while n0 < width:
            for v in range(VEC):  # past the slice: the last row again, never stored
                row[v] = min(n0 + group + GROUPS * v, width - 1)
            if add_inputs and lane == 0:  # the storing lane reads them now, not after
                for j in range(TILE_M):
                    for v in range(VEC):
                        old[j * VEC + v] = load_out(out[token[j], column0 + row[v]])
            for v in range(VEC):  # words first_word .. first_word + LW - 1 of row v
                b_row = w[0 if ONE_SLOT else slot, row[v]]
                if PAIRS:
                    for i in range(0, LW, 2):
                        part[v * LW + i], part[v * LW + i + 1] = two_words(b_row, first_word + i)
                else:
                    for i in range(LW):
                        part[v * LW + i] = b_row[first_word + i]
            for p in range(OUTPUTS):
                acc[p] = float32(0.0)
            for v in range(VEC):
                for i in range(LW):
                    for e in range(PACK):  # the lane's elements in order
                        b = load_w(part[v * LW + i], e)
                        for j in range(TILE_M):
                            acc[j * VEC + v] += xs[j * XPART + i * PACK + e] * b

            # Add the LANES parts of each dot product: a butterfly, every lane the same sum.
            if SHUFFLE:
                for p in range(OUTPUTS):
                    value = acc[p]
                    for step in range(STEPS):
                        value += cuda.shfl_xor_sync(FULL_MASK, value, LANES >> (step + 1))
                    acc[p] = value
            else:
                cuda.syncthreads()  # the last group's reads of the parts are done
                for p in range(OUTPUTS):
                    parts[tid, p] = acc[p]
                cuda.syncthreads()
                if lane == 0:
                    for p in range(OUTPUTS):
                        for step in range(STEPS):  # the butterfly's sums, as lane 0 sees them
                            offset = LANES >> (step + 1)
                            for q in range(offset):
                                parts[tid + q, p] = parts[tid + q, p] + parts[tid + q + offset, p]
                        acc[p] = parts[tid, p]

            if lane == 0:
                for j in range(TILE_M):
                    if j < rows and (not ONE_SLOT or slot != -1):  # (one slot: of a LoRA)
                        for v in range(VEC):
                            n = n0 + group + GROUPS * v
                            if n < width:
                                total = acc[j * VEC + v]
                                if add_inputs:  # the old output is added last (the op's order)
                                    total = old[j * VEC + v] + total
                                out[token[j], column0 + n] = store_out(total)
            n0 += cuda.gridDim.z * COLUMNS

    return expand
