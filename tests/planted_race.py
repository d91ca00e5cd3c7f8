"""A kernel with a planted shared-memory race: the control of ``tests/sanitize.sh``.

Before racecheck checks the library's kernels, the script runs this one under the same
options and kernel filter and requires racecheck to report its race. So a filter that
matches no kernel (or a racecheck that sees nothing) cannot pass as "0 errors".

Each thread stages a value from global memory in shared memory and then reads the one
another warp staged, with no barrier between: a read-after-write hazard. (The values
come from global memory so that the compiler cannot fold the shared array away, as
it does when a constant is stored and read back.) The kernel's name contains
``expand`` so that the script's default filter selects it, as it selects ours.
"""

from __future__ import annotations

import numpy as np
from numba import cuda, int32

THREADS = 128


@cuda.jit
def expand_planted_race(values, out):
    staged = cuda.shared.array(THREADS, int32)
    tid = cuda.threadIdx.x
    staged[tid] = values[tid]
    # the planted race: no cuda.syncthreads() before reading another warp's element
    out[tid] = staged[(tid + 32) % THREADS]


if __name__ == "__main__":
    values = cuda.to_device(np.arange(THREADS, dtype=np.int32))
    out = cuda.device_array(THREADS, dtype=np.int32)
    expand_planted_race[1, THREADS](values, out)
    cuda.synchronize()
    print("planted race ran")
