"""MoE LoRA's pairs as the dense op's table of one-token tiles, packed by many CUDA blocks
that each claim their rows with one atomic add: no running sum over the whole call.

:mod:`.moe_pairs` packs the pairs of the blocks in use into the first rows of the table, in
the blocks' order. Where a row goes depends on how many pairs every block before it holds,
a running sum over the call, and one CUDA block works it out in rounds: on an H100 at c543804
that table took 4 µs at one token (a replay's worth, about one launch) and grew to 27 µs at
256 tokens over 16 adapters, a fifth of the op (the lab notes, "The pairs path launch by
launch").

The row kernels do not need the blocks' order. Each CUDA block of theirs reads its own row
and takes its token from it (:func:`.segments.tile_token`; a one-token tile reads no list of
tokens), and every pair's sums go to its own row of the buffer and its own row of y, so the
results are the same whatever row a pair is given. What the order is worth is the L2: the
pairs of one (slot, expert) read the same A and B, and in neighbouring rows they run at the
same time, so that the second finds them in L2. (A row for each pair in its own place, row
p, needs no sum at all, but puts the pairs of a (slot, expert) as far apart as their tokens:
at w13's 256 tokens over 16 adapters, some 750 pairs that share a 128 KiB A with an earlier
one would read it again, about 99 MB: an estimate.)

So version 14 makes the table in two launches of many CUDA blocks:

1. ``idle`` (:mod:`.moe_idle_rows`), a thread a row: every row idle, ``(-1, 0, 0, 0)``, its
   token 0, and the count of rows claimed (one int32 in memory) 0;
2. ``claim`` (this module), a thread an entry of ``sorted_token_ids`` (grid: runs of
   ``threads`` entries of a row of the metadata along x, the slots along y). An entry of a
   block in use (:func:`.moe_blocks.block_in_use`: the slot turned on, the block below its
   count of padded entries, its expert in ``[0, E)``) that names a pair ``0 <= p < P`` is
   one of the run's pairs; the run's running sum of them (in shared memory,
   ``log2(threads)`` steps) gives each its place in the run, one thread adds the run's
   count to the count of rows claimed (``atomic.add``) and so learns where the run's rows
   start, and each pair writes its row, ``(l * E + e, row, 1, p)``, and its token ``p``.

The second launch waits for the first (the stream's order, or the dependent launch's wait).
The rows claimed are the first n, n the pairs named; each run's pairs are neighbours in
their order, so a block of the metadata that no run boundary cuts (a block size that divides
the run's entries, as 16 does) keeps its pairs together; which run comes first is not
defined. Rows past P are not written (more pairs named than P: metadata that names a pair
twice). Fixed sizes, no read-back: both launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

from numba import int32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .moe_blocks import block_in_use, running_sum

__all__ = ["CLAIM_THREADS", "build_claim_rows_kernel"]

#: Threads a CUDA block (a power of two: the running sum): the entries of a run. On the
#: simulator a few, so that test calls take several runs.
CLAIM_THREADS = 4 if SIMULATOR else 256


@functools.cache
def build_claim_rows_kernel(threads: int = CLAIM_THREADS):
    """The kernel ``claim(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens, claimed)``: the rows
    of the pairs that the entries of blocks in use name, after
    :func:`.moe_idle_rows.build_idle_rows_kernel`'s launch; grid ``(ceil(EM / threads), L)`` of
    ``threads`` (a power of two), a thread an entry."""
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the running sum, got {threads}")
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def claim(
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        adapter_enabled,
        block_size,
        num_pairs,
        num_experts,
        table,
        tokens,
        claimed,
    ):
        begin()  # wait for the kernels before this one: the idle rows, the count at 0
        t = cuda.threadIdx.x
        slot = cuda.blockIdx.y
        q = cuda.blockIdx.x * THREADS + t  # the entry of the slot's row
        running = cuda.shared.array(THREADS, int32)  # the run's running sum of pairs
        first = cuda.shared.array(1, int32)  # the run's first row
        p, e = -1, -1
        if q < sorted_token_ids.shape[1]:
            _, _, e = block_in_use(
                q // block_size, slot, block_size, sorted_token_ids, num_tokens_post_padded,
                adapter_enabled, expert_ids, num_experts,
            )  # fmt: skip
            p = sorted_token_ids[slot, q]
        named = 1 if e >= 0 and 0 <= p < num_pairs else 0
        place = running_sum(running, t, named)  # the pairs of the run up to this entry
        if t == THREADS - 1 and place > 0:  # the run's rows, claimed at once
            first[0] = cuda.atomic.add(claimed, 0, place)
        cuda.syncthreads()
        if named:
            row = first[0] + place - 1
            if row < table.shape[0]:
                table[row, 0], table[row, 1] = slot * num_experts + e, row
                table[row, 2], table[row, 3] = 1, p
                tokens[row] = p

    return claim
