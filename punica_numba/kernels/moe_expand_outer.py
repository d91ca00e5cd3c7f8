"""The MoE LoRA expand, fourth rung: a chunk of the block's pairs at once, as outer products.

The same sums as :mod:`.moe_expand_columns`, in the same order, so the same bits: each
pair's fp32 buffer row times ``B[l, e]`` of its block, rank by rank from 0, times the
router's weight for w2, plus the pair's old output (with ``add_inputs``), rounded once.

What changes is how a CUDA block waits on memory. The third rung walks a block's pairs two
at a time, and each step is a read of the entries, then of the buffer rows and old outputs
they name, then the sums and stores: a block of 16 pairs waits on memory some sixteen
times in a row, and each load moves one 2-byte output a thread. Here a CUDA block takes
``CHUNK`` pairs of its block at once (a whole block of 16, usually):

1. each warp reads the chunk's entries, one a lane, and passes them round by shuffles
   (:func:`.moe_blocks.chunk_reader`), and each thread at once asks for its old outputs of
   every pair of the chunk, ``VEC`` neighbouring columns
   a pair in whole 8-byte words of four 16-bit outputs (:func:`words_out`), two words in
   one 16-byte load where ``VEC`` is 8 (:func:`wide_words_out`), else element by element;
2. meanwhile the expert is looked up, the thread's rows of B are read (``VEC * r``
   elements, kept as words), and the block copies the chunk's buffer rows into shared
   memory, transposed (``xs[j * CHUNK + i]``: rank j of pair i), beside the routing
   weights;
3. after one barrier, rank by rank: the thread's ``VEC`` values of B at rank j (widened
   from the words) times the chunk's ``CHUNK`` buffer values at rank j (the same for
   every thread: a broadcast from shared memory) into ``CHUNK x VEC`` fp32 sums, an outer
   product a rank;
4. each sum times its weight, plus its old output, rounded two at a time into words and
   stored a word at a time.

So a chunk waits on memory about twice, and its loads all travel together. Work split,
as the third rung's, but over a compact grid:

* ``blockIdx.x``: the blocks of pairs in use, slot by slot, ``x, x + gridDim.x, ...``
  (:func:`.moe_blocks.unit_walker`): the launcher sizes the grid to the blocks the call's pairs
  can fill (:func:`.moe_blocks.units_in_use`), not to a row's bound of blocks for every
  slot (2048 tokens of top-8 over 16 adapters: 1,144 blocks a row, 18,304 for the 16 rows,
  of which at most 2,944 can hold pairs);
* ``blockIdx.z``: the slice s and a group of ``THREADS * VEC`` columns, ``z = s * G + g``
  with ``G = ceil(N / (THREADS * VEC))`` (the launcher sizes the block to the slice: w13's
  768 columns are 192 threads of 4).

Thread ``tid`` owns columns ``n0 + VEC * tid .. + VEC - 1`` of its group: a warp's 32 threads
own ``32 * VEC`` neighbouring columns, so a warp's load of one pair's old outputs is one
piece of 256 bytes (VEC = 4, 16-bit outputs). Padding (an entry ``>= P``) and columns past
the slice read row 0 or the slice's last columns, in bounds, and store nothing.
Deterministic: every output is stored by one thread, its sum in rank order.

Registers a thread holds across the sums: ``CHUNK * VEC`` sums and ``CHUNK * VEC`` old
outputs (packed, two a register); the launcher picks ``CHUNK`` so that these stay within
what a thread can hold, and the chunk's staged buffer rows within a share of shared memory
(:func:`punica_numba.ops.moe.outer_shape`). The loop over the ranks is not unrolled (a
chunk of 16 pairs makes it 1,024 products long, past what the compiler unrolls), so the
``VEC * r`` elements of B, indexed by the rank, sit in the thread's local memory, which
L1 serves, whatever the rank: four 8-byte loads a rank for 64 products (sm_90,
``probes/moe_static.py``).

The shapes are sized for two CUDA blocks an SM (twelve or sixteen warps), and a register
ceiling holds them there (:func:`registers_for`, through :func:`punica_numba._cuda.jit_kernel`,
binding only where ptxas goes over it): ptxas's own count moves with small changes
elsewhere in the code. The w2 expand of 256 threads took 161 registers where its walk
reads one slot and 127 where it reads four or eight (one CUDA block an SM against two);
held to 128 it spills nothing (sm_90, ptxas 13.0, ``probes/moe_static.py --bench 6``).

Memory traffic per CUDA block in use (pairs ``p <= block_size``): ``THREADS * VEC * r``
of B, once; ``r`` fp32 of the buffer and a weight per pair, once (not once a thread);
``p * THREADS * VEC`` outputs read (with ``add_inputs``) and written.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint64

from .._cuda import SIMULATOR, SM_REGISTERS, THREAD_REGISTERS, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import (
    bf16_pair,
    bf16_pair_values,
    bf16_word,
    f16_pair,
    f16_pair_values,
    four_float32_loader,
    loader,
    memory_type,
    packing,
    storer,
    word_halves,
    word_loader,
    words_loader,
    words_storer,
)
from .moe_blocks import MOST_SLOTS_AT_ONCE, block_in_use, chunk_reader, slice_and_group, unit_walker

__all__ = [
    "BLOCKS_AN_SM",
    "build_moe_outer_expand_kernel",
    "registers_for",
    "wide_words_out",
    "words_out",
]

#: CUDA blocks an SM is to hold (module notes: the register ceiling).
BLOCKS_AN_SM = 2

#: 16-bit outputs in a word (an int64).
WORD_OUTPUTS = 4


def registers_for(threads: int, blocks: int = BLOCKS_AN_SM) -> int:
    """The most registers a thread may have for an SM to hold ``blocks`` CUDA blocks of
    ``threads`` threads: its 65,536 shared out, in the steps of 8 a thread that they are
    given in (at most the 255 a thread can have)."""
    return min(THREAD_REGISTERS, SM_REGISTERS // (blocks * threads) // 8 * 8)


def words_out(out: torch.Tensor, offset: int, width: int, vec: int) -> bool:
    """Whether the expand may read and write ``out`` ([P, W], a row per pair) in 8-byte words
    of four outputs, ``vec`` neighbouring columns a thread: 16-bit outputs, every word the
    thread touches starting at a multiple of 8 bytes (the rows' starts, ``offset`` and the
    slices' width of ``width`` all multiples of four elements, and ``vec`` too), and no
    thread's columns crossing a slice's end (``width`` a multiple of ``vec``)."""
    return (
        out.element_size() == 2
        and vec % WORD_OUTPUTS == 0
        and width % vec == 0
        and offset % WORD_OUTPUTS == 0
        and out.shape[1] % WORD_OUTPUTS == 0
        and out.data_ptr() % 8 == 0
    )


def wide_words_out(out: torch.Tensor, offset: int, width: int, vec: int) -> bool:
    """Whether, beyond :func:`words_out`, each thread's words go in pairs of one 16-byte
    load or store: ``vec`` a multiple of 8 outputs, the rows' starts, ``offset`` and
    ``width`` multiples of 8 elements, ``out`` at a multiple of 16 bytes."""
    return (
        words_out(out, offset, width, vec)
        and vec % (2 * WORD_OUTPUTS) == 0
        and offset % 8 == 0
        and width % 8 == 0
        and out.shape[1] % 8 == 0
        and out.data_ptr() % 16 == 0
    )


@functools.cache
def build_moe_outer_expand_kernel(
    w_dtype: torch.dtype,
    out_dtype: torch.dtype,
    threads: int,
    vec: int,
    chunk: int,
    rank: int,
    packed_b: bool,
    packed_out: bool,
    wide_out: bool,
    wide_x: bool,
    weighted: bool,
    add_inputs: bool,
    slots_at_once: int = MOST_SLOTS_AT_ONCE,
):
    """The expand, specialised on the dtypes of B and of the output, the threads per block,
    the neighbouring columns a thread owns (``vec``), the pairs taken at once (``chunk``),
    the rank, whether B arrives as packed int64 words (the rank a multiple of their
    elements), whether the output does (``packed_out``: :func:`words_out` holds, and
    ``out`` is its int64 view) and in pairs of words (``wide_out``:
    :func:`wide_words_out` holds), ``wide_x``: the caller's promise that every buffer row
    starts at a multiple of 16 bytes (the rank a multiple of 4), the op's two options, and
    the slots whose counts the compact grid's walk reads at once
    (:func:`.moe_blocks.slots_at_once`).

    All of them size registers, shared memory or unrolled loops, so they are constants;
    the options leave no branch behind.
    """
    unit_of = unit_walker(slots_at_once)
    PACK_B = packing(w_dtype, packed_b)
    if rank % PACK_B:
        raise ValueError(f"packed rows of B take a rank that is a multiple of {PACK_B}, got {rank}")
    if wide_x and rank % 4:
        raise ValueError(f"16-byte buffer loads take a rank that is a multiple of 4, got {rank}")
    if packed_out and (out_dtype.itemsize != 2 or vec % WORD_OUTPUTS):
        raise ValueError(
            f"outputs in words take 16-bit outputs and a multiple of {WORD_OUTPUTS} columns a "
            f"thread, got {out_dtype} and {vec}"
        )
    if wide_out and not (packed_out and vec % (2 * WORD_OUTPUTS) == 0):
        raise ValueError(
            f"16-byte outputs take outputs in words and a multiple of {2 * WORD_OUTPUTS} "
            f"columns a thread, got packed_out={packed_out} and {vec}"
        )
    if not SIMULATOR and threads % 32:
        raise ValueError(f"threads must be whole warps on a GPU, got {threads}")
    load_w = word_loader(w_dtype, packed_b)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    round_pair = f16_pair if out_dtype == torch.float16 else bf16_pair  # two fp32 -> 32 bits
    pair_values = f16_pair_values if out_dtype == torch.float16 else bf16_pair_values
    load_four = four_float32_loader(wide_x)
    load_two, store_two = words_loader(wide_out), words_storer(wide_out)
    read_chunk = chunk_reader(chunk, by_warp=True)  # (whole warps on a GPU: below)
    THREADS, VEC, CHUNK, RANK = threads, vec, chunk, rank
    GROUP = THREADS * VEC  # columns a CUDA block owns
    WORDS_B = RANK // PACK_B  # words in a row of B
    W_WORD = memory_type(w_dtype, packed_b)
    PACKED_OUT, WIDE_OUT, WIDE_X = packed_out, wide_out, wide_x
    WEIGHTED, ADD_INPUTS = weighted, add_inputs
    OUT_WORDS = VEC // WORD_OUTPUTS if PACKED_OUT else 1  # a pair's words of the thread
    OLD = CHUNK * OUT_WORDS if PACKED_OUT else CHUNK * VEC  # old outputs held, words or values
    OLD_TYPE = int64 if PACKED_OUT else float32
    B_WORDS = VEC * WORDS_B  # the thread's words of B
    SUMS = CHUNK * VEC  # the thread's outputs of a chunk
    XS = RANK * CHUNK  # the chunk's buffer values, staged
    # 16 bytes, so that four pairs' values of a rank are one shared load (the simulator
    # takes no alignment)
    XS_ALIGNMENT = None if SIMULATOR else 16
    QUADS = RANK // 4  # 16-byte loads in a buffer row (wide_x)
    STAGED = CHUNK * QUADS if WIDE_X else CHUNK * RANK  # loads of one chunk's buffer rows
    # the turns of the block's threads at those loads, and at the chunk's entries: constants,
    # so that the loops unroll (one turn where the block has the threads)
    STAGE_ROUNDS, ENTRY_ROUNDS = -(-STAGED // THREADS), -(-CHUNK // THREADS)

    @cuda.jit(device=True, inline="always")
    def stage(xs, ps, ws, x, weights, s, sorted_ids, slot, start, first, pairs, num_pairs, tid):
        """The chunk's buffer rows into ``xs`` (transposed), its pairs into ``ps`` and its
        weights into ``ws``, shared by the block's threads: zeros (and pair -1) for padding
        and past the block. (The epilogue reads the pairs from ``ps``, so that no thread
        holds them in registers through the sums.)"""
        for rounds in range(STAGE_ROUNDS):  # the block's threads take the loads in turn
            v = tid + rounds * THREADS
            if v >= STAGED:
                break
            i = v // QUADS if WIDE_X else v // RANK
            entry = first + i
            p = sorted_ids[slot, start + min(entry, pairs - 1)]
            real = entry < pairs and 0 <= p < num_pairs
            row = x[s, p if real else 0]
            if WIDE_X:
                j = 4 * (v - i * QUADS)
                a0, a1, a2, a3 = load_four(row, j)
                zero = float32(0.0)
                xs[j * CHUNK + i] = a0 if real else zero
                xs[(j + 1) * CHUNK + i] = a1 if real else zero
                xs[(j + 2) * CHUNK + i] = a2 if real else zero
                xs[(j + 3) * CHUNK + i] = a3 if real else zero
            else:
                j = v - i * RANK
                xs[j * CHUNK + i] = row[j] if real else float32(0.0)
        for rounds in range(ENTRY_ROUNDS):
            i = tid + rounds * THREADS
            if i >= CHUNK:
                break
            entry = first + i
            p = sorted_ids[slot, start + min(entry, pairs - 1)]
            real = entry < pairs and 0 <= p < num_pairs
            ps[i] = p if real else -1
            if WEIGHTED:
                ws[i] = weights[p] if real else float32(0.0)

    @cuda.jit(device=True, inline="always")
    def load_old(old, out, pair_of, first_out, last_out):
        """The thread's old outputs of every pair of the chunk (padding reads row 0): words
        from ``first_out`` (PACKED_OUT), else elements, columns past the slice clamped to
        ``last_out``."""
        for i in range(CHUNK):  # i in [0, CHUNK), unrolled
            row = out[uint64(max(pair_of[i], 0))]  # (unsigned: no check for a negative index)
            if WIDE_OUT:  # pairs of words, 16 bytes a load
                for v in range(0, OUT_WORDS, 2):
                    old[i * OUT_WORDS + v], old[i * OUT_WORDS + v + 1] = load_two(
                        row, first_out + v
                    )
            elif PACKED_OUT:
                for v in range(OUT_WORDS):
                    old[i * OUT_WORDS + v] = row[uint64(first_out + v)]
            else:
                for c in range(VEC):
                    old[i * VEC + c] = load_out(row[min(first_out + c, last_out)])

    @cuda.jit(device=True, inline="always")
    def finish(acc, ws, old, i, c):
        """Output (i, c) as an fp32 value: its sum, times the pair's weight, plus its old
        output (an element of ``old``; words are added by :func:`new_word`)."""
        value = acc[i * VEC + c]
        if WEIGHTED:
            value *= ws[i]
        if ADD_INPUTS and not PACKED_OUT:  # the old output is added last (the op's order)
            value += old[i * VEC + c]
        return value

    @cuda.jit(device=True, inline="always")
    def new_word(acc, ws, old, i, v):
        """Word v of pair i's outputs (PACKED_OUT): four outputs from :func:`finish`, plus
        the old word's four, rounded two at a time."""
        c = WORD_OUTPUTS * v
        f0, f1 = finish(acc, ws, old, i, c), finish(acc, ws, old, i, c + 1)
        f2, f3 = finish(acc, ws, old, i, c + 2), finish(acc, ws, old, i, c + 3)
        if ADD_INPUTS:
            low, high = word_halves(old[i * OUT_WORDS + v])
            o0, o1 = pair_values(low)
            o2, o3 = pair_values(high)
            f0, f1, f2, f3 = f0 + o0, f1 + o1, f2 + o2, f3 + o3
        return bf16_word(round_pair(f0, f1), round_pair(f2, f3))  # (any 16-bit pairs)

    @cuda.jit(device=True, inline="always")
    def expand_block(
        slot, b, x, w, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, block_size,
        s, width, mine, first_out, last_out, pair_of, b_words, acc, old, xs, ps, ws,
    ):  # fmt: skip
        """Block b of row ``slot``: its expert, the thread's rows of B, then its pairs a
        chunk at a time (module notes). Every thread of the CUDA block calls it with the
        same block, and each leaves it at the same point."""
        num_pairs = out.shape[0]
        tid = cuda.threadIdx.x
        inside = mine < width  # (PACKED_OUT: all VEC columns are, or none)
        start = b * block_size
        pairs = min(block_size, sorted_ids.shape[1] - start)  # (units keep start in the row)

        # The first chunk's entries, then the block's expert: two trips to memory in flight
        # together; then the old outputs, the rows of B and the buffer rows, all together.
        any_pair = read_chunk(pair_of, sorted_ids, slot, start, 0, pairs, num_pairs)
        _, _, expert = block_in_use(
            b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, w.shape[1]
        )
        if expert == -1:  # (every thread: no barrier is left waiting)
            return
        for c in range(VEC):
            n = min(mine + c, width - 1)  # past the slice: never stored
            for k in range(WORDS_B):  # k in [0, r/PACK_B), unrolled
                b_words[c * WORDS_B + k] = w[slot, expert, n, k]

        first = 0
        while True:  # chunks: entries first .. first + CHUNK - 1 of the block
            if any_pair:  # (the same answer in every thread: the barrier below is reached)
                if ADD_INPUTS:
                    load_old(old, out, pair_of, first_out, last_out)
                stage(
                    xs, ps, ws, x, weights, s, sorted_ids, slot, start, first, pairs, num_pairs, tid
                )
                cuda.syncthreads()
                for k in range(SUMS):
                    acc[k] = float32(0.0)
                for j in range(RANK):  # j in [0, r), in order: an outer product a rank
                    for c in range(VEC):
                        bj = load_w(b_words[c * WORDS_B + j // PACK_B], j % PACK_B)
                        for i in range(CHUNK):
                            acc[i * VEC + c] += xs[j * CHUNK + i] * bj
                for i in range(CHUNK):
                    p = ps[i]
                    if p != -1 and inside:
                        row = out[uint64(p)]
                        if WIDE_OUT:
                            for v in range(0, OUT_WORDS, 2):
                                store_two(
                                    row,
                                    first_out + v,
                                    new_word(acc, ws, old, i, v),
                                    new_word(acc, ws, old, i, v + 1),
                                )
                        elif PACKED_OUT:
                            for v in range(OUT_WORDS):
                                row[uint64(first_out + v)] = new_word(acc, ws, old, i, v)
                        else:
                            for c in range(VEC):
                                if mine + c < width:
                                    row[first_out + c] = store_out(finish(acc, ws, old, i, c))
            first += CHUNK
            if first >= pairs:
                break
            cuda.syncthreads()  # every thread is done with xs before the next chunk's rows
            any_pair = read_chunk(pair_of, sorted_ids, slot, start, first, pairs, num_pairs)

    begin = prologue()

    @jit_kernel(THREADS, registers_for(THREADS))
    def moe_expand_outer(
        x, w0, w1, out, weights, sorted_ids, expert_ids, num_post_pad, enabled, block_size,
        offset,
    ):  # fmt: skip
        # x: [S, P, r] fp32; w*: [L, E, N, r/PACK_B] words; out: [P, W] elements, or
        # [P, W/4] words (PACKED_OUT), slice s at element offset + s * N; weights: [P]
        begin()  # wait for the kernels before this one (dependent_launch)
        width = w0.shape[2]
        s, n0 = slice_and_group(width, GROUP)  # the slice, the group's first column
        w = w0 if s == 0 else w1
        column0 = offset + s * width  # the slice's first element in a row of out
        mine = n0 + VEC * cuda.threadIdx.x  # the thread's first column in the slice
        if PACKED_OUT:  # in words; a thread past the slice reads its last word
            first_out = (column0 + min(mine, width - VEC)) // WORD_OUTPUTS
        else:
            first_out = column0 + mine
        last_out = column0 + width - 1

        pair_of = cuda.local.array(CHUNK, int64)  # the chunk's pairs, -1: none
        b_words = cuda.local.array(B_WORDS, W_WORD)  # b_words[c * WORDS_B + k]
        acc = cuda.local.array(SUMS, float32)  # acc[i * VEC + c]
        old = cuda.local.array(OLD, OLD_TYPE)
        xs = cuda.shared.array(XS, float32, alignment=XS_ALIGNMENT)  # xs[j * CHUNK + i]
        ps = cuda.shared.array(CHUNK, int64)  # the chunk's pairs, -1: none
        ws = cuda.shared.array(CHUNK, float32)

        # A compact grid (moe_blocks.unit_walker): blockIdx.x walks the blocks in use.
        v = cuda.blockIdx.x
        while True:
            slot, b = unit_of(v, num_post_pad, enabled, block_size, sorted_ids, 1)
            if slot == -1:
                break
            if v != cuda.blockIdx.x:
                cuda.syncthreads()  # the block before's readers of ps and ws are done
            expand_block(
                slot, b, x, w, out, weights, sorted_ids, expert_ids, num_post_pad, enabled,
                block_size, s, width, mine, first_out, last_out, pair_of, b_words, acc, old, xs,
                ps, ws,
            )  # fmt: skip
            v += cuda.gridDim.x

    return moe_expand_outer
