"""The one-token shrink: the row shrink (:mod:`.shrink`) of a token and a rank a block, on
weight stacks of one slot, with the length of a row compiled in.

At one token on one slot (vLLM's default ``max_loras`` is 1) the row shrink already loads
everything in one trip to memory ("One slot" in :mod:`.shrink`), yet on the H200 it took
2.8 µs at r=16 where the expand of the same bytes takes 2.2. The trip was not what was
left: before its first load each thread of the row kernel works out the tile, the rank
group, the loop over the row (its bound known only at run time, so every word's index is
clamped) and 64-bit addresses with Numba's wraparound of negative indices, about 200
instructions (ptxas 13.0, sm_90), a dependent chain that each of a block's warps runs
before its loads go out. A probe kernel that loads the same rows with a handful of
instructions took 2.08 µs (``h200_v22_candidates.json``).

So this kernel does only what one token of one slot needs. Block ``(token, slice, n)``
(the row kernel's grid with one rank a group) takes the token of its own index, row
``n`` of the slot's A (slot 0: the stack has one) and the token's row of x, each as a
1-D view (its address worked out once), and thread ``tid`` loads words ``tid, tid +
THREADS, ...`` of both, as many as ``words`` (compiled in) gives it, before it uses any.
The token's slot comes from ``token_lora_mapping`` in the same trip and is tested only
where the block stores (slot -1: nothing).

The products are the row kernel's, in its order: each thread adds its words in the order
of ``k``, each word's elements in order, then the block adds the threads' sums with the
same :func:`.shrink.block_sum`. So for equal ``threads`` the bits are the row kernel's
(``LaunchConfig.arithmetic``), whatever ranks a block of that kernel takes.
"""

from __future__ import annotations

import functools

import torch
from numba import float32, int64, uint64

from .._cuda import SIMULATOR, cuda, jit_kernel
from .dependent_launch import prologue
from .dtypes import loader, packing, storer, word_loader
from .segments import slice_of
from .shrink import block_sum

__all__ = ["MAX_WORDS_PER_THREAD", "build_token_shrink_kernel"]

#: Words of a row one thread may load (each of x and A): 8 is H = 8192 in bf16 with 256
#: threads. Longer rows take the row kernel.
MAX_WORDS_PER_THREAD = 8


@functools.cache
def build_token_shrink_kernel(
    dtype: torch.dtype, out_dtype: torch.dtype, threads: int, words: int, accumulate: bool
):
    """Compile-time specialisation: the dtypes of x and A (packed 8-byte words) and of the
    output, threads per block (a power of two, as for :func:`.shrink.build_shrink_kernel`),
    the words in one row of x and A, and whether the products are added to the output.

    The kernel takes the row kernel's arguments, ``tiles`` being ``token_lora_mapping``
    (``sorted_tokens`` is not read), and the grid ``(tokens, slices, rank)``."""
    per_thread = -(-words // threads)
    if per_thread > MAX_WORDS_PER_THREAD:
        raise ValueError(
            f"a row of {words} words is {per_thread} words a thread over {threads} threads; "
            f"at most {MAX_WORDS_PER_THREAD}"
        )
    load = word_loader(dtype, True)
    load_out, store_out = loader(out_dtype), storer(out_dtype)
    THREADS, WORDS, PACK, ACCUMULATE = threads, words, packing(dtype, True), accumulate
    PER_THREAD = per_thread
    WHOLE = words % threads == 0  # every thread has PER_THREAD words: no bound checks
    add_up, TREE_WIDTH = block_sum(threads, 1)
    FENCE = not SIMULATOR  # (the simulator runs no compiler to reorder loads)

    begin = prologue()

    @jit_kernel(THREADS)
    def shrink_token(x, w0, w1, w2, out, slice_base, token_lora_mapping, sorted_tokens, scaling):
        # x: [M, K/PACK] words; w*: [1, R, K/PACK] words; out: [S, M, R]
        # (unsigned: indexing with them needs no wraparound of negative indices)
        begin()  # wait for the kernels before this one (dependent_launch)
        token, s_local, n = uint64(cuda.blockIdx.x), cuda.blockIdx.y, uint64(cuda.blockIdx.z)
        tid = cuda.threadIdx.x
        slot = token_lora_mapping[token]  # (loaded with the rest; tested at the store)
        w, _ = slice_of(s_local, w0, w1, w2, 0, 0, 0)  # (the expands' first columns: unused)
        x_row, a_row = x[token], w[0, n]
        out_slice = slice_base + s_local
        old = float32(0.0)
        if ACCUMULATE and tid == 0:
            old = load_out(out[out_slice, token, n])
        xw = cuda.local.array(PER_THREAD, int64)
        aw = cuda.local.array(PER_THREAD, int64)
        for i in range(PER_THREAD):  # unrolled: every load before any use
            k = uint64(tid + i * THREADS)
            if WHOLE or k < WORDS:
                xw[i] = x_row[k]
                aw[i] = a_row[k]
        if FENCE:
            # No load may move below a fence: without it ptxas 13.0 issued the first
            # product before the last loads of the row, which then waited a trip for it.
            cuda.threadfence_block()
        partial = cuda.local.array(1, float32)
        partial[0] = float32(0.0)
        for i in range(PER_THREAD):
            if WHOLE or tid + i * THREADS < WORDS:
                for lane in range(PACK):  # the elements of one word, in order
                    partial[0] += load(xw[i], lane) * load(aw[i], lane)
        tree = cuda.shared.array((1, TREE_WIDTH), float32)
        add_up(partial, tree, tid)
        if tid == 0 and slot != -1:
            out[out_slice, token, n] = store_out(old + scaling * tree[0, 0])

    return shrink_token
