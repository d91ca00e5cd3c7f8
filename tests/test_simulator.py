"""The simulator's own behaviour that the package relies on (skipped on a GPU).

Numba's CUDA simulator runs each CUDA thread as a Python thread. ``punica_numba._cuda``
mends one race in it: the first call of ``cuda.shared.array`` from a line of a kernel
makes the block's array, and two threads that made it at the same moment each got
their own (see ``_cuda._one_shared_array_per_site``).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from punica_numba._cuda import SIMULATOR

pytestmark = pytest.mark.skipif(not SIMULATOR, reason="Numba's CUDA simulator only")

THREADS = 4


def _arrays_made_together(monkeypatch) -> list:
    """Each of THREADS threads asks one block's shared memory for the array of one line
    of code, all at once, while making an array takes a while (as it may when the
    interpreter switches threads in the middle)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    made = np.empty

    def slow_empty(*args, **kwargs):
        time.sleep(0.01)
        return made(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    shared = FakeCUDAShared(0)
    start = threading.Barrier(THREADS)
    got = []

    def thread():
        start.wait()
        got.append(shared.array((2, 3), np.float32))  # one line of code: one array

    threads = [threading.Thread(target=thread) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_the_threads_of_a_block_share_one_shared_array(monkeypatch):
    got = _arrays_made_together(monkeypatch)
    assert len(got) == THREADS
    assert all(a is got[0] for a in got), "threads of one block got different shared arrays"
    assert got[0].shape == (2, 3) and got[0].dtype == np.float32


def test_shared_arrays_of_different_lines_stay_apart():
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    shared = FakeCUDAShared(0)
    first = shared.array(4, np.int64)
    second = shared.array(4, np.int64)
    again = [shared.array(4, np.int64) for _ in range(2)]  # one line, called twice
    assert first is not second
    assert again[0] is again[1]
