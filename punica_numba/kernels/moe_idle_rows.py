"""An empty table of one-token tiles, the first of version 14's two launches for the pairs
path's table (:mod:`.moe_claims`, whose rows are then claimed by runs of the entries): every
row idle, ``(-1, 0, 0, 0)``, every token 0, and the count of the rows claimed 0. A thread a
row; every output is written by one thread. A kernel of its own (one kernel a module): the
claims that follow need every row written before any is claimed, which only the end of a
launch gives.
"""

from __future__ import annotations

import functools

from .._cuda import cuda, jit_kernel
from .dependent_launch import prologue

__all__ = ["build_idle_rows_kernel"]


@functools.cache
def build_idle_rows_kernel(threads: int):
    """The kernel ``idle(table, tokens, claimed)``: every row of ``table`` [P, 4] (int32)
    idle, ``(-1, 0, 0, 0)``, ``tokens`` [P] 0, and ``claimed`` [1] (int32) 0; a thread a
    row, ``max(1, ceil(P / threads))`` CUDA blocks of ``threads``."""
    THREADS = threads
    begin = prologue()

    @jit_kernel(THREADS)
    def idle(table, tokens, claimed):
        begin()  # wait for the kernels before this one (dependent_launch)
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        if i == 0:
            claimed[0] = 0
        if i < table.shape[0]:
            table[i, 0], table[i, 1], table[i, 2], table[i, 3] = -1, 0, 0, 0
            tokens[i] = 0

    return idle
