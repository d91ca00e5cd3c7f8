"""MoE LoRA's blocks of (token, expert) pairs as the dense op's tile table, in one launch.

Version 7 of MoE LoRA hands its blocks to the dense op's tensor-core kernels
(:mod:`..ops.moe_dense`): (slot l, expert e) is dense slot ``l * E + e``, and each block of
``block_size`` pairs is ``ceil(block_size / 16)`` tiles of up to 16 pairs, a row of the
dense tile table (:mod:`.segments`) and a row of tile tokens each. At 61de306 the table was
some twenty torch operations a call (a sort among them) with a row for every block a slot's
row can hold: on an H100 version 7 then took some 54-67 µs more than version 6 at one
token, and 1.58-1.91x its time over 16 adapters, where most of those rows are idle (the lab
notes, "MoE LoRA version 7"). Here one kernel makes the table, a thread a row, the blocks in
use first and rows only up to a bound on them (on an H100 at cb9702d version 7 then took
0.56-1.62x version 6's time, at one token within 1.44x):

* the blocks in use are, slot by slot, the first ``ceil(num_tokens_post_padded[l] /
  block_size)`` of each row (at most its ``NB``), none of a slot ``adapter_enabled`` turns
  off, taken in order: thread ``i`` is tile ``j = i % per_block`` of the ``i //
  per_block``-th of them, block ``b`` of slot ``l``, found by the walk over the slots'
  counts that :mod:`.moe_pairs` and version 6's compact grids take
  (:func:`.moe_blocks.unit_walker`);
* it walks the block's entries ``16 j ..`` of ``sorted_token_ids[l]`` (at most 16, not past
  the block or the row), keeps those that name a pair (``0 <= p < P``: the padding names
  ``P``) in their order, and writes them into its row of tile tokens, then the last one
  again up to 16;
* its table row is ``(l * E + e, 16 i, pairs, first pair)`` where the block's expert is one
  of the E and the tile holds a pair; else, and past the blocks in use, ``(-1, 0, 0, 0)``
  and a row of zeros.

The table's rows are a bound the host knows without a look at the device
(:func:`moe_tile_rows`): however P pairs are aligned, each block in use holds at least one
of them (a run of a (slot, expert)'s pairs is padded by less than a block), so they are at
most P, and at most ``NB`` a slot. (Not ``(P + runs (block_size - 1)) / block_size`` with
the runs at most ``min(P, L E)``: with expert parallelism the align step runs over every
expert, E counts the local ones, and the other experts' runs take blocks of -1.)

The position ``16 i`` is where the tile's row starts in the tile tokens taken as one list
(the shrink's sorted tokens). Fixed sizes, no read-back: the launch can be captured in a
CUDA graph. Every entry is read by one thread, every output written by one.
"""

from __future__ import annotations

import functools

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue
from .moe_blocks import unit_walker

__all__ = ["MOE_TILES_THREADS", "MOE_TILE_M", "build_moe_tiles_kernel", "moe_tile_rows"]

#: Pairs a tile holds: the dense tensor-core kernels' 16-token tiles.
MOE_TILE_M = 16
#: Threads a block: a tile a thread.
MOE_TILES_THREADS = 128


def moe_tile_rows(num_pairs: int, slots: int, block_size: int, row_blocks: int) -> int:
    """The rows of the tile table: ``ceil(block_size / 16)`` for each block that an
    alignment of ``num_pairs`` pairs over ``slots`` slots can use, at most one a pair and
    ``row_blocks`` (``NB``) a slot (module notes)."""
    return min(num_pairs, slots * row_blocks) * -(-block_size // MOE_TILE_M)


@functools.cache
def build_moe_tiles_kernel(batch: int):
    """The kernel ``tiles(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens)``: ``table`` [R, 4]
    and ``tokens`` [R, 16] int32 (R: :func:`moe_tile_rows`), a thread a row (module notes),
    ``MOE_TILES_THREADS`` a block; ``batch`` the slots the walk reads at once
    (:func:`.moe_blocks.slots_at_once`)."""
    TILE_M = MOE_TILE_M
    unit_of = unit_walker(batch)
    begin = prologue()

    @jit_kernel(MOE_TILES_THREADS)
    def tiles(
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        adapter_enabled,
        block_size,
        num_pairs,
        num_experts,
        table,
        tokens,
    ):
        begin()  # wait for the kernels before this one (dependent_launch): the align step
        i = cuda.grid(1)
        if i >= table.shape[0]:
            return
        per_block = (block_size + TILE_M - 1) // TILE_M
        j = i % per_block
        # the slot of the (i // per_block)-th block in use, and b its block there
        l, b = unit_of(
            i // per_block, num_tokens_post_padded, adapter_enabled, block_size,
            sorted_token_ids, 1,
        )  # fmt: skip
        slot, rows = -1, 0
        if l >= 0:
            e = expert_ids[l, b]
            if 0 <= e < num_experts:
                slot = l * num_experts + e
                start = b * block_size
                first = start + TILE_M * j
                end = min(start + min(TILE_M * (j + 1), block_size), sorted_token_ids.shape[1])
                for q in range(first, end):
                    p = sorted_token_ids[l, q]
                    if 0 <= p < num_pairs:
                        tokens[i, rows] = p
                        rows += 1
        if rows == 0:
            table[i, 0], table[i, 1], table[i, 2], table[i, 3] = -1, 0, 0, 0
            for k in range(TILE_M):
                tokens[i, k] = 0
            return
        last = tokens[i, rows - 1]
        for k in range(rows, TILE_M):
            tokens[i, k] = last
        table[i, 0] = slot
        table[i, 1] = TILE_M * i
        table[i, 2] = rows
        table[i, 3] = tokens[i, 0]

    return tiles
