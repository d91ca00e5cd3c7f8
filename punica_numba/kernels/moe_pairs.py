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
before it holds, a running sum over the blocks. The kernel is a grid of CUDA blocks, one
thread a block of the metadata (a *unit*: unit ``u`` is block ``u % NB`` of slot ``u //
NB``, so that the units' order is the table's):

* a thread reads its slot's count and flag; where its block is in range (``b <
  ceil(num_tokens_post_padded[l] / block_size)``, the slot turned on) it reads the block's
  expert and entries together (:data:`ENTRIES_AT_ONCE` entries at once) and counts those
  that name a pair (``0 <= p < P``: padding names ``P``), none where the expert is not one
  the weights hold;
* the CUDA block adds up the pairs of every unit before its own first, each thread counting
  a share of them as above (the block's own units are a few thousand at most: that is at
  most a few trips, and none in the first CUDA block);
* a running sum of its threads' counts (in shared memory, ``log2(threads)`` steps), plus
  that total, is where each thread's first pair goes; it writes its block's pairs there,
  in their order;
* the last CUDA block, which then knows how many pairs there are, makes the rows past the
  last pair idle, ``(-1, 0, 0, 0)``.

Until c543804 one CUDA block made the whole table in rounds of blocks in use, each of its
threads walking the slots to find its block: on an H100 it took 3.7 µs at one token and 27
µs at Qwen3-30B-A3B's 256 tokens over 16 adapters (2,048 pairs), 20-30 % of the op's time,
its instructions issued by one SM (``docs/benchmarks/probes/moe_pairs_steps.py``).

