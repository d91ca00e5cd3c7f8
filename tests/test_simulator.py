"""The simulator's own behaviour that the package relies on (skipped on a GPU).

Numba's CUDA simulator runs each CUDA thread as a Python thread. ``punica_numba._simulator``
changes four of its ways: a block's threads meet at ``cuda.syncthreads()`` by their own
counts, where Numba's block manager polled them in a busy loop
(``_simulator._barrier_without_a_poller``); the first call of ``cuda.shared.array``
from a line of a kernel makes the block's array under a lock, where two threads that made
it at the same moment each got their own (``_simulator._one_shared_array_per_site``); and
a device function's module takes the launch's ``cuda`` once a launch, where Numba swapped
it around every call (``_simulator._device_calls_swap_once``); and a block runs on threads
kept from one block to the next, where Numba started a thread for every CUDA thread
(``_simulator._threads_kept_between_blocks``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import types
import warnings

import numpy as np
import pytest

from punica_numba._cuda import SIMULATOR, cuda

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


def test_threads_meet_at_each_barrier_and_those_that_returned_are_not_waited_for():
    """Two rounds through shared memory, each thread reading its neighbour's value of the
    round; the first two threads of each block return before the first barrier."""
    threads, blocks, rounds = 8, 3, 2

    @cuda.jit
    def kernel(values, out):
        shared = cuda.shared.array(8, np.float64)
        i, b = cuda.threadIdx.x, cuda.blockIdx.x
        if i < 2:
            return
        total = 0.0
        for r in range(rounds):
            shared[i] = values[b, i] * (r + 1)
            cuda.syncthreads()
            total += shared[2 + (i - 3) % (threads - 2)]  # the one before, round the six
            cuda.syncthreads()
        out[b, i] = total

    values = np.arange(blocks * threads, dtype=np.float64).reshape(blocks, threads)
    out = np.full_like(values, -1.0)
    kernel[blocks, threads](values, out)
    neighbour = np.roll(values[:, 2:], 1, axis=1)
    np.testing.assert_array_equal(out[:, 2:], neighbour * sum(range(1, rounds + 1)))
    assert (out[:, :2] == -1.0).all()


def test_syncthreads_count_counts_the_threads_of_the_block():
    @cuda.jit
    def kernel(out):
        i = cuda.threadIdx.x
        n = cuda.syncthreads_count(i % 3 == 0)
        out[cuda.blockIdx.x, i] = n

    out = np.zeros((2, 10), dtype=np.int64)
    kernel[2, 10](out)
    assert (out == 4).all()


def test_a_thread_that_raises_stops_its_block_and_its_error_is_the_launchs():
    """Thread 5 reads past its array after a barrier; the others, waiting at the next
    barrier, are let go with the abort, and the launch raises thread 5's IndexError."""

    @cuda.jit
    def kernel(values, out):
        i = cuda.threadIdx.x
        cuda.syncthreads()
        out[i] = values[i + 100 * (i == 5)]
        cuda.syncthreads()
        out[i] += 1.0

    values, out = np.ones(8), np.zeros(8)
    with pytest.raises(IndexError, match=r"tid=\[5, 0, 0\]"):
        kernel[1, 8](values, out)


def test_threads_waiting_at_a_barrier_keep_no_processor_busy():
    """One thread sleeps before the barrier that the block's other threads wait at: the
    process spends next to no processor time meanwhile. Numba's own manager polled the
    waiting threads in a loop and kept a processor busy all the while."""
    pause = 0.3

    @cuda.jit
    def kernel(out):
        if cuda.threadIdx.x == 0:
            time.sleep(pause)
        cuda.syncthreads()
        out[cuda.threadIdx.x] = 1

    out = np.zeros(16, dtype=np.int64)
    wall, processor = time.perf_counter(), time.process_time()
    kernel[1, 16](out)
    wall, processor = time.perf_counter() - wall, time.process_time() - processor
    assert (out == 1).all()
    assert wall >= pause
    assert processor < pause / 3, f"{processor:.3f} s of processor time in {wall:.3f} s"


