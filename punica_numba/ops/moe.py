"""``fused_moe_lora``: MoE LoRA on the (token, expert) pairs in blocks, checked, then launched.

The op of vLLM's ``add_lora_fused_moe``: a shrink of every pair's input row into an fp32
buffer ``[S, P, r]`` by its slot's and expert's A, then an expand of that buffer by the
same B into the pair's row of ``y``, by the kernels of one ``version``:

1. a thread per output (:mod:`..kernels.moe_shrink`, :mod:`..kernels.moe_expand`);
2. the shrink in shared-memory tiles (:mod:`..kernels.moe_shrink_tiled`), the expand of 1;
3. the shrink with K split across a CUDA block's threads
   (:mod:`..kernels.moe_shrink_split`), the expand with a thread's columns of B in
   registers (:mod:`..kernels.moe_expand_columns`); their compile-time parameters are
   :data:`SPLIT_SHRINK` and :data:`COLUMNS_EXPAND`;
4. both on the tensor cores (:mod:`..kernels.moe_shrink_mma`,
   :mod:`..kernels.moe_expand_mma`; :data:`MMA_SHRINK`, :data:`MMA_EXPAND`) where
   :func:`tensor_core_words` allows it, else 3's;
5. 4's shrink where the operands allow it and the call's pairs fill its blocks
   (:func:`pairs_per_block` at least :data:`MMA_SHRINK_FROM_PAIRS`), else 3's; 3's
   expand always;
6. 5's choice of shrink, the tensor-core one taking every slice in one CUDA block and
   runs of blocks of one expert together (:data:`MMA_SHRINK_RUNS`, :func:`mma_shrink_runs`),
   and, where the pairs fill the blocks (:data:`OUTER_EXPAND_FROM_PAIRS`), the expand
   that takes a chunk of a block's pairs at once as outer products
   (:mod:`..kernels.moe_expand_outer`; :data:`OUTER_EXPAND`), else 3's; the expand and
   the shrink's runs of blocks on a compact grid (:func:`compact_units`; the shrink's
   single blocks too where :data:`COMPACT_SINGLE_BLOCK_MMA_SHRINK`, the split shrink where
   :data:`COMPACT_SPLIT_SHRINK`).
7. the dense op's tensor-core shrink and expand (:mod:`.moe_dense`): each (slot, expert)
   one slot of A and B viewed ``[L * E, ...]``, each block of pairs tiles of the dense
   tile table, w13's pairs of a token reading its row of x, the router's weights
   multiplied into the buffer before the expand; where the tensor cores cannot take a
   kernel, 6's. On an H100 at 61de306 it took 1.00-8.33x version 6's time on the 30 cases
   (docs/benchmarks/h100_moe_v7_61de306.json; lab notes, "MoE LoRA version 7"); at
   cb9702d, its tiles one kernel, 0.56-1.62x (h100_moe_v7_cb9702d.json).
8. 7's kernels where the pairs average a tile of the dense op or more a (slot, expert)
   (:data:`DENSE_FROM_PAIRS`), else 6's. The default from 0635975 until version 9.
9. 8's, but where the pairs average fewer than :data:`MMA_SHRINK_FROM_PAIRS` (4) a (slot,
   expert), the dense op's row kernels of one-token tiles (:func:`.moe_dense.row_shrink`,
   :func:`.moe_dense.row_expand`), a pair a tile of the packed table of pairs
   (:func:`.moe_dense.moe_pairs`), each (slot, expert) one slot of the dense op, the router's
   weights multiplied in as the shrink stores its rows (at a4b05b8, 9's first build, by a
   launch of their own into the buffer): where each (slot, expert) has a pair or two, as
   the dense op's slots have a token or two where it takes these kernels.
   On an H100 at a4b05b8, taking them below 16 pairs, it took 0.60-0.96x version 8's time
   at w13 below 4 pairs (0.72-1.15x at w2) and 1.12-1.96x from 4 to 16, where version 8 has
   the tensor-core shrink (docs/benchmarks/h100_moe_v9_a4b05b8.json): so they are taken
   below 4. From 4 on, 8's kernels, but where 7's dense tensor-core shrink runs the router's
   weights go in as it stores, as in the row shrink (on an H100 at 3f670de, w2 at 256 tokens
   on one adapter 27.09 -> 24.86 µs against 6426c98's multiply). The default until version 11.
   (Version 10, the row kernels on tiles of 4 pairs, was built, timed and reverted: lab notes.)
11. 9's, but for calls of at most :data:`FUSED_TO_PAIRS` pairs (one token of top-8) one
   launch: each block's pairs shrunk and expanded by one CUDA block, the buffer between the
   two in shared memory (:mod:`..kernels.moe_fused`; :data:`FUSED_PAIRS`), no table of
   pairs. The default until version 12.
12. 11's, but the dense op's tiles from :data:`TILES_FROM_PAIRS` (4) pairs a (slot,
   expert), where 8 to 11 take 6's kernels up to 16 (:func:`tiles_from_pairs`): so 6's
   kernels run only where the tensor cores cannot take a kernel. The default until version 13.
13. 12's, but the one launch for calls of up to :data:`ONE_LAUNCH_TO_PAIRS` (64) pairs (8
   tokens of top-8), not 8 (:func:`one_launch_to_pairs`). The default until version 14.
14. 13's, but the pairs path's table packed by runs of the entries that claim their rows
   with an atomic add (:func:`.moe_dense.claimed_pairs`: two launches of many CUDA blocks),
   not by one CUDA block's running sum over the call (:func:`pairs_table`). The default until
   version 16.
16. 14's, but past :func:`one_launch_to_pairs` up to :data:`SPARSE_ONE_LAUNCH_TO_PAIRS` (128)
   pairs the one launch too, with 8 columns of y a thread (:data:`FUSED_PAIRS_SPARSE`),
   where the call's (slot, expert)s are at least :data:`SPARSE_SLOTS_A_PAIR` times its pairs
   (:func:`fused_config`). The default.

The pairs arrive in blocks
(:func:`punica_numba.moe_meta.align_pairs`, or vLLM's ``moe_lora_align_block_size``)
made with the same ``block_size``. Every argument is checked before anything is
launched; the metadata's values are not (that would need a sync), but the kernels read
only pairs below P and experts below E, so stale or foreign values cannot send them
out of bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._checks import check_bool, check_int, check_sequence, check_tensor
from .._cuda import KERNEL_DTYPES, SIMULATOR
from ..kernels import moe_expand_columns as columns_expand
from ..kernels import moe_expand_mma as mma_expand
from ..kernels import moe_expand_outer as outer_expand
from ..kernels import moe_fused as fused_kernel
from ..kernels import moe_shrink_mma as mma_shrink
from ..kernels import moe_shrink_split as split_shrink
from ..kernels import moe_shrink_tiled as tiled_shrink
from ..kernels.mma import MMA_DTYPES
from ..kernels.moe_blocks import MAX_MOE_SLICES, slots_at_once, units_in_use
from ..kernels.moe_expand import build_moe_expand_kernel
from ..kernels.moe_shrink import build_moe_shrink_kernel
from ..moe_meta import check_adapter_enabled
from .launching import launcher_of
from .moe_dense import (
    TILE_M,
    claimed_pairs,
    dense_expand,
    dense_shrink,
    moe_pairs,
    moe_tiles,
    row_expand,
    row_shrink,
)
from .operands import rows_start_at, words

__all__ = ["fused_moe_lora"]

#: Threads per block: the simulator runs each as a Python thread.
THREADS = 8 if SIMULATOR else 128

_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)

#: The kernel versions (``version``; module docstring).
#: (10 and 15 were built, timed and reverted: lab notes.)
VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 16)
#: The version a call takes unless it asks for another: 16
#: (:data:`SPARSE_ONE_LAUNCH_TO_PAIRS`' notes).
#: Version 14, the default from 3c3cc76 until version 16: :func:`pairs_table`'s notes.
#: Version 13, the default from 00ded32 until version 14: :data:`ONE_LAUNCH_TO_PAIRS`' notes.
#: Version 12, the default from 30d253c until version 13: :data:`TILES_FROM_PAIRS`' notes.
#: Version 11, the default from 3a2ac41 until version 12: :data:`FUSED_TO_PAIRS`' notes.
#: Version 9, the default from 6426c98 until version 11. On an H100 at 6426c98 (``bench
#: --moe`` of versions 9 and 8 on one machine; docs/benchmarks/h100_moe_v9_6426c98.json,
#: h100_moe_v8_6426c98.json) it took 0.54-0.99x version 8's time on the 18 of 30 cases
#: below 4 pairs a (slot, expert), where it launches the row kernels, and 0.98-1.003x on
#: the 12 others, where it launches version 8's kernels. On an H200 at 9fd11ec, with the
#: shipped table's MoE entries (``tune --moe``), 0.44-1.03x vLLM 0.33's time, at most 0.67x on
#: 13 of 30 (docs/benchmarks/h200_moe_v9_moe_entries_9fd11ec.json).
#: Version 8, the default from 0635975 until version 9. On an H200 at 0635975 (``bench
#: --moe`` of versions 8 and 6 on one machine; docs/benchmarks/h200_moe_v8_0635975.json,
#: h200_moe_v6_0635975.json) it took 0.46-0.85x version 6's time on the 6 of 30 cases where
#: it takes version 7's kernels (one adapter from 256 tokens, four at 2048) and 0.92-1.01x
#: on the others, where it launches version 6's; on an H100 at 17411cf 0.56-0.91x and
#: 0.90-1.02x (h100_moe_v8_17411cf.json).
#: Version 6, the default from 480005d until version 8, took 0.76-0.96x version 5's time on 9 of
#: the 30 on an H200 (docs/benchmarks/h200_moe_v6_480005d.json, against h200_moe_v5.json at
#: 1ec6e02: one adapter from 64 tokens, four at 2048, w2 at 256 over four) and within 3 % of
#: it on the other 21, where it launches the same kernels as version 5 or its tensor-core
#: shrink on version 5's grid.
#: Version 5 took 0.53-0.87x version 3's time where it takes the tensor-core shrink and
#: 0.96-1.08x elsewhere (h200_moe_v3.json at 282eaa9); version 3 took 0.06-0.23x version
#: 1's (h200_moe_v1.json at 00c41e9). Version 4's expand is slower than 3's on every case
#: measured kernel by kernel; version 2 is not timed on a GPU.
DEFAULT_VERSION = 16

#: Version 5 takes the tensor-core shrink from this many pairs a block in use on average
#: (:func:`pairs_per_block`), the split shrink below it. Per-kernel device times on an H200
#: at cc380e6 (torch.profiler; Qwen3-30B-A3B's layer, r=16, bf16, blocks of 16): at 1 pair
#: a block (w13, 16 tokens on one adapter) the split shrink takes 12.5 µs and the
#: tensor-core one 22.2; at 8 (w13, 2048 tokens over 16 adapters) 351.2 and 120.5, and at
#: 16 and 128 (256 and 2048 tokens on one) the tensor cores win too. Nothing between 1 and 8
#: was measured: 4 is a point between them, not a measured crossing.
MMA_SHRINK_FROM_PAIRS = 4


#: Version 8 takes version 7's kernels from this many pairs a (slot, expert) on average
#: (:func:`pairs_per_block`), version 6's below it: a tile of the dense op (16 pairs). Its
#: tensor-core tiles are 16 rows whatever the blocks hold, so below a tile's worth most of
#: each is padding, where version 6 takes kernels fitted to fewer pairs. On an H100 at
#: cb9702d (``bench --moe``, Qwen3-30B-A3B's layer, r=16, bf16, blocks of 16) version 7
#: took 0.56-0.90x version 6's time on the 6 cases at 16 and more (one adapter from 256
#: tokens, four at 2048), and 0.85-1.62x on the 24 below
#: (docs/benchmarks/h100_moe_v6_cb9702d.json, h100_moe_v7_cb9702d.json).
DENSE_FROM_PAIRS = TILE_M

#: Version 12 takes the dense op's tiles from this many pairs a (slot, expert) on average,
#: the pairs path below it (as version 9 does): version 6's kernels, which 8 to 11 take from
#: here up to :data:`DENSE_FROM_PAIRS`, no longer beat the tiles, which have since taken
#: version 9's row kernels, the tuned MoE entries and, on a GPU without a table, the 4-warp
#: shrink. On an H100 at 470088f (``probes/moe_dense_from_pairs.py``;
#: docs/benchmarks/h100_moe_dense_from_pairs_470088f.json: ``bench --moe``'s layer, both
#: projections, 64-2048 tokens on 1, 4 and 16 adapters, 4-16 pairs a (slot, expert)) the tiles
#: took 0.61-0.73x version 6's kernels' time on all 12 such calls at r=16 and 0.32-0.66x on
#: all 12 at r=64. Below 4 the pairs path stays: at dfa2c7a the tiles from 1 pair took
#: 1.05-1.44x its time on all 14 calls of about one pair, and from 2 pairs 0.96-1.24x on the
#: 4 of two (docs/benchmarks/h100_moe_tiles_below_4_dfa2c7a.json).
TILES_FROM_PAIRS = MMA_SHRINK_FROM_PAIRS


def tiles_from_pairs(version: int = DEFAULT_VERSION) -> float:
    """The pairs a (slot, expert) on average from which ``version`` (8 and later) takes the
    dense op's tiles: :data:`TILES_FROM_PAIRS` from version 12, else
    :data:`DENSE_FROM_PAIRS`."""
    return TILES_FROM_PAIRS if version >= 12 else DENSE_FROM_PAIRS


class SplitShrink(NamedTuple):
    """Version 3's shrink (:mod:`..kernels.moe_shrink_split`): threads per CUDA block (a
    power of two, at least ``tile_n * tile_p``), the ranks and the pairs of one chunk's
    sums, and the strides of K whose loads a thread issues together."""

    threads: int
    tile_n: int
    tile_p: int
    unroll: int


class ColumnsExpand(NamedTuple):
    """Version 3's expand (:mod:`..kernels.moe_expand_columns`): threads per CUDA block,
    the columns a thread owns and the pairs whose loads it issues together, each lowered
    (to 1 at the least) until it holds at most ``values`` fp32 of B, and as many of the
    buffer rows, in registers (:func:`columns_shape`)."""

    threads: int
    vec: int
    tile_p: int
    values: int


#: Version 3's compile-time parameters, in one place. On the simulator, where every CUDA
#: thread is a Python thread, a few threads and small tiles (that rank groups, chunks of
#: pairs and column groups are crossed at test sizes). The GPU's are a first choice from
#: one short sweep of ``bench --moe --version 3`` on an H200 (the sweep itself is not
#: recorded; the run at 282eaa9 with these is docs/benchmarks/h200_moe_v3.json): to be tuned.
SPLIT_SHRINK = (
    SplitShrink(threads=4, tile_n=2, tile_p=2, unroll=2)
    if SIMULATOR
    else SplitShrink(threads=64, tile_n=4, tile_p=2, unroll=2)
)
COLUMNS_EXPAND = (
    ColumnsExpand(threads=2, vec=2, tile_p=2, values=64)
    if SIMULATOR
    else ColumnsExpand(threads=128, vec=4, tile_p=2, values=64)
)


class MmaShrink(NamedTuple):
    """Version 4's and 5's shrink (:mod:`..kernels.moe_shrink_mma`): threads per CUDA block
    (whole warps, which split K), the 16-pair tiles of one pass (at most; fewer where the
    block size needs fewer) and the 8-rank tiles of one rank group (likewise, for the
    rank)."""

    threads: int
    m_tiles: int
    n_tiles: int


class MmaExpand(NamedTuple):
    """Version 4's expand (:mod:`..kernels.moe_expand_mma`): threads per CUDA block (whole
    warps, each with columns of its own), the 16-pair tiles of one pass and the 8-column
    tiles of a warp (each at most, as for :class:`MmaShrink`)."""

    threads: int
    m_tiles: int
    n_tiles: int


#: Version 4's compile-time parameters, in one place. On the simulator, where every CUDA
#: thread is a Python thread and a warp is 32 of them, the fewest warps and tiles that
#: still cross the kernels' tiles at test sizes (two warps' partial sums, rank groups,
#: column groups, passes of one tile and of two). The GPU's are a first guess for
#: Qwen3-30B-A3B's layer (r=16: one rank group; blocks of 16 pairs: one pass), not yet
#: timed.
MMA_SHRINK = (
    MmaShrink(threads=64, m_tiles=1, n_tiles=1)
    if SIMULATOR
    else MmaShrink(threads=128, m_tiles=1, n_tiles=2)
)
MMA_EXPAND = (
    MmaExpand(threads=32, m_tiles=2, n_tiles=1)
    if SIMULATOR
    else MmaExpand(threads=128, m_tiles=1, n_tiles=4)
)


class OuterExpand(NamedTuple):
    """Version 6's expand (:mod:`..kernels.moe_expand_outer`): the most threads a CUDA
    block takes (fewer where a slice needs fewer: whole warps of ``vec`` columns each), the
    neighbouring columns a thread owns, the most pairs it takes at once (fewer where the
    block size is smaller, or where it would hold too much: :func:`outer_shape`), and
    ``values``, the 32-bit registers a thread may hold across the sums."""

    threads: int
    vec: int
    chunk: int
    values: int


#: Version 6's parameters. On the simulator few threads, of the 4 columns that fill one
#: word, and chunks of 4 pairs (so that blocks of several chunks and slices of several
#: column groups occur at test sizes). The GPU's fill an 8-byte word of 16-bit outputs a
#: pair (4 columns: a warp's load of a pair is 256 neighbouring bytes) and take a block of
#: 16 pairs at once; a first design, to be measured.
OUTER_EXPAND = (
    OuterExpand(threads=4, vec=4, chunk=4, values=160)
    if SIMULATOR
    else OuterExpand(threads=256, vec=4, chunk=16, values=160)
)


#: Version 6 takes its expand from this many pairs a block in use on average
#: (:func:`pairs_per_block`), version 3's below it (as version 5 chooses its shrink).
#: Kernel by kernel on an H200 at 3fad2cc (``probes/moe_version_6.py --kernels``,
#: docs/benchmarks/h200_moe_v6_kernels.json; Qwen3-30B-A3B's layer, r=16, bf16, blocks of
#: 16): at 1 pair a block the outer-product expand took 1.07-2.66x version 3's time, at 4
#: 1.39-1.69x, at 8 0.94x (w13) and 1.13x (w2), at 32 0.79x and 0.93x; at 16 and 128 (one
#: adapter) version 6 as a whole was faster (h200_moe_v6.json). 16: the first measured
#: point past the crossing.
OUTER_EXPAND_FROM_PAIRS = 16

#: Whether version 6's split shrink runs on a compact grid (:func:`compact_units`), or on
#: version 5's grid of every slot's bound, its idle CUDA blocks leaving at once. On the
#: same H200 run the compact grid was slower on 12 of the 14 cases that took the split
#: shrink (by 0.2-0.8 µs at 1 token, and at 16 on one adapter; by 13-30 µs at 256 tokens over
#: 16 adapters: its CUDA blocks, short-lived, each walk the slots twice), and faster only at
#: 16 tokens over 16 adapters (13.3 against 21.2 µs, w13; 7.8 against 10.9, w2).
COMPACT_SPLIT_SHRINK = False


#: The most fp32 buffer values version 6's expand stages in shared memory for a chunk
#: (``rank * chunk``; 16 KB, two CUDA blocks an SM in 32 KB).
STAGED_VALUES = 4096


def outer_shape(
    rank: int, width: int, block_size: int, config: OuterExpand = OUTER_EXPAND
) -> tuple[int, int]:
    """``(threads, chunk)`` of version 6's expand for a slice of ``width`` columns at
    ``rank`` and ``block_size``: enough threads of ``config.vec`` columns for the slice
    (whole warps on a GPU) up to ``config.threads``; and ``config.chunk`` pairs at once,
    no more than a block holds, halved (to 1 at the least) while the thread's sums and its
    old outputs (two to a register) come to more than ``config.values`` registers, or the
    chunk's buffer rows to more than :data:`STAGED_VALUES`.

    The rank costs no registers: the loop over it is not unrolled, so the thread's words of
    B sit in local memory (``moe_expand_outer``'s notes). Read for sm_90 (ptxas 13.0,
    ``probes/moe_static.py``): at r=64 a chunk of 16 takes 163 registers (w13, 192 threads)
    and 127 (w2, 256), no spills, where a rule that counted B's words as registers had
    chosen chunks of 4, of 53-61 registers and four waits a block instead of one."""
    unit = 1 if SIMULATOR else 32
    needed = -(-width // config.vec)  # threads of vec columns that cover the slice
    threads = min(config.threads, -(-needed // unit) * unit)
    chunk = min(config.chunk, 1 << max(0, (block_size - 1).bit_length()))
    while chunk > 1 and (
        chunk * config.vec * 3 // 2 > config.values or rank * chunk > STAGED_VALUES
    ):
        chunk //= 2
    return threads, chunk


#: Version 6's tensor-core shrink: the most 16-pair tiles of a pass and 8-rank tiles of a
#: group (the launcher takes fewer where the call needs fewer: :func:`mma_shrink_runs`). On
#: the simulator tiles that two slices and runs of two blocks cross at test sizes. The GPU's
#: are a first design for Qwen3-30B-A3B's layer (w13: both slices' 16 ranks in four tiles;
#: runs of up to two blocks of 16 pairs): with runs of four, ptxas 13.0 for sm_90 spills
#: (255 registers, 24 bytes of spill stores), with two it does not (176; 254 with the next
#: chunk loaded ahead, :data:`MMA_SHRINK_AHEAD`). On an H200 at 4d1a875 runs of one and of
#: four came within 5 % of it where version 6 won (h200_moe_v6_variants.json).
MMA_SHRINK_RUNS = (
    MmaShrink(threads=64, m_tiles=2, n_tiles=2)
    if SIMULATOR
    else MmaShrink(threads=128, m_tiles=2, n_tiles=4)
)


#: Whether version 6's tensor-core shrink loads a warp's next chunk before it multiplies
#: this one (``moe_shrink_mma``'s notes, "Ahead"). For sm_90 it takes the shipped w13
#: build from 176 registers to 254, no spills, and keeps two CUDA blocks an SM; on an H200
#: at 4d1a875 the op took 165 µs with it and 202 without (w13, 2048 tokens on one adapter;
#: h200_moe_v6_variants.json).
MMA_SHRINK_AHEAD = True

#: Whether version 6's tensor-core shrink takes every slice's ranks in one CUDA block
#: where there are two (w13: each pair's row of x read once, not once a slice), or each
#: slice in blocks of its own, as version 5's does. On an H200 at dbb188e
#: (``probes/moe_version_6.py --kernels``, docs/benchmarks/h200_moe_v6_shrink_grid.json; 9
#: cases of 4 to 128 pairs a block) apart took 70.5 µs against 74.0 at 2048 tokens on 4
#: adapters, and within 0.8 µs of together on the other four w13 cases (less on two). Kept
#: together until the op is timed as a whole both ways.
MMA_SHRINK_JOINT = True

#: Whether version 6's tensor-core shrink runs on a compact grid where each of its units is
#: one block (runs of several blocks always take one), or on version 5's grid of every
#: slot's bound, its idle CUDA blocks leaving at once. The compact grid's CUDA blocks walk
#: the slots to find their units, a cost that grows with the slots (as the split shrink's
#: did: ``COMPACT_SPLIT_SHRINK``). On the same H200 run, where units are single blocks,
#: version 5's grid took 131.9 µs against 143.5 (w13) and 34.9 against 47.9 (w2) at 2048
#: tokens over 16 adapters (8 pairs a block), 14.3 against 14.9 and 16.2 against 16.7 on
#: w13's one adapter (64 and 256 tokens), 32.4 against 34.9 at 256 over 4, and 0.01-0.3 µs
#: more on w2's other two such cases.
COMPACT_SINGLE_BLOCK_MMA_SHRINK = False


def mma_shrink_runs(
    num_pairs: int,
    slots: int,
    experts: int,
    block_size: int,
    slices: int,
    rank: int,
    config: MmaShrink = MMA_SHRINK_RUNS,
) -> tuple[int, int, int, bool]:
    """``(m_tiles, n_tiles, blocks, joint)`` of version 6's tensor-core shrink: every
    slice's ranks in one CUDA block where there are two (``joint``: each pair's row of x
    read once, not once a slice), in up to ``config.n_tiles`` tiles of 8; and, where the
    call's pairs average enough a (slot, expert) (:func:`pairs_per_block`) to fill them,
    ``blocks`` neighbouring blocks a unit of its compact grid (a power of two), taken in
    passes of up to ``config.m_tiles`` tiles of 16 pairs, so that a chunk of A is read once
    for a run of blocks of one expert, not once a block."""
    joint = slices > 1 and MMA_SHRINK_JOINT
    n_tiles = min(config.n_tiles, -(-(slices * rank if joint else rank) // 8))
    average = pairs_per_block(num_pairs, slots, experts)
    blocks = 1
    while 2 * blocks * block_size <= min(16 * config.m_tiles, average):
        blocks *= 2
    m_tiles = min(config.m_tiles, -(-(blocks * block_size) // 16))
    return m_tiles, n_tiles, blocks, joint


def tensor_core_words(x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor]):
    """Version 4's gate: ``(x, a, b)`` as int64 words of four elements when the tensor
    cores can take them, else None (and the call runs version 3's kernels).

    They can when x, A and B are bf16 or fp16 (fp32 has no exact 16-bit form: the
    products would lose bits), and every row of each is whole, aligned 8-byte words
    (:func:`.operands.words`): K and the rank multiples of 4, as every real layer's are.
    A lane's fragment register is two neighbouring elements, and it reads four at a time
    straight from memory. The rank need not be a multiple of 8 or 16, nor K of 16: the
    tiles past them are zeros (or, for the shrink's ranks, never stored).
    """
    if x.dtype not in MMA_DTYPES:
        return None
    x_words, a_words, b_words = words(x), [words(w) for w in a], [words(w) for w in b]
    if x_words is None or any(w is None for w in (*a_words, *b_words)):
        return None
    return x_words, a_words, b_words


def pairs_per_block(num_pairs: int, slots: int, experts: int) -> float:
    """Version 5's measure of how full the call's blocks are, from shapes alone (reading
    the metadata's values would need a sync, and the op must stay capturable in a CUDA
    graph): ``num_pairs / min(num_pairs, slots * experts)``, the P pairs spread evenly
    over the (slot, expert) blocks, of which at most P are in use (``slots`` is L of the
    stacks, ``experts`` E; ``num_pairs`` > 0).

    A (slot, expert) here is all its pairs, which the align step cuts into blocks of
    ``block_size``: 2048 tokens of top-8 on one adapter of 128 experts give 128 pairs a
    block here, full blocks of 16 in the kernels. It counts every slot and every pair,
    used or not, so idle slots and tokens without an adapter make it understate the
    average (the split shrink is then taken where the tensor cores might still pay).
    """
    return num_pairs / min(num_pairs, slots * experts)


def columns_shape(rank: int, config: ColumnsExpand = COLUMNS_EXPAND) -> tuple[int, int]:
    """``(vec, tile_p)`` of version 3's expand at ``rank``: ``config``'s, lowered until a
    thread's rows of B (``vec * rank`` fp32) and its chunk's buffer rows (``tile_p *
    rank``) each fit ``config.values`` (at least 1 each: a larger rank spills)."""
    fit = max(1, config.values // rank)
    return min(config.vec, fit), min(config.tile_p, fit)


class FusedPairs(NamedTuple):
    """Version 11's kernel (:mod:`..kernels.moe_fused`): threads per CUDA block (whole
    teams of warps), the ranks and pairs of one step of a team's sums, the strides of K
    whose loads go out together, the warps of a team (which split K), the columns a thread
    owns, lowered (to 1 at the least) until they hold at most ``values`` values of B in
    registers (:func:`fused_vec`), and ``full_grid_blocks``: a CUDA block for every block
    of every row where that grid has at most this many CUDA blocks (None: as many as the
    GPU has SMs), else the compact grid, whose blocks find theirs by a walk over the slots
    (0: always compact)."""

    threads: int
    tile_n: int
    tile_p: int
    unroll: int
    splits: int
    vec: int
    values: int
    full_grid_blocks: int | None


#: Version 11's compile-time parameters. On the simulator four warps of four lanes in teams
#: of two, one column a thread and steps of 3 ranks (no divisor of a rank in words), so
#: that K splits, rank steps, chunks of pairs and column groups are crossed at test sizes,
#: on the compact grid (each idle CUDA block of the other is Python threads there). On the
#: GPU four warps of 4 ranks each (r=16 in one step), loads of four strides of K at once, 4
#: columns a thread as version 3's expand, and the grid of every block where it fits the
#: SMs. On an H100 at d34f9df (``probes/moe_fused_ab.py``,
#: docs/benchmarks/h100_moe_fused_ab_d34f9df.json; Qwen3-30B-A3B's layer, r=16, 1 and 16
#: tokens over 1, 4 and 16 adapters) loads of four strides on the grid of every block took
#: 0.93x version 9's time in geometric mean over the 12 calls (two strides: 1.01x; teams of
#: two or four warps splitting K: 0.94-1.15x; 8 warps: 1.05-1.10x). The grid of every block
#: won on one and four adapters and lost on 16, where most of its rows are idle: at 3a2ac41
#: (h100_moe_fused_ab_3a2ac41.json) one token over 16 adapters (16 rows of 8 blocks, 4 CUDA
#: blocks each: 512, 480 of them idle, more than the SMs hold at once, so the blocks in use
#: wait for a second wave) took 11.36 µs at w13 against 9.90 on the compact grid.
FUSED_PAIRS = (
    FusedPairs(16, tile_n=3, tile_p=2, unroll=1, splits=2, vec=1, values=64, full_grid_blocks=0)
    if SIMULATOR
    else FusedPairs(
        128, tile_n=4, tile_p=2, unroll=4, splits=1, vec=4, values=64, full_grid_blocks=None
    )  # fmt: skip
)

#: Version 16's one launch past :data:`ONE_LAUNCH_TO_PAIRS` (:func:`fused_config`): 8 columns a
#: thread (a slice in half as many column groups, each of which shrinks the block's pairs
#: again), up to 128 values of B in registers. For sm_90 (ptxas 13.0, r=16,
#: docs/benchmarks/sm90_moe_v16_builds_b2f5a30.json: the four builds ``bench --moe``'s cases
#: launch) 203-206 registers and 80-96 bytes of stack frame, no spills, two CUDA blocks of 128
#: threads an SM (the builds of 4 columns: 147-176, three or two). On the simulator 2 columns, so
#: that it is a build of its own at test sizes.
FUSED_PAIRS_SPARSE = (
    FUSED_PAIRS._replace(vec=2) if SIMULATOR else FUSED_PAIRS._replace(vec=8, values=128)
)

#: Version 11 takes its one launch for calls of at most this many pairs (tokens x top_k),
#: version 9's kernels for larger ones. On the H100 at d34f9df (above), with loads of four
#: strides on the grid of every block, it took 0.66-0.88x version 9's time at one token of
#: top-8 (8 pairs) on one and four adapters, and 0.86-1.19x at 16 tokens (128 pairs), slower
#: on 4 of the 6; between the two nothing was measured.
FUSED_TO_PAIRS = 8

#: Version 13 takes the one launch for calls of at most this many pairs (8 tokens of top-8),
#: version 12's kernels (the pairs path, at these sizes) for larger ones. On an H100 at
#: dfa2c7a (``probes/moe_fused_ab.py --tokens``,
#: docs/benchmarks/h100_moe_fused_tokens_dfa2c7a.json:
#: ``bench --moe``'s layer, both projections, 2 to 16 tokens over 1, 4 and 16 adapters, r=16,
#: the one launch forced past :data:`FUSED_TO_PAIRS`) it took 0.62-0.99x version 9's time on
#: all 18 calls of 2, 4 and 8 tokens (16-64 pairs), and 0.87-1.23x at 10 tokens, 0.86-1.20x
#: at 12, 0.93-1.32x at 16, slower on 13 of those 18 (why was not profiled). Between 8 and 10
#: tokens nothing was measured. Version 9's side is version 12's kernels at these sizes (the
#: pairs path: fewer than 4 pairs a (slot, expert)).
ONE_LAUNCH_TO_PAIRS = 64


#: Version 16 takes the one launch past :data:`ONE_LAUNCH_TO_PAIRS` up to this many pairs (16
#: tokens of top-8) where the call's (slot, expert)s are at least :data:`SPARSE_SLOTS_A_PAIR`
#: times its pairs, with :data:`FUSED_PAIRS_SPARSE`'s 8 columns a thread. On an H100 at
#: 31898a8 (``probes/moe_fused_ab.py --against 14``,
#: docs/benchmarks/h100_moe_fused_v8_against_14_31898a8.json; ``bench --moe``'s layer, r=16,
#: one round) that build took 0.82-0.97x version 14's time (the pairs path) on 11 of the 12
#: calls of 10, 12 and 16 tokens over 4 and 16 adapters (1.04x at w13's 16 tokens over 4),
#: and 0.97-1.20x over one adapter. As version 16, on an H100 at 2c4bce5 (``bench --moe`` of
#: versions 16, two rounds, and 14, one, in one call; h100_moe_v16_2c4bce5_1.json, _2.json,
#: h100_moe_v14_2c4bce5.json), it took 0.88x, 0.92x and 0.98x version 14's time on three of
#: the four calls of the benchmark it changes (w2's 16 tokens over 4 adapters, w13's over 16,
#: w2's over 16) and 1.05x on the fourth (w13's over 4, the loss of 31898a8 again); it became
#: the default. Past 16 tokens the same build lost on all 18 calls of 32, 64 and 256 tokens
#: over 1, 4 and 16 adapters, 1.05-3.27x version 14's time
#: (h100_moe_one_launch_past_16_2c4bce5.json), so the one launch stops at 128 pairs.
SPARSE_ONE_LAUNCH_TO_PAIRS = 128

#: The (slot, expert)s a pair that version 16's sparse one launch asks of a call: over 4 and
#: 16 adapters of 128 experts (the calls it won, 4-26 a pair at 10-16 tokens) they are many
#: times the pairs, over one (where it lost: 1-1.6) about as many. 2 is a point between,
#: not a measured crossing.
SPARSE_SLOTS_A_PAIR = 2


def one_launch_to_pairs(version: int = DEFAULT_VERSION) -> int:
    """The most pairs of a call that ``version`` (11 and later) takes in one launch whatever
    its adapters: :data:`ONE_LAUNCH_TO_PAIRS` from version 13, else :data:`FUSED_TO_PAIRS`
    (from version 16 more where they are sparse: :func:`fused_config`)."""
    return ONE_LAUNCH_TO_PAIRS if version >= 13 else FUSED_TO_PAIRS


def fused_config(
    num_pairs: int, slots: int, experts: int, version: int = DEFAULT_VERSION
) -> FusedPairs | None:
    """The configuration of version 11's one launch that ``version`` takes for a call of
    ``num_pairs`` pairs over ``slots`` adapters of ``experts`` experts (L and E of the
    stacks), or None where it launches other kernels, from the shapes alone:
    :data:`FUSED_PAIRS` from version 11 up to :func:`one_launch_to_pairs`; from version 16
    :data:`FUSED_PAIRS_SPARSE` past it up to :data:`SPARSE_ONE_LAUNCH_TO_PAIRS` where ``slots
    * experts >= SPARSE_SLOTS_A_PAIR * num_pairs``.

    ``slots`` is L of the stacks, as in :func:`pairs_per_block`: the adapters a batch uses are
    known only on the device. So a stack of more slots than the batch's adapters (vLLM's
    ``max_loras`` above them) counts its idle slots too, and takes the sparse one launch where
    the adapters in use are few: over one adapter its build took 0.97-1.20x the pairs path's
    time at 10-16 tokens (:data:`SPARSE_ONE_LAUNCH_TO_PAIRS`' notes)."""
    if version < 11:
        return None
    if num_pairs <= one_launch_to_pairs(version):
        return FUSED_PAIRS
    sparse = slots * experts >= SPARSE_SLOTS_A_PAIR * num_pairs
    if version >= 16 and num_pairs <= SPARSE_ONE_LAUNCH_TO_PAIRS and sparse:
        return FUSED_PAIRS_SPARSE
    return None


def one_launch(
    num_pairs: int, version: int = DEFAULT_VERSION, slots: int = 0, experts: int = 0
) -> bool:
    """Whether ``version`` takes a call of ``num_pairs`` pairs in version 11's one launch
    (:func:`fused_config`; ``slots`` and ``experts`` 0 where not known: then only up to
    :func:`one_launch_to_pairs`), from the shapes alone."""
    return fused_config(num_pairs, slots, experts, version) is not None


def pairs_table(version: int = DEFAULT_VERSION):
    """The function that makes the pairs path's table of one-token tiles at ``version`` (9
    and later): :func:`.moe_dense.claimed_pairs` (runs of entries claim their rows) from
    version 14, else :func:`.moe_dense.moe_pairs` (one CUDA block's running sum). Both take
    the metadata, the block size, P and E.

    On an H100 at 5d9b04e (``probes/moe_pairs_steps.py``,
    docs/benchmarks/h100_moe_pairs_steps_5d9b04e.json: the pairs path's 18 calls of
    ``bench --moe``'s layer, each step on the benchmark's pool) the claimed table took 3.4-9.6
    µs where the running sum took 3.7-27.2 (27.2 -> 5.8 at w13's 256 tokens over 16 adapters),
    and the row shrink after it the same time (86.9 against 87.1 µs there: the runs keep a
    (slot, expert)'s pairs together for the L2). ``bench --moe`` of versions 14 and 13 in one
    call (h100_moe_v14_5d9b04e.json, h100_moe_v13_5d9b04e.json): 0.77-0.98x version 13's
    time on the 12 cases of the pairs path; on the 18 others, which launch the same kernels
    in both, 0.99-1.02x but for w2 at one token over 16 adapters (0.91x: the same one launch,
    so the spread of a run)."""
    return claimed_pairs if version >= 14 else moe_pairs


def fused_vec(rank: int, config: FusedPairs = FUSED_PAIRS) -> int:
    """The columns a thread of version 11 owns at ``rank``: ``config.vec``, lowered until
    their rows of B (``vec * rank`` values) fit ``config.values`` (at least 1)."""
    return max(1, min(config.vec, config.values // max(rank, 1)))


@torch.no_grad()
def fused_moe_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Sequence[torch.Tensor],
    lora_b_stacked: Sequence[torch.Tensor],
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    adapter_enabled: torch.Tensor,
    *,
    block_size: int,
    mul_routed_weight: bool = False,
    offset: int = 0,
    add_inputs: bool = True,
    version: int = DEFAULT_VERSION,
) -> None:
    """``y[t, k, slice s] += w * (row @ A_s[l, e]^T) @ B_s[l, e]^T`` for every pair in a block.

    Those of ``reference.fused_moe_lora``, on the pairs of the blocks (P = M * top_k).

    Semantics:
        y: [M, top_k, >= offset + S * N], contiguous, modified in place
        x: [M, K] (rows per token) or, with mul_routed_weight, [P, K] (rows per pair)
        lora_a_stacked[s]: [L, E, r, K]; lora_b_stacked[s]: [L, E, N, r]; S in {1, 2}
        topk_weights: [M, top_k] (w = topk_weights[t, k] with mul_routed_weight, else 1)
        sorted_token_ids: [L, EM]; expert_ids: [L, NB], NB = ceil(EM / block_size);
        num_tokens_post_padded: [L]; adapter_enabled: [>= L] (0: the slot is skipped)
        blocks in use: b < num_tokens_post_padded[l] / block_size, e = expert_ids[l, b] in [0, E)
        for each pair p = t * top_k + k < P of such a block of row l:
            y[t, k, offset + s*N : offset + (s+1)*N] = (y[...] if add_inputs else 0)
                                                       + w * (row(p) @ A_s[l, e].T) @ B_s[l, e].T
        In fp32; the shrink's product is kept in fp32 (vLLM rounds it to y's dtype). Pairs
        in no block are untouched.

    ``version`` picks the kernels: 1, a thread per output (:mod:`..kernels.moe_shrink`,
    :mod:`..kernels.moe_expand`); 2, the shrink in shared-memory tiles of the block's
    pairs and A (:mod:`..kernels.moe_shrink_tiled`), where a block holds at most its
    ``MAX_PAIRS`` pairs and the rank is at most its ``MAX_RANK`` (else 1's), with 1's
    expand; 3, the shrink with K split across a CUDA block's threads
    (:mod:`..kernels.moe_shrink_split`) and the expand with each thread's columns of B
    in registers (:mod:`..kernels.moe_expand_columns`); 4, both on the tensor cores
    (:mod:`..kernels.moe_shrink_mma`, :mod:`..kernels.moe_expand_mma`: exact products of
    16-bit x and A, the fp32 buffer split into two bf16 for the expand), where
    :func:`tensor_core_words` says the operands allow it (bf16 or fp16, K and the rank
    multiples of 4), else 3's; 5, 4's shrink where the operands allow it and the pairs
    average at least :data:`MMA_SHRINK_FROM_PAIRS` (4) a (slot, expert) block in use
    (:func:`pairs_per_block`, from P, L and E: no sync), else 3's, and 3's expand always
    (on an H200 each kernel so taken was the faster of the two where it was measured); 6,
    5's choice, with the tensor-core shrink taking every slice in one CUDA block and runs
    of blocks of one expert together, the expand taking a chunk of a block's pairs at once
    as outer products (:mod:`..kernels.moe_expand_outer`) where the pairs average at least
    :data:`OUTER_EXPAND_FROM_PAIRS` (16) a block, else 3's; that expand and the shrink's
    runs of blocks on compact grids, its single blocks and the split shrink on 5's unless
    :data:`COMPACT_SINGLE_BLOCK_MMA_SHRINK`, :data:`COMPACT_SPLIT_SHRINK` (the same bits as
    5's shrinks and 3's expand); 7, the dense op's tensor-core shrink and expand on the
    blocks' pairs (:mod:`.moe_dense`), the router's weights multiplied into the buffer
    before the expand, else 6's kernels; 8, 7's where the pairs average at least
    :data:`DENSE_FROM_PAIRS` (16, a tile of the dense op) a (slot, expert), else 6's; 9,
    8's, but below :data:`MMA_SHRINK_FROM_PAIRS` (4) the dense op's row kernels of
    one-token tiles on the pairs (:func:`.moe_dense.moe_pairs`), the router's weights in the
    stores of the row shrink or of 7's dense shrink; 11, 9's, but for calls of at most
    :data:`FUSED_TO_PAIRS` (8) pairs one launch, each block's pairs shrunk and expanded by
    one CUDA block (:mod:`..kernels.moe_fused`); 12, 11's, but 7's tiles from
    :data:`TILES_FROM_PAIRS` (4); 13, 12's, but the one launch up to
    :data:`ONE_LAUNCH_TO_PAIRS` (64) pairs; 14, 13's, but the pairs' table claimed by runs
    of the entries (:func:`.moe_dense.claimed_pairs`); 16, 14's, but the one launch past
    :data:`ONE_LAUNCH_TO_PAIRS` up to :data:`SPARSE_ONE_LAUNCH_TO_PAIRS` (128) pairs where the
    (slot, expert)s are at least :data:`SPARSE_SLOTS_A_PAIR` (2) times the pairs, with 8
    columns a thread (:func:`fused_config`). The same sums in other orders;
    :data:`DEFAULT_VERSION` (16) unless asked.

    Raises:
        TypeError / ValueError: a wrong dtype, shape, layout, device or size, before any
            launch.
    """
    block_size = check_int("block_size", block_size, minimum=1)
    mul_routed_weight = check_bool("mul_routed_weight", mul_routed_weight)
    add_inputs = check_bool("add_inputs", add_inputs)
    offset = check_int("offset", offset, minimum=0)
    if check_int("version", version) not in VERSIONS:
        raise ValueError(f"version must be one of {VERSIONS}, got {version}")
    check_tensor("y", y, ndim=3, dtypes=KERNEL_DTYPES, contiguous=True)
    num_tokens, top_k, columns = y.shape
    num_pairs = num_tokens * top_k
    device = y.device
    a = _stacks("lora_a_stacked", lora_a_stacked, device)
    b = _stacks("lora_b_stacked", lora_b_stacked, device)
    if len(a) != len(b):
        raise ValueError(
            f"lora_a_stacked and lora_b_stacked must have one entry per slice; got {len(a)} "
            f"and {len(b)}"
        )
    L, E, rank, hidden = a[0].shape
    width = b[0].shape[2]
    for name, stacks, shape in (
        ("lora_a_stacked", a, (L, E, rank, hidden)),
        ("lora_b_stacked", b, (L, E, width, rank)),
    ):
        for s, w in enumerate(stacks):
            if tuple(w.shape) != shape or w.dtype != a[0].dtype:
                raise ValueError(
                    f"{name}[{s}] is {tuple(w.shape)} {w.dtype}; every slice must be "
                    f"{shape} {a[0].dtype} (lora_a_stacked[0] is [L, E, r, K])"
                )
    check_tensor("x", x, ndim=2, dtypes=(a[0].dtype,), contiguous=True)
    _same_device("x", x, device)
    rows = num_pairs if mul_routed_weight else num_tokens
    if tuple(x.shape) != (rows, hidden):
        per = "pair (mul_routed_weight)" if mul_routed_weight else "token"
        raise ValueError(f"x must be [{rows}, {hidden}] (a row per {per}), got {tuple(x.shape)}")
    if columns < offset + len(b) * width:
        raise ValueError(
            f"y has {columns} columns, too few for offset={offset} plus {len(b)} slice(s) of "
            f"{width}"
        )
    check_tensor("topk_weights", topk_weights, ndim=2)
    _same_device("topk_weights", topk_weights, device)
    if not topk_weights.is_floating_point() or tuple(topk_weights.shape) != (num_tokens, top_k):
        raise ValueError(
            f"topk_weights must be floating [{num_tokens}, {top_k}] (y's tokens and top_k), got "
            f"{topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    for name, t, ndim in (
        ("sorted_token_ids", sorted_token_ids, 2),
        ("expert_ids", expert_ids, 2),
        ("num_tokens_post_padded", num_tokens_post_padded, 1),
    ):
        check_tensor(name, t, ndim=ndim, dtypes=_INDEX_DTYPES, contiguous=True)
        _same_device(name, t, device)
        if t.shape[0] != L:
            raise ValueError(f"{name} must have a row per slot ({L}), got {tuple(t.shape)}")
    blocks = -(-sorted_token_ids.shape[1] // block_size)
    if expert_ids.shape[1] != blocks:
        raise ValueError(
            f"expert_ids has {expert_ids.shape[1]} blocks a row, but sorted_token_ids' "
            f"{sorted_token_ids.shape[1]} entries make {blocks} blocks of block_size={block_size}"
        )
    check_adapter_enabled(adapter_enabled, L, device, dtypes=_INDEX_DTYPES, beside="y")
    if num_pairs == 0 or rank == 0 or width == 0:
        return

    weights = topk_weights.reshape(-1).to(torch.float32)  # [P]
    metadata = (sorted_token_ids, expert_ids, num_tokens_post_padded, adapter_enabled)
    out = y.view(num_pairs, columns)  # [P, W]
    config = fused_config(num_pairs, L, E, version)
    if config is not None:  # the one launch: its buffer is shared memory, none made here
        _fused_pairs(out, x, a, b, weights, metadata, top_k, block_size,
                     mul_routed_weight, offset, add_inputs, config)  # fmt: skip
        return
    buffer = torch.empty(len(a), num_pairs, rank, dtype=torch.float32, device=device)
    grid = (expert_ids.shape[1], L, len(a))
    if version >= 3:
        # The tensor-core shrink: version 4's, and 5's where its blocks are full enough.
        average = pairs_per_block(num_pairs, L, E)  # (versions 5 to 9 choose by it)
        mma = version == 4 or (version >= 5 and average >= MMA_SHRINK_FROM_PAIRS)
        shrink = _Shrink(buffer, metadata, top_k, block_size, mul_routed_weight)
        sixth = version >= 6  # (7 to 9 take 6's kernels where the dense op's do not run)
        dense_op = version == 7 or (version >= 8 and average >= tiles_from_pairs(version))
        x_rows = 1 if mul_routed_weight else top_k  # (w2: a row of x a pair)
        # (9: the router's weights multiplied in as a dense-op shrink stores, no launch)
        routed = weights if version >= 9 and mul_routed_weight else None
        if version >= 9 and not mma:  # the dense op's row kernels, a pair a tile
            pairs = pairs_table(version)(*metadata, block_size, num_pairs, E)
            row_shrink(buffer, x, a, pairs, x_rows, average, routed)
            row_expand(out, buffer, b, pairs, offset, add_inputs, average)
            return
        tiles = moe_tiles(*metadata, block_size, num_pairs, E) if dense_op else None
        dense = tiles is not None and dense_shrink(buffer, x, a, tiles, x_rows, average, routed)
        tensor_cores = tensor_core_words(x, a, b) if mma and not dense else None
        if not dense and tensor_cores is not None:
            _mma_shrink(shrink, *tensor_cores[:2], hidden=hidden, dtype=x.dtype, runs=sixth)
        elif not dense:
            _split_shrink(shrink, x, a, compact=sixth and COMPACT_SPLIT_SHRINK)
        if tiles is not None:  # the router's weights (where no shrink took them), the expand
            if mul_routed_weight and not (dense and routed is not None):
                buffer.mul_(weights.view(1, num_pairs, 1))
            if dense_expand(out, buffer, b, tiles, offset, add_inputs, average):
                return
            mul_routed_weight = False  # (in the buffer already, for the expand below)
        call = _Expand(
            out, buffer, weights, metadata, block_size, mul_routed_weight, offset, add_inputs
        )
        if version == 4 and tensor_cores is not None:
            _mma_expand(call, tensor_cores[2], x.dtype)
        elif sixth and average >= OUTER_EXPAND_FROM_PAIRS:
            _outer_expand(call, b)
        else:
            _columns_expand(call, b)
        return
    w0, w1 = a[0], a[-1]  # (one slice: the same weight twice, never read twice)
    tiled = version == 2 and block_size <= tiled_shrink.MAX_PAIRS and rank <= tiled_shrink.MAX_RANK
    build = tiled_shrink.build_moe_tiled_shrink_kernel if tiled else build_moe_shrink_kernel
    shrink = launcher_of(build(x.dtype, a[0].dtype, THREADS))
    shrink(grid, THREADS, (x, w0, w1, buffer, *metadata, top_k, block_size, mul_routed_weight))
    expand = launcher_of(build_moe_expand_kernel(torch.float32, b[0].dtype, y.dtype, THREADS))
    expand(
        grid,
        THREADS,
        (
            buffer,
            b[0],
            b[-1],
            out,
            weights,
            *metadata,
            block_size,
            offset,
            mul_routed_weight,
            add_inputs,
        ),
    )


class _Shrink(NamedTuple):
    """What either shrink of one call takes beside x and A, checked: ``buffer`` [S, P, r]
    fp32 (the layout either expand reads), the four metadata tensors, and the call's
    options."""

    buffer: torch.Tensor
    metadata: tuple
    top_k: int
    block_size: int
    by_pair: bool


def _split_shrink(
    call: _Shrink, x: torch.Tensor, a: list[torch.Tensor], compact: bool = False
) -> None:
    """Version 3's shrink (and 5's and 6's below :data:`MMA_SHRINK_FROM_PAIRS`): x and A go
    as packed int64 words where every one of them allows it (:func:`.operands.words`); on
    a compact grid with ``compact`` (version 6)."""
    buffer, metadata, top_k, block_size, by_pair = call
    blocks, slots = metadata[1].shape[1], metadata[1].shape[0]
    slices, rank = len(a), a[0].shape[2]
    config, dtype = SPLIT_SHRINK, a[0].dtype
    (x, *a), packed = _as_words([x, *a])
    walk = (slots_at_once(slots),) if compact else ()  # (a compact grid's walk)
    shrink = launcher_of(
        split_shrink.build_moe_split_shrink_kernel(dtype, *config, packed, compact, *walk)
    )
    rank_groups = -(-rank // config.tile_n)
    if compact:
        grid = (compact_units(buffer.shape[1], metadata, a[0].shape[1], block_size, 1), 1)
    else:
        grid = (blocks, slots)
    shrink(
        (*grid, slices * rank_groups),
        config.threads,
        (x, a[0], a[-1], buffer, *metadata, top_k, block_size, by_pair),
    )


class _Expand(NamedTuple):
    """What either expand of one call takes beside B, checked: ``out`` [P, W] (y's rows of
    pairs), ``buffer`` [S, P, r] fp32 as either shrink leaves it, ``weights`` [P] fp32,
    the four metadata tensors, and the call's options."""

    out: torch.Tensor
    buffer: torch.Tensor
    weights: torch.Tensor
    metadata: tuple
    block_size: int
    by_pair: bool
    offset: int
    add_inputs: bool


def _columns_expand(call: _Expand, b: list[torch.Tensor]) -> None:
    """Version 3's expand (and 5's): B goes as packed int64 words where every slice allows
    it (:func:`.operands.words`)."""
    out, buffer, weights, metadata, block_size, by_pair, offset, add_inputs = call
    blocks, slots = metadata[1].shape[1], metadata[1].shape[0]
    slices, width, rank = len(b), b[0].shape[2], b[0].shape[3]
    config = COLUMNS_EXPAND
    vec, tile_p = columns_shape(rank, config)
    kernel_b, packed_b = _as_words(b)
    wide = rows_start_at(buffer, 16)  # every buffer row at 16 bytes
    shape = (config.threads, vec, tile_p, rank)
    options = (packed_b, wide, by_pair, add_inputs)
    expand = launcher_of(
        columns_expand.build_moe_columns_expand_kernel(b[0].dtype, out.dtype, *shape, *options)
    )
    column_groups = -(-width // (config.threads * vec))
    expand(
        (blocks, slots, slices * column_groups),
        config.threads,
        (buffer, kernel_b[0], kernel_b[-1], out, weights, *metadata, block_size, offset),
    )


def _fused_pairs(
    out: torch.Tensor,
    x: torch.Tensor,
    a: list[torch.Tensor],
    b: list[torch.Tensor],
    weights: torch.Tensor,
    metadata: tuple,
    top_k: int,
    block_size: int,
    by_pair: bool,
    offset: int,
    add_inputs: bool,
    config: FusedPairs,
) -> None:
    """Version 11's one launch (:mod:`..kernels.moe_fused`) under ``config``, on the grid of
    every block or the compact one (:class:`FusedPairs`' ``full_grid_blocks``): x and A as
    packed int64 words where every one of them allows it, B likewise (:func:`.operands.words`)."""
    slots, experts = metadata[1].shape[0], a[0].shape[1]
    rank, width = a[0].shape[2], b[0].shape[2]
    vec = fused_vec(rank, config)
    (kernel_x, *kernel_a), packed_xa = _as_words([x, *a])
    kernel_b, packed_b = _as_words(b)
    row_blocks = metadata[1].shape[1]
    column_groups = -(-width // (config.threads * vec))
    most = config.full_grid_blocks
    if most is None:  # (as many as the GPU's SMs)
        most = _multiprocessors(out.device.index)
    compact = slots * row_blocks * len(b) * column_groups > most
    kernel = launcher_of(
        fused_kernel.build_moe_fused_kernel(
            a[0].dtype, out.dtype, config.threads, config.tile_n, config.tile_p, config.unroll,
            config.splits, vec, rank, packed_xa, packed_b, by_pair, add_inputs, compact,
            slots_at_once(slots),
        )
    )  # fmt: skip
    if compact:
        grid = (compact_units(out.shape[0], metadata, experts, block_size, 1), 1)
    else:
        grid = (row_blocks, slots)
    kernel(
        (*grid, len(b) * column_groups),
        config.threads,
        (kernel_x, kernel_a[0], kernel_a[-1], kernel_b[0], kernel_b[-1], out, weights,
         *metadata, top_k, block_size, by_pair, offset),
    )  # fmt: skip


def _as_words(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """``(tensors, True)`` as packed int64 words where every one of them allows it
    (:func:`.operands.words`), else ``(tensors, False)`` as they are."""
    packed = [words(t) for t in tensors]
    if all(w is not None for w in packed):
        return packed, True
    return list(tensors), False


@functools.cache
def _multiprocessors(index: int | None) -> int:
    """The SMs of the CUDA device ``index`` (a host-side fact, asked once)."""
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def _outer_expand(call: _Expand, b: list[torch.Tensor]) -> None:
    """Version 6's expand: B as packed int64 words where every slice allows it, and the
    output as words of four where :func:`..kernels.moe_expand_outer.words_out` allows."""
    out, buffer, weights, metadata, block_size, by_pair, offset, add_inputs = call
    slices, width, rank = len(b), b[0].shape[2], b[0].shape[3]
    slots = metadata[1].shape[0]
    config = OUTER_EXPAND
    threads, chunk = outer_shape(rank, width, block_size, config)
    kernel_b, packed_b = _as_words(b)
    packed_out = outer_expand.words_out(out, offset, width, config.vec)
    wide_out = outer_expand.wide_words_out(out, offset, width, config.vec)
    wide_x = rows_start_at(buffer, 16)  # every buffer row at 16 bytes
    expand = launcher_of(
        outer_expand.build_moe_outer_expand_kernel(
            b[0].dtype, out.dtype, threads, config.vec, chunk, rank, packed_b, packed_out,
            wide_out, wide_x, by_pair, add_inputs, slots_at_once(slots),
        )
    )  # fmt: skip
    kernel_out = out.view(torch.int64) if packed_out else out
    column_groups = -(-width // (threads * config.vec))
    units = compact_units(buffer.shape[1], metadata, b[0].shape[1], block_size, 1)
    expand(
        (units, 1, slices * column_groups),
        threads,
        (buffer, kernel_b[0], kernel_b[-1], kernel_out, weights, *metadata, block_size, offset),
    )


def compact_units(num_pairs: int, metadata: tuple, experts: int, block_size: int, per: int):
    """The CUDA blocks along x of a compact grid (:func:`..kernels.moe_blocks.unit_walker`):
    as many as the call's pairs can fill units of ``per`` blocks
    (:func:`..kernels.moe_blocks.units_in_use`), and no more than the rows' own bound."""
    row_blocks, slots = metadata[1].shape[1], metadata[1].shape[0]
    bound = slots * -(-row_blocks // per)
    return max(1, min(bound, units_in_use(num_pairs, slots, experts, block_size, per)))


def _mma_shrink(
    call: _Shrink,
    x: torch.Tensor,
    a: list[torch.Tensor],
    *,
    hidden: int,
    dtype: torch.dtype,
    runs: bool = False,
) -> None:
    """Version 4's shrink (and 5's, where the blocks are full): x and A of ``dtype`` as
    int64 words (:func:`tensor_core_words`), K being ``hidden`` elements. With ``runs``
    (version 6) the shape of :func:`mma_shrink_runs` (every slice in one CUDA block, and
    runs of blocks where the call's pairs fill them); runs on a compact grid, single blocks
    on version 5's grid unless :data:`COMPACT_SINGLE_BLOCK_MMA_SHRINK`."""
    buffer, metadata, top_k, block_size, by_pair = call
    rank, num_pairs = buffer.shape[2], buffer.shape[1]
    blocks, slots = metadata[1].shape[1], metadata[1].shape[0]
    if runs:
        config = MMA_SHRINK_RUNS
        experts = a[0].shape[1]
        m_tiles, n_tiles, group, joint = mma_shrink_runs(
            num_pairs, slots, experts, block_size, len(a), rank, config
        )
        compact = group > 1 or COMPACT_SINGLE_BLOCK_MMA_SHRINK
    else:
        config, group, joint, compact = MMA_SHRINK, 1, False, False
        n_tiles = min(config.n_tiles, -(-rank // 8))
        m_tiles = min(config.m_tiles, -(-block_size // 16))  # of the 16-pair tiles a block needs
    # 16-byte loads where every row is whole 16-byte pairs of words at multiples of 16
    wide = hidden % 8 == 0 and all(rows_start_at(t, 16) for t in (x, *a))
    # version 6: a compact grid's walk, and each warp's next chunk loaded ahead
    six = (slots_at_once(slots), MMA_SHRINK_AHEAD) if runs else ()
    shrink = launcher_of(
        mma_shrink.build_moe_mma_shrink_kernel(
            dtype, config.threads, m_tiles, n_tiles, wide, group, joint, compact, *six
        )
    )
    ranks = len(a) * rank if joint else rank  # the ranks one row of rank groups covers
    rank_groups = -(-ranks // (8 * n_tiles)) * (1 if joint else len(a))
    if compact:  # a compact grid of units of `group` blocks
        grid = (compact_units(num_pairs, metadata, a[0].shape[1], block_size, group), 1)
    else:
        grid = (blocks, slots)
    shrink(
        (*grid, rank_groups),
        config.threads,
        (x, a[0], a[-1], buffer, *metadata, top_k, block_size, by_pair),
    )


def _mma_expand(call: _Expand, b: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Version 4's expand: B of ``dtype`` as int64 words (:func:`tensor_core_words`)."""
    out, buffer, weights, metadata, block_size, by_pair, offset, add_inputs = call
    blocks, slots = metadata[1].shape[1], metadata[1].shape[0]
    width, rank = b[0].shape[2], buffer.shape[2]
    config = MMA_EXPAND
    n_tiles = min(config.n_tiles, -(-width // 8))
    m_tiles = min(config.m_tiles, -(-block_size // 16))  # of the 16-pair tiles a block needs
    wide_x = buffer.data_ptr() % 16 == 0  # every row too: the rank is a multiple of 4
    expand = launcher_of(
        mma_expand.build_moe_mma_expand_kernel(
            dtype, out.dtype, config.threads, m_tiles, n_tiles, rank, wide_x, by_pair,
            add_inputs,
        )
    )  # fmt: skip
    column_groups = -(-width // (config.threads // 32 * 8 * n_tiles))
    expand(
        (blocks, slots, len(b) * column_groups),
        config.threads,
        (buffer, b[0], b[-1], out, weights, *metadata, block_size, offset),
    )


def _stacks(name: str, stacks, device) -> list[torch.Tensor]:
    """1 or 2 contiguous 4-D weights of a kernel dtype on ``device``."""
    check_sequence(name, stacks)
    if len(stacks) > MAX_MOE_SLICES:
        raise ValueError(f"{name} may hold up to {MAX_MOE_SLICES} slices, got {len(stacks)}")
    for s, w in enumerate(stacks):
        check_tensor(f"{name}[{s}]", w, ndim=4, dtypes=KERNEL_DTYPES, contiguous=True)
        _same_device(f"{name}[{s}]", w, device)
    return list(stacks)


def _same_device(name: str, t: torch.Tensor, device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, but y is on {device}")
