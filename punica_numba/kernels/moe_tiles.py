"""MoE LoRA's blocks of (token, expert) pairs as the dense op's tile table, in one launch.

Version 7 of MoE LoRA hands its blocks to the dense op's tensor-core kernels
(:mod:`..ops.moe_dense`): (slot l, expert e) is dense slot ``l * E + e``, and each block of
``block_size`` pairs is ``ceil(block_size / 16)`` tiles of up to 16 pairs, a row of the
dense tile table (:mod:`.segments`) and a row of tile tokens each. Built from torch
operations that took some twenty small kernels a call, a sort among them, which on an H100
cost version 7 some 54-67 µs a call that grew little with the tokens (the lab notes,
"MoE LoRA version 7"). Here each thread makes one tile's rows:

* thread ``i`` is tile ``j = i % per_block`` of block ``b`` of slot ``l`` (``i //
  per_block = l * NB + b``);
* it walks the block's entries ``16 j ..`` of ``sorted_token_ids[l]`` (at most 16, not past
  the block or the row), keeps those that name a pair (``0 <= p < P``: the padding names
  ``P``) in their order, and writes them into its row of tile tokens, then the last one
  again up to 16;
* its table row is ``(l * E + e, 16 i, pairs, first pair)`` where the block is in use (it
  starts before the row's ``num_tokens_post_padded``, its expert is one of the E, the slot
  is on) and holds a pair, else ``(-1, 0, 0, 0)`` and a row of zeros.

The position ``16 i`` is where the tile's row starts in the tile tokens taken as one list
(the shrink's sorted tokens). Fixed sizes, no read-back: the launch can be captured in a
CUDA graph. Every entry is read by one thread, every output written by one.
"""

from __future__ import annotations

import functools

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue

__all__ = ["MOE_TILE_M", "MOE_TILES_THREADS", "build_moe_tiles_kernel"]

#: Pairs a tile holds: the dense tensor-core kernels' 16-token tiles.
MOE_TILE_M = 16
#: Threads a block: a tile a thread.
MOE_TILES_THREADS = 128


@functools.cache
def build_moe_tiles_kernel():
    """The kernel ``tiles(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens)``: ``table`` [B, 4]
    and ``tokens`` [B, 16] int32 with ``B = L * NB * ceil(block_size / 16)`` (``NB =
    expert_ids.shape[1]``), a thread a row (module notes), ``MOE_TILES_THREADS`` a block."""
    TILE_M = MOE_TILE_M
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
        blocks = expert_ids.shape[1]
        j, block = i % per_block, i // per_block
        l, b = block // blocks, block % blocks
        e = expert_ids[l, b]
        start = b * block_size
        in_use = start < num_tokens_post_padded[l] and 0 <= e < num_experts
        rows = 0
        if in_use and adapter_enabled[l] != 0:
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
        table[i, 0] = l * num_experts + e
        table[i, 1] = TILE_M * i
        table[i, 2] = rows
        table[i, 3] = tokens[i, 0]

    return tiles