def _module_of_a_device_function():
    """A module of its own (as the kernels' device functions live in modules other than
    their kernels'), holding ``cuda`` and a device function reading the thread's index."""
    module = types.ModuleType("device_helpers")
    module.cuda = cuda
    exec("def lane(shift):\n    return cuda.threadIdx.x + shift\n", module.__dict__)
    return module, cuda.jit(device=True)(module.lane)


def test_a_device_functions_module_has_the_real_cuda_back_after_a_launch():
    """Within a launch a device function of another module reads the launch's threads
    (its module swapped once); after the launch, and after a launch that raised, that
    module holds the real ``cuda`` again, and the function called from host code reads
    no thread."""
    module, lane = _module_of_a_device_function()

    @cuda.jit
    def kernel(out, fail):
        i = cuda.threadIdx.x
        out[i] = lane(10) + lane(20)  # a second call, after the module's swap
        if fail and i == 3:
            out[i + 100] = 0

    out = np.zeros(6, dtype=np.int64)
    kernel[1, 6](out, False)
    np.testing.assert_array_equal(out, 2 * np.arange(6) + 30)
    assert module.cuda is cuda
    with pytest.raises(IndexError, match=r"tid=\[3, 0, 0\]"):
        kernel[1, 6](out, True)
    assert module.cuda is cuda
    with pytest.raises(AttributeError):  # outside a launch there is no thread
        lane(0)
    assert module.cuda is cuda


def test_a_block_on_kept_threads_starts_afresh():
    """Blocks run on threads kept from earlier blocks and launches (of other shapes, one
    that raised): each thread has its own block's indices and lane, and the state the
    tensor-core emulation keeps on a thread (its scratch turn) starts from 0 in each."""
    from punica_numba.kernels.mma import _scratch_turn

    @cuda.jit
    def turns(out, fail):
        i = cuda.threadIdx.x
        out[i] = _scratch_turn()
        if i == 0:
            _scratch_turn()  # thread 0 one turn ahead of the others at the block's end
        if fail and i == 1:
            out[i + 100] = 0

    out = np.full(8, -1)
    turns[2, 8](out, False)
    with pytest.raises(IndexError):
        turns[1, 8](out, True)
    turns[1, 8](out, False)
    assert (out == 0).all(), out

    @cuda.jit
    def where(out):
        x, y, z = cuda.threadIdx.x, cuda.threadIdx.y, cuda.threadIdx.z
        b = cuda.blockIdx.x
        out[b, z, y, x, 0] = b
        out[b, z, y, x, 1] = x + 10 * y + 100 * z
        out[b, z, y, x, 2] = cuda.laneid

    out = np.full((3, 2, 3, 8, 3), -1)
    where[3, (8, 3, 2)](out)
    blocks = np.broadcast_to(np.arange(3)[:, None, None, None], (3, 2, 3, 8))
    np.testing.assert_array_equal(out[..., 0], blocks)
    z, y, x = np.meshgrid(np.arange(2), np.arange(3), np.arange(8), indexing="ij")
    np.testing.assert_array_equal(out[..., 1], np.broadcast_to(x + 10 * y + 100 * z, (3, 2, 3, 8)))
    lane = (x + 8 * (y + 3 * z)) % 32
    np.testing.assert_array_equal(out[..., 2], np.broadcast_to(lane, (3, 2, 3, 8)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_launches_on_threads_of_its_own():
    """The threads kept between blocks are not in a child forked after launches (fork
    copies only the thread that forks): the child's launch makes its own, and ends."""

    @cuda.jit
    def kernel(out):
        out[cuda.blockIdx.x, cuda.threadIdx.x] = cuda.threadIdx.x + 1

    out = np.zeros((2, 8), dtype=np.int64)
    kernel[2, 8](out)  # threads kept in this process
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (a fork with threads, 3.12+)
        child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        code = 1
        try:
            again = np.zeros((2, 8), dtype=np.int64)
            kernel[2, 8](again)
            code = 0 if (again == np.arange(1, 9)).all() else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        pytest.fail("the forked child's launch never ended")
    assert os.waitstatus_to_exitcode(done[1]) == 0