The rows are P, the host's bound: a pair is in at most one block. (A metadata that named a
pair twice would have more; the rows past P are not written.) The tile's tokens, as the
kernels read them (``sorted_tokens`` at the row's position), are the pairs in the same
order: ``tokens[i] = p``, and 0 for an idle row. Fixed sizes, no read-back: the launch can
be captured in a CUDA graph. Every output is written by one thread.
"""

from __future__ import annotations

import functools

from numba import int32, uint32

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue

__all__ = ["ENTRIES_AT_ONCE", "MOE_PAIRS_THREADS", "build_moe_pairs_kernel", "pairs_launch"]

#: The most threads of a CUDA block, a unit each. On the simulator, where each is a Python
#: thread, a few (so that test calls take several CUDA blocks).
MOE_PAIRS_THREADS = 4 if SIMULATOR else 1024

#: The entries of a block that a thread reads at once: vLLM's block sizes are 16 to 64, so
#: a block of 16 is one trip to memory. On the simulator fewer, so that tests' blocks of 3
#: to 20 entries take several reads.
ENTRIES_AT_ONCE = 4 if SIMULATOR else 16


def pairs_launch(slots: int, row_blocks: int, most: int = MOE_PAIRS_THREADS) -> tuple[int, int]:
    """``(CUDA blocks, threads)`` of the pairs kernel for ``slots`` rows of ``row_blocks``
    (NB) blocks: a thread a unit, the threads a power of two from a warp's 32 (or ``most``,
    if fewer) that holds every unit where there are at most ``most`` of them. At one token
    of top-8 over one adapter of 128 experts, 121 units: one CUDA block of 128 threads and
    seven steps of the running sum, not 1024 and ten."""
    units = slots * row_blocks
    threads = min(32, most)
    while threads < min(units, most):
        threads *= 2
    return max(1, -(-units // threads)), threads


@functools.cache
def build_moe_pairs_kernel(threads: int = MOE_PAIRS_THREADS):
    """The kernel ``pairs(sorted_token_ids, expert_ids, num_tokens_post_padded,
    adapter_enabled, block_size, num_pairs, num_experts, table, tokens)``: ``table`` [P, 4]
    and ``tokens`` [P] int32, launched as :func:`pairs_launch` says, CUDA blocks of
    ``threads`` (a power of two)."""
    if threads & (threads - 1):
        raise ValueError(f"threads must be a power of two for the running sum, got {threads}")
    THREADS, AT_ONCE = threads, ENTRIES_AT_ONCE

    @cuda.jit(device=True, inline="always")
    def unit_pairs(
        u, sorted_token_ids, expert_ids, num_tokens_post_padded, adapter_enabled, block_size,
        num_pairs, num_experts, named,
    ):  # fmt: skip
        """``(slot, count)`` of unit u: its dense slot ``l * E + e`` and how many of its
        entries name a pair, or ``(-1, 0)`` where its block is not in use. Two trips to
        memory: the slot's count and flag (a few values, shared by its blocks), then, only
        for a block in range, its expert and its entries together."""
        row_blocks = uint32(expert_ids.shape[1])
        l = uint32(u) // row_blocks  # (32-bit: the short division)
        b = uint32(u) - l * row_blocks
        start = b * uint32(block_size)
        if not (start < num_tokens_post_padded[l] and adapter_enabled[l] != 0):
            return -1, 0
        end = min(start + uint32(block_size), uint32(sorted_token_ids.shape[1]))  # (b < NB)
        e = expert_ids[l, b]
        count = 0
        for q in range(start, end, AT_ONCE):
            for j in range(AT_ONCE):  # unrolled: the loads go out together
                p = sorted_token_ids[l, min(q + j, end - 1)]  # (in the block)
                named[j] = 1 if q + j < end and 0 <= p < num_pairs else 0
            for j in range(AT_ONCE):
                count += named[j]
        if 0 <= e < num_experts:
            return l * num_experts + e, count
        return -1, 0

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
        first = cuda.blockIdx.x * THREADS  # this CUDA block's first unit
        units = sorted_token_ids.shape[0] * expert_ids.shape[1]
        rows = table.shape[0]
        running = cuda.shared.array(THREADS, int32)  # the running sum of the block's pairs
        earlier = cuda.shared.array(THREADS, int32)  # the sum of the threads' `before`
        named = cuda.local.array(AT_ONCE, int32)  # whether each entry of a read names a pair
        before = 0  # the pairs of this thread's share of the units before the block's
        for v in range(t, first, THREADS):
            before += unit_pairs(
                v, sorted_token_ids, expert_ids, num_tokens_post_padded, adapter_enabled,
                block_size, num_pairs, num_experts, named,
            )[1]  # fmt: skip
        slot, count = -1, 0
        if first + t < units:
            slot, count = unit_pairs(
                first + t, sorted_token_ids, expert_ids, num_tokens_post_padded,
                adapter_enabled, block_size, num_pairs, num_experts, named,
            )  # fmt: skip
        # Both sums over the threads (inclusive), in log2(THREADS) steps.
        running[t], earlier[t] = count, before
        cuda.syncthreads()
        step = 1
        while step < THREADS:
            add = running[t - step] if t >= step else 0
            add_before = earlier[t - step] if t >= step else 0
            cuda.syncthreads()
            running[t] += add
            earlier[t] += add_before
            cuda.syncthreads()
            step *= 2
        row = earlier[THREADS - 1] + running[t] - count  # where the block's first pair goes
        if count > 0:
            l = uint32(first + t) // uint32(expert_ids.shape[1])
            start = (uint32(first + t) - l * uint32(expert_ids.shape[1])) * uint32(block_size)
            end = min(start + uint32(block_size), uint32(sorted_token_ids.shape[1]))
            for q in range(start, end):  # (from L1 now)
                p = sorted_token_ids[l, q]
                if 0 <= p < num_pairs and row < rows:
                    table[row, 0], table[row, 1] = slot, row
                    table[row, 2], table[row, 3] = 1, p
                    tokens[row] = p
                    row += 1
        if cuda.blockIdx.x == cuda.gridDim.x - 1:  # the idle rows, past every pair
            done = earlier[THREADS - 1] + running[THREADS - 1]
            for i in range(min(done, rows) + t, rows, THREADS):
                table[i, 0], table[i, 1], table[i, 2], table[i, 3] = -1, 0, 0, 0
                tokens[i] = 0

    return pairs
