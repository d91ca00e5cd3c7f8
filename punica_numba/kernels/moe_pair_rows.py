"""MoE LoRA's pairs as the dense op's table of one-token tiles, row p for pair p: no
running sum, two launches of many CUDA blocks.

:mod:`.moe_pairs` packs the pairs of the blocks in use into the first rows of the table, in
the blocks' order. Where a row goes depends on how many pairs every block before it holds,
a running sum, and one CUDA block works it out in rounds: on an H100 at c543804 that table
took 4 µs at one token (a replay's worth, about one launch) and grew to 27 µs at 256 tokens
over 16 adapters, a fifth of the op (the lab notes, "The pairs path launch by launch").

The row kernels need no packing: each CUDA block reads its own row, leaves at once where the
row is idle (slot -1), and takes its token from the row (:func:`.segments.tile_token`; a
one-token tile reads no list of tokens). So version 14 gives every pair ``p`` of the call
its own row ``p``, whether a block names it or not, and makes the table in two launches
with no sum between threads:

1. ``idle``, a thread a row: every row idle, ``(-1, 0, 0, 0)``, its token 0;
2. ``named``, a thread an entry of ``sorted_token_ids`` (grid: the entries of a row of the
   metadata along x, the slots along y): an entry of a block in use
   (:func:`.moe_blocks.block_in_use`: the slot turned on, the block below its count of
   padded entries, its expert in ``[0, E)``) that names a pair ``0 <= p < P`` writes that
   pair's row, ``(l * E + e, p, 1, p)``, and its token ``p``.

The second launch waits for the first (the stream's order, or the dependent launch's
wait), so a named pair's row is the named one. The pairs' rows come in the pairs' order,
not the blocks': the pairs that share a (slot, expert), and so its A and B, are no longer
neighbours. Below 4 pairs a (slot, expert), where the row kernels run, they are one or two.

A pair that a block in use names twice (metadata that the align step does not make) gets one
row, that of one of its namings, which one not defined; :mod:`.moe_pairs` gives it a row for
each naming up to P rows. Every entry is read by one thread; fixed sizes, no read-back: both
launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .moe_blocks import block_in_use

__all__ = ["PAIR_ROWS_THREADS", "build_idle_rows_kernel", "build_named_rows_kernel"]

#: Threads a CUDA block of both kernels; on the simulator a few, so that test calls take
#: several CUDA blocks.
PAIR_ROWS_THREADS = 8 if SIMULATOR else 256


@functools.cache
def build_idle_rows_kernel(threads: int = PAIR_ROWS_THREADS):
    """The kernel ``idle(table, tokens)``: every row of ``table`` [P, 4] (int32) idle,
    ``(-1, 0, 0, 0)``, and ``tokens`` [P] 0; a thread a row, ``ceil(P / threads)`` CUDA
    blocks of ``threads``."""
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def idle(table, tokens):
        begin()  # wait for the kernels before this one (dependent_launch)
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        if i < table.shape[0]:
            table[i, 0], table[i, 1], table[i, 2], table[i, 3] = -1, 0, 0, 0
            tokens[i] = 0

    return idle


@functools.cache
def build_named_rows_kernel(threads: int = PAIR_ROWS_THREADS):
    """The kernel ``named(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens)``: the row of each
    pair that an entry of a block in use names, after :func:`build_idle_rows_kernel`'s;
    grid ``(ceil(EM / threads), L)`` of ``threads``, a thread an entry."""
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def named(
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
        begin()  # wait for the kernels before this one: the idle rows
        slot = cuda.blockIdx.y
        q = cuda.blockIdx.x * THREADS + cuda.threadIdx.x  # the entry of the slot's row
        if q >= sorted_token_ids.shape[1]:
            return
        _, _, e = block_in_use(
            q // block_size, slot, block_size, sorted_token_ids, num_tokens_post_padded,
            adapter_enabled, expert_ids, num_experts,
        )  # fmt: skip
        p = sorted_token_ids[slot, q]
        if e >= 0 and 0 <= p < num_pairs:
            table[p, 0], table[p, 1] = slot * num_experts + e, p
            table[p, 2], table[p, 3] = 1, p
            tokens[p] = p

    return named
