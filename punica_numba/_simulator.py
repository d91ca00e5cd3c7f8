"""Mends to Numba's CUDA simulator, made once by :mod:`._cuda` when it runs the kernels.

The simulator runs each CUDA thread of a block as a Python thread. Four of its ways cost
the package, and :func:`mend` changes them:

1. **A block's barrier without a poller** (:func:`_barrier_without_a_poller`). Numba's
   block manager starts a block's threads and then polls them in a loop of Python until
   every live thread waits at ``cuda.syncthreads()``, when it lets them all go. The loop
   never sleeps: it holds the interpreter's lock for its whole time slice, over and over,
   while the threads that have work wait for it. Profiled on a test of the MoE shrink
   (numba-cuda 0.30, 2 cores), three quarters of the time the lock was held went to that
   loop and a tenth to the kernel's own threads. Here the threads keep count themselves:
   the last to reach the barrier, or the last to finish while the others wait there, lets
   them go, and the launch waits until none runs. What a barrier means is kept:
   the threads still running meet at it, a thread that has returned is not waited for,
   and the first thread to raise aborts the block and its exception is the launch's.
   Run alone on 2 cores, a test of the staged shrink (``test_staged_shrink``'s bits test
   of three runs) took 8.1 s where it took 50.2, and the test suite on both cores 587 s
   where it took 808.
2. **One shared array a line** (:func:`_one_shared_array_per_site`): every thread of a
   block gets the same ``cuda.shared.array`` of a line of the kernel.
3. **A device function's module swapped once a launch** (:func:`_device_calls_swap_once`).
   A kernel's code reaches the simulator's ``cuda`` through its module's globals, which
   the simulator swaps for the launch's fake module. Numba swaps them around every call
   of a device function: two locks, a context manager, and, whenever no other thread is
   inside the same module, a scan of all the module's globals and a second one to put
   them back. A tensor-core product alone is a few device calls a thread. Here the first
   call in a launch swaps the module and it stays swapped until the launch ends. Two
   tests of tensor-core shrinks (a staged block of 64 tokens, the MoE shrink of version
   6) took 9.6 s where they took 15.6, and the test suite on 2 cores 299 s where it took
   465.
4. **Threads kept from block to block** (:func:`_threads_kept_between_blocks`). Numba
   starts a Python thread for every CUDA thread of every block and joins it at the
   block's end: about 125 µs a thread on 2 cores, a third of the time of a test of the
   wrapper (``test_wrapper``: 15,112 threads, 406 µs each). Here a block of n threads runs
   on the first n of threads kept from one block and launch to the next, each handed its
   indices and the block's barrier: 308 µs a thread there, and the test suite on 2 cores
   244 s where it took 299.

The interpreter's switch interval is left at Python's own 5 ms. With Numba's poller it
had to be short (0.3 ms made a shrink launch about 5 times faster on 2 cores than 5 ms),
since every thread that left a barrier waited out the poller's time slice; without it the
threads of a block run until they wait, and the short interval only costs switches: two
cases of that MoE test took 48 s at 0.3 ms and 36 s at 5 ms (20 ms: 35 s).
"""

from __future__ import annotations

import os
import queue
import sys
import threading

import numpy as np


def mend() -> None:
    """Make the simulator's changes of this module (once; :mod:`._cuda` calls it)."""
    _barrier_without_a_poller()
    _threads_kept_between_blocks()
    _one_shared_array_per_site()
    _device_calls_swap_once()


class _Block:
    """The barrier of one block of simulated threads: how many still run, how many wait
    at the barrier, a count of the times it opened, and whether a thread raised."""

    def __init__(self, threads: int):
        self.lock = threading.Condition(threading.Lock())
        self.running = threads
        self.waiting = 0
        self.openings = 0
        self.aborted = False

    def open_if_every_running_thread_waits(self) -> None:
        """(Under ``lock``.) Let the waiting threads go once no running thread is not
        waiting: at the last thread's arrival, or at the finish of the last that was not."""
        if self.waiting and self.waiting == self.running:
            self.waiting = 0
            self.openings += 1
            self.lock.notify_all()

    def wait(self) -> None:
        """``cuda.syncthreads()`` of one thread."""
        with self.lock:
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads call")
            self.waiting += 1
            opening = self.openings
            self.open_if_every_running_thread_waits()
            while self.openings == opening and not self.aborted:
                self.lock.wait()
            if self.aborted:
                raise RuntimeError("abort flag set on syncthreads clear")

    def finished(self, raised: bool) -> None:
        """A thread returned (or raised: then every thread of the block is aborted)."""
        with self.lock:
            self.running -= 1
            if raised:
                self.aborted = True
                self.lock.notify_all()
            elif self.running == 0:
                self.lock.notify_all()  # the launch waits for it (:meth:`wait_for_the_end`)
            else:
                self.open_if_every_running_thread_waits()

    def wait_for_the_end(self) -> None:
        """Wait until every thread of the block has returned or raised."""
        with self.lock:
            while self.running:
                self.lock.wait()


