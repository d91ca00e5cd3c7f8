"""MoE LoRA: how a CUDA block finds its block of (token, expert) pairs.

The pairs come sorted by slot and expert into blocks of ``block_size`` (vLLM's layout,
:mod:`punica_numba.moe_meta`): row l of ``sorted_token_ids`` holds slot l's pairs,
block b of it is expert ``expert_ids[l, b]``'s, and a CUDA block takes one of those
blocks of one row and one slice:

* ``blockIdx.x``: the block b of the row (past the row's blocks, or of expert -1: the
  CUDA block leaves at once; the grid is the bound, so it needs no look at the device);
* ``blockIdx.y``: the row, the slot l (a slot that ``adapter_enabled`` turns off leaves);
* ``blockIdx.z``: the slice (gate and up of w13; w2 has one).

That grid holds a row's bound of blocks for every slot, most of which find nothing where
slots are many and their pairs few. Version 6's kernels run on a *compact* grid instead:
along x as many CUDA blocks as the call's pairs can fill blocks (:func:`units_in_use`),
which walk the blocks in use slot by slot (:func:`unit_walker`), and no y.

The tensor-core kernels (:mod:`.moe_shrink_mma`, :mod:`.moe_expand_mma`) then take the
block's entries in passes of 16-row tiles: a pass with no pair is skipped by the whole
block, and each tile row's entry gives the input row it reads (:func:`read_pass`).

These are the first rung: every output is one thread's dot product, no shared memory,
no tensor cores. The shrink's thread takes a (pair, rank) output and reads a row of
``A[l, e]`` (K elements) and the pair's input row; the expand's thread takes a column
and, for each pair of the block, reads a row of ``B[l, e]`` (r elements) and the pair's
buffer row. The block's pairs share A and B, so those rows come from L1 and L2 after
the first pair. Deterministic: every output is written by one thread, once.

Memory traffic per launch, at most (P pairs, S slices, n_le blocks in use):
shrink reads n_le * S * r * K of A, P * K of x (per pair; per token for w13, where the
rows repeat), writes S * P * r; expand reads n_le * S * N * r of B and S * P * r of the
buffer, reads and writes S * P * N of the output.
"""

from __future__ import annotations

import functools

from numba import int32, uint32, uint64

from .._cuda import SIMULATOR, cuda

__all__ = [
    "MAX_MOE_SLICES",
    "MOST_SLOTS_AT_ONCE",
    "block_in_use",
    "chunk_reader",
    "read_pass",
    "running_sum",
    "slice_and_group",
    "slots_at_once",
    "unit_walker",
    "units_in_use",
]

#: Slices one launch takes: w13's gate and up (two weight arguments; w2 passes its one
#: twice, and launches one slice).
MAX_MOE_SLICES = 2


@cuda.jit(device=True, inline="always")
def slice_and_group(size, tile):
    """``(s, first)`` of this CUDA block's ``blockIdx.z = s * G + g``: its slice s and the
    first index (a column of the expand, a rank of the shrink) of its group g of ``tile``,
    with ``G = ceil(size / tile)`` groups a slice of ``size``. At most two slices, so no
    division by G."""
    groups = (size + tile - 1) // tile
    s = 1 if cuda.blockIdx.z >= groups else 0
    return s, (cuda.blockIdx.z - s * groups) * tile


#: The most slots whose counts a walk over the slots (:func:`unit_walker`) asks for at once.
MOST_SLOTS_AT_ONCE = 8


def slots_at_once(slots: int) -> int:
    """The slots a compact grid's walk reads together for a call of ``slots`` rows: the
    smallest power of two that holds them, up to :data:`MOST_SLOTS_AT_ONCE` (a walk works
    out the units of every slot of a batch, so a batch no larger than the rows spares
    one adapter's walk the arithmetic of eight)."""
    batch = 1
    while batch < min(slots, MOST_SLOTS_AT_ONCE):
        batch *= 2
    return batch


