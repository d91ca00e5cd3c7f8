"""MoE LoRA's pairs as the dense op's table of one-token tiles: a row a pair, none idle.

Version 9 of MoE LoRA hands calls of few pairs a (slot, expert) to the dense op's row
kernels (:mod:`.shrink`, :mod:`.expand`, :mod:`.expand_lanes`), which the dense op takes
where each slot has a token or two, and which the tuned table and the heuristic choose
among for every layer shape. Their tiles are one token each; so here each pair is a tile:
(slot l, expert e) is dense slot ``l * E + e`` (as for version 7's tiles,
:mod:`.moe_tiles`), and a pair of one of its blocks is a row ``(l * E + e, i, 1, p)`` of
the dense tile table (:mod:`.segments`), ``i`` the row's own number, ``p`` the pair.

Why a row a pair and not a row an entry: the align step pads every (slot, expert)'s run of
pairs to whole blocks, so with a pair or two a (slot, expert) most of a block's entries are
padding. A row an entry would give the row kernels a CUDA block for each, most of them
leaving at once: at Qwen3-30B-A3B's w13 with 256 tokens over 16 adapters some 2,048 pairs
sit in some 32,000 entries, and each row is 8 to 16 CUDA blocks of the dense kernels (its
slices and groups of ranks or columns).

So the pairs are packed: row ``i`` is the i-th pair of the blocks in use, taken slot by
slot, block by block, entry by entry; its number depends on how many pairs every block
before it holds, a running sum. One CUDA block makes the table, in rounds of as many
blocks in use as it has threads:

* thread ``t`` takes the round's t-th block in use (:func:`.moe_blocks.unit_walker`, which
  skips the slots ``adapter_enabled`` turns off), its expert, and counts the entries that
  name a pair (``0 <= p < P``: padding names ``P``; a block of expert -1, or of an expert
  the weights do not hold, counts none);
* the counts' running sum over the round's threads (in shared memory, ``log2(threads)``
  steps), plus the rounds before, is where the thread's first pair goes; it writes its
  block's pairs there, in their order;
* rounds end at the first thread that finds no block in use; then the rows past the last
  pair are made idle, ``(-1, 0, 0, 0)``.

The rows are P, the host's bound: a pair is in at most one block. (A metadata that named a
pair twice would have more; the rows past P are not written.) The tile's tokens, as the
kernels read them (``sorted_tokens`` at the row's position), are the pairs in the same
order: ``tokens[i] = p``, and 0 for an idle row. Fixed sizes, no read-back: the launch can
be captured in a CUDA graph. Every entry is read by one thread, every output written by
one.
"""

from __future__ import annotations

import functools

from numba import int32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .moe_blocks import running_sum, unit_walker

__all__ = ["MOE_PAIRS_THREADS", "build_moe_pairs_kernel", "pairs_threads"]

#: The most threads of the one CUDA block: the blocks in use one round takes. On the
#: simulator, where each is a Python thread, a few (so that test calls take several rounds).
MOE_PAIRS_THREADS = 4 if SIMULATOR else 1024


def pairs_threads(
    num_pairs: int, slots: int, row_blocks: int, most: int = MOE_PAIRS_THREADS
) -> int:
    """The threads of the pairs kernel for a call: enough for every block in use in one
    round where there can be no more than ``most`` of them, a power of two from a warp's 32
    (or ``most``, if fewer). Each block in use holds a pair, so they are at most P, and at
    most ``row_blocks`` (NB) a slot: at one token of top-8, 32 threads and five steps of
    the running sum, not 1024 and ten."""
    threads = min(32, most)
    while threads < min(num_pairs, slots * row_blocks, most):
        threads *= 2
    return threads


@functools.cache
def build_moe_pairs_kernel(batch: int, threads: int = MOE_PAIRS_THREADS):
    """The kernel ``pairs(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens)``: ``table`` [P, 4]
    and ``tokens`` [P] int32, launched as one CUDA block of ``threads`` (a power of two);
    ``batch`` the slots the walk reads at once (:func:`.moe_blocks.slots_at_once`)."""
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the running sum, got {threads}")
    THREADS = threads
    unit_of = unit_walker(batch)
    begin = prologue()

    @jit_kernel(THREADS)
    def pairs(
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
        t = cuda.threadIdx.x
        rows = table.shape[0]
        entries = sorted_token_ids.shape[1]
        running = cuda.shared.array(THREADS, int32)  # the round's running sum of pairs
        done = 0  # rows written by the rounds before
        first = 0  # the round's first block in use
        while True:
            l, b = unit_of(
                first + t, num_tokens_post_padded, adapter_enabled, block_size,
                sorted_token_ids, 1,
            )  # fmt: skip
            slot, count = -1, 0
            start = b * block_size
            end = min(start + block_size, entries)
            if l >= 0:
                e = expert_ids[l, b]
                if 0 <= e < num_experts:
                    slot = l * num_experts + e
                    for q in range(start, end):
                        p = sorted_token_ids[l, q]
                        if 0 <= p < num_pairs:
                            count += 1
            # where the block's first pair goes: the round's running sum, the rounds before
            row = done + running_sum(running, t, count) - count
            if count > 0:
                for q in range(start, end):
                    p = sorted_token_ids[l, q]
                    if 0 <= p < num_pairs and row < rows:
                        table[row, 0], table[row, 1] = slot, row
                        table[row, 2], table[row, 3] = 1, p
                        tokens[row] = p
                        row += 1
            done += running[THREADS - 1]
            # Every thread found a block in use: there may be more. (Also the barrier
            # before the next round writes the running sums again.)
            if cuda.syncthreads_and(int32(1 if l >= 0 else 0)) == 0:
                break
            first += THREADS
        for i in range(min(done, rows) + t, rows, THREADS):  # the idle rows
            table[i, 0], table[i, 1], table[i, 2], table[i, 3] = -1, 0, 0, 0
            tokens[i] = 0

    return pairs