def _barrier_without_a_poller() -> None:
    """Replace the block manager's polling loop by :class:`_Block`'s counts (see the
    module's notes)."""
    from numba.cuda.simulator import kernel as simulator

    thread_class = simulator.BlockThread
    polled_run = thread_class.run  # names the failing thread and block in the exception

    def run(self):
        try:
            polled_run(self)
        finally:
            self._block.finished(raised=self.exception is not None)

    def syncthreads(self):
        self._block.wait()

    thread_class.run = run
    thread_class.syncthreads = syncthreads


def _threads_kept_between_blocks() -> None:
    """Run each block on threads kept from one block and launch to the next (see the
    module's notes): a block of n threads takes the first n of them, each given its block
    and thread index, the block's barrier, and the kernel as Numba's thread takes it."""
    from numba.cuda.simulator import kernel as simulator
    from numba.cuda.simulator.kernelapi import Dim3

    one_thread = simulator.BlockThread.run  # (mended above) names its errors, tells the block
    kept: list = []
    os.register_at_fork(after_in_child=kept.clear)  # a forked child has none of the threads

    class KeptThread(simulator.BlockThread):
        """A simulated thread that runs one block's thread after another, as it is told."""

        def __init__(self):
            threading.Thread.__init__(self, daemon=True)  # (BlockThread's needs a block)
            self.jobs = queue.SimpleQueue()
            self.exception = None

        def run(self):
            while True:
                manager, block, target, block_index, thread_index = self.jobs.get()
                self._target, self._args, self._kwargs = target, (), {}
                self._manager, self._block = manager, block
                self.blockIdx, self.threadIdx = Dim3(*block_index), Dim3(*thread_index)
                x, y, z = manager._block_dim
                self.thread_id = thread_index[0] + x * (thread_index[1] + y * thread_index[2])
                self.exception, self.abort = None, False
                self.__dict__.pop("scratch_turn", None)  # (kernels.mma: from 0 each block)
                try:
                    one_thread(self)
                except BaseException as error:  # (Numba's keeps an Exception): the block's
                    self.exception = (error, error.__traceback__)

    def run_block(self, grid_point, *args):
        points = list(np.ndindex(*self._block_dim))
        while len(kept) < len(points):
            kept.append(KeptThread())
            kept[-1].start()
        threads, block = kept[: len(points)], _Block(len(points))

        def target():
            if self._debug:  # as Numba's thread: a division by zero raises
                with np.errstate(divide="raise"):
                    self._f(*args)
            else:
                self._f(*args)

        for thread, point in zip(threads, points):
            thread.jobs.put((self, block, target, grid_point, point))
        block.wait_for_the_end()
        raised = [t.exception for t in threads if t.exception is not None]
        # The thread that raised first is not always first in the block: the others
        # raised only because it aborted them.
        own = [e for e in raised if "abort flag set on syncthreads" not in str(e[0])]
        if raised:
            error, traceback = (own or raised)[0]
            raise error.with_traceback(traceback)

    simulator.BlockManager.run = run_block


def _one_shared_array_per_site() -> None:
    """Make the simulator hand every thread of a block the same shared array.

    Numba's simulator (numba-cuda 0.30) makes a block's ``cuda.shared.array`` on the
    first call from each line of code: it looks the line up in a dict, and when it
    finds nothing, makes the array and stores it, with no lock. Two threads that come
    between the look-up and the store each make their own array, and the block then
    works on two arrays: a shrink's sums in shared memory come out as garbage for
    that tile. Measured here: one allocation in about 2,000 split, with a switch
    interval of 0.3 ms, enough for about one run of the test suite in four to fail one
    check. This replacement does the look-up and the store under a lock.
    Dynamic shared memory (``shape == 0``), one buffer per launch, is left as it was.
    """
    from numba.cuda import types as numba_types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator.kernelapi import FakeCUDAShared

    as_made = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # (an alignment raises, as before)
            return as_made(self, shape, dtype, alignment)
        caller = sys._getframe(1)  # the kernel line that asks: one array per line
        site = (caller.f_code.co_filename, caller.f_lineno)
        with lock:
            found = self._allocations.get(site)
            if found is None:
                if isinstance(dtype, numba_types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[site] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array


def _device_calls_swap_once() -> None:
    """Make a device function's module take the launch's fake ``cuda`` at its first call in
    a launch, and keep it until the launch ends, when every module so swapped gets the
    real module back (see the module's notes). A device function called from host code,
    outside any launch, is called as Numba calls it."""
    from numba import cuda as real_cuda
    from numba.cuda.simulator import kernel as simulator

    numba_call = simulator.FakeCUDAKernel.__call__
    swapped: dict[int, tuple[dict, dict]] = {}  # id(globals) -> (globals, names swapped)
    lock = threading.Lock()

    def call(self, *args):
        launch_module = simulator._kernel_context  # None outside a launch
        if launch_module is None and not self._device:  # a launch: swapped back after it
            try:
                return numba_call(self, *args)
            finally:
                with lock:
                    for names, real in swapped.values():
                        names.update(real)
                    swapped.clear()
        if launch_module is None:  # a device function called from host code
            return numba_call(self, *args)
        names = self.fn.__globals__
        if id(names) not in swapped:
            with lock:
                if id(names) not in swapped:
                    real = {k: v for k, v in names.items() if v is real_cuda}
                    names.update(dict.fromkeys(real, launch_module))
                    swapped[id(names)] = (names, real)
        return self.fn(*args)

    simulator.FakeCUDAKernel.__call__ = call