@functools.cache
def unit_walker(batch: int):
    """The device function ``unit_of(v, num_post_pad, enabled, block_size, sorted_ids, per)``
    of a compact grid, reading ``batch`` slots' counts at once: ``(slot, b)`` of unit v,
    the units being the ``per`` neighbouring blocks that the rows hold in use, slot by slot
    (slot l holds ``ceil(n_l / per)``, its blocks ``n_l = ceil(min(num_post_pad[l], EM) /
    block_size)``, none where ``enabled`` turns it off), unit u of slot l being its blocks
    ``u * per ..``; ``(-1, 0)`` past the last.

    A compact grid launches about as many CUDA blocks as there can be units in use
    (:func:`units_in_use`), not a row's bound of blocks for every slot, most of which would
    find nothing and leave; its CUDA blocks take units ``x, x + gridDim.x, ...`` so that
    every unit in use is taken whatever the metadata says.

    Each call reads the slots' counts from the first on, ``batch`` slots together
    (:func:`slots_at_once`: a walk over L slots waits on memory ``ceil(L / batch)`` times),
    and works out their units with selects, not branches that a load could wait behind: a
    slot's flag, a branch, its count and a compare a slot, one after the other, made a walk
    of 16 slots wait on 32 loads in a row (a first version, by its SASS for sm_90). A slot's
    units are ``ceil(min(padded, EM) / (block_size * per))``, a 32-bit division whose
    reciprocal ptxas works out once a walk. (Resuming each call at the slot where the one
    before stopped would spare reading the first slots again, but the two values it keeps
    across a CUDA block's units cost the w2 expand 30 registers or more, 127 to 157-163:
    not done.)"""
    BATCH = batch

    @cuda.jit(device=True)
    def unit_of(v, num_post_pad, enabled, block_size, sorted_ids, per):
        slots = sorted_ids.shape[0]
        entries = uint32(sorted_ids.shape[1])
        size = uint32(block_size * per)  # entries a unit covers
        padded = cuda.local.array(BATCH, int32)
        on = cuda.local.array(BATCH, int32)
        first = 0  # the number of the first unit of slot ``slot``
        for slot in range(0, slots, BATCH):
            here = min(BATCH, slots - slot)  # the batch's slots (a branch on a shape)
            for i in range(BATCH):  # i in [0, BATCH), unrolled: the loads go out together
                padded[i], on[i] = 0, 0
                if i < here:
                    padded[i] = num_post_pad[uint64(slot + i)]  # (no check for a negative)
                    on[i] = enabled[uint64(slot + i)]
            found = -1
            found_first = first
            for i in range(BATCH):  # selects, not branches, on what was loaded
                count = min(uint32(max(padded[i], 0)), entries)
                # (both sides 32-bit unsigned, so that the division is the short one)
                units = uint32(count + size - 1) // size
                if on[i] == 0:  # (and a slot past the last)
                    units = uint32(0)
                if found == -1 and v < first + units:
                    found = slot + i
                    found_first = first
                first += units
            if found != -1:
                return found, (v - found_first) * per
        return -1, 0

    return unit_of


def units_in_use(num_pairs: int, slots: int, experts: int, block_size: int, per: int) -> int:
    """The most units of ``per`` blocks that P pairs can make over ``slots`` rows of
    ``experts`` (the align step's layout, :mod:`punica_numba.moe_meta`): each (slot, expert)
    run of c pairs is ``ceil(c / block_size)`` blocks, so there are at most ``(P + R *
    (block_size - 1)) / block_size`` blocks, R = ``min(P, slots * experts)`` the runs, and
    a slot's last unit may be short: the size of a compact grid (:func:`unit_walker`)."""
    runs = min(num_pairs, slots * experts)
    blocks = -(-(num_pairs + runs * (block_size - 1)) // block_size)
    return max(1, -(-blocks // per) + (slots if per > 1 else 0))


@cuda.jit(device=True)
def running_sum(running, t, value):
    """The running sum of ``value`` over the CUDA block's threads, up to and with thread
    ``t``'s own, in the shared ``running`` (a value a thread, a power of two of them), in
    ``log2`` steps of two barriers each; every thread of the block must call it. After it
    ``running[i]`` holds thread i's sum (so the last, the block's total) until the next
    write to ``running``."""
    running[t] = value
    cuda.syncthreads()
    step = 1
    while step < running.shape[0]:
        before = running[t - step] if t >= step else 0
        cuda.syncthreads()
        running[t] += before
        cuda.syncthreads()
        step *= 2
    return running[t]


@cuda.jit(device=True)
def block_in_use(b, slot, block_size, sorted_ids, num_post_pad, enabled, expert_ids, num_experts):
    """``(start, pairs, expert)`` of block b of row ``slot``: its first entry in the row,
    how many entries it has there (block_size, or fewer at the row's end, whatever
    ``num_post_pad`` says: ``align_pairs``' never passes it), and its expert, or -1 when
    the CUDA block has nothing to do (past the row's last block, a slot turned off,
    expert -1, or an expert the weights do not hold)."""
    start = b * block_size
    pairs = min(block_size, sorted_ids.shape[1] - start)
    if start >= num_post_pad[slot] or enabled[slot] == 0:
        return start, pairs, -1
    expert = expert_ids[slot, b]
    if expert < 0 or expert >= num_experts:
        return start, pairs, -1
    return start, pairs, expert


@cuda.jit(device=True, inline="always")
def read_pass(
    rows, tile_m, g, first, sorted_ids, slot, start, pairs, num_pairs, top_k, by_pair, joined
):
    """The pass of entries ``first .. first + tile_m - 1`` of a tensor-core kernel's block
    (``pairs`` entries from ``start`` of row ``slot``): ``rows[i]`` is the input row of the
    lane's tile row ``g + 8 i``, the pass's entry ``16 (i // 2) + g + 8 (i % 2)`` (``i <
    tile_m // 8``): its pair p where the input has a row per pair (``by_pair``), else its
    token ``p // top_k``; -1 for padding and past the block. Returns whether any entry of
    the pass holds a pair (an id below ``num_pairs``: padding is ``num_pairs``), the same
    answer in every thread, so that the whole CUDA block skips an empty pass together.

    Two ways to agree (``joined``, a constant): every thread reads every entry of the pass
    before its own rows (the same reads in every thread); or a warp's lanes, which together
    read every entry of the pass for their rows, join their answers with one
    ``syncthreads_or`` (every thread of the block must call it), which spares a thread
    ``tile_m`` reads in a row."""
    if not joined:
        any_pair = False
        for e in range(first, min(first + tile_m, pairs)):  # e in [first, first + tile_m)
            p = sorted_ids[slot, start + e]
            any_pair = any_pair or 0 <= p < num_pairs
        if not any_pair:
            return False
    mine = 0  # whether one of the lane's rows holds a pair
    for i in range(tile_m // 8):  # i in [0, tile_m / 8), unrolled: tile_m is a constant
        entry = first + 16 * (i // 2) + g + 8 * (i % 2)
        rows[i] = -1
        if entry < pairs:
            p = sorted_ids[slot, start + entry]
            if 0 <= p < num_pairs:
                rows[i] = p if by_pair else p // top_k
                mine = 1
    if joined:
        return cuda.syncthreads_or(mine) != 0
    return True


@functools.cache
def chunk_reader(tile: int, by_warp: bool = False):
    """The device function ``read_chunk(pair_of, sorted_ids, slot, start, first, pairs,
    num_pairs)`` of the expands that walk a block's entries ``tile`` at a time: entries
    ``first .. first + tile - 1`` of the block (``pairs`` entries from ``start`` of row
    ``slot``), each one's pair into ``pair_of`` (-1 for padding and past the block);
    it returns whether the chunk holds a pair. Every thread gets the same entries, so the
    whole CUDA block agrees on the answer. ``tile`` is a constant, so the loop unrolls and
    ``pair_of`` stays in registers.

    Every thread reads every entry itself, unless ``by_warp`` (on a GPU; ``tile`` at most
    32, every lane of the warp calling together): then lane i reads entry ``first + i``
    alone and the warp passes the pairs round by shuffles, one load a thread instead of
    ``tile``, each with its index arithmetic (about 28 instructions an entry, for sm_90).
    The simulator has no shuffles, so there every thread reads them all."""
    TILE = tile
    FULL_MASK = 0xFFFFFFFF
    if by_warp and tile > 32:
        raise ValueError(f"a warp passes round at most 32 entries, got {tile}")

    @cuda.jit(device=True, inline="always")
    def read_chunk(pair_of, sorted_ids, slot, start, first, pairs, num_pairs):
        any_pair = False
        for i in range(TILE):  # i in [0, TILE), unrolled
            entry = first + i
            pair = sorted_ids[slot, start + min(entry, pairs - 1)]
            real = entry < pairs and 0 <= pair < num_pairs  # (padding is num_pairs)
            pair_of[i] = pair if real else -1
            any_pair = any_pair or real
        return any_pair

    @cuda.jit(device=True, inline="always")
    def read_chunk_by_warp(pair_of, sorted_ids, slot, start, first, pairs, num_pairs):
        lane = cuda.threadIdx.x % 32
        entry = first + lane
        mine = int32(-1)  # the lane's entry's pair
        if lane < TILE and entry < pairs:
            pair = sorted_ids[slot, start + entry]
            if 0 <= pair < num_pairs:  # (padding is num_pairs)
                mine = int32(pair)
        any_pair = False
        for i in range(TILE):  # i in [0, TILE), unrolled
            pair = cuda.shfl_sync(FULL_MASK, mine, i)
            pair_of[i] = pair
            any_pair = any_pair or pair != -1
        return any_pair

    return read_chunk_by_warp if by_warp and not SIMULATOR else read_chunk
