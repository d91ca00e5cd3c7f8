"""Copies from global to shared memory that the copying threads do not wait for.

A plain copy into shared memory is a load into a register and a store from it: the thread
waits for the load before it can store, and each word in flight holds a register. Ampere
and Hopper copy without the register (inline PTX, sm_80 on):

* ``cp.async`` (:func:`words_copier`) starts a copy of 16 bytes (or 8) from global memory
  into shared memory and returns at once;
* ``cp.async.commit_group`` (:func:`group_committer`) closes the copies a thread started
  since its last commit into one group;
* ``cp.async.wait_group n`` (:func:`group_waiter`) waits until at most ``n`` of the thread's
  groups are still in flight (the newest ``n``).

A kernel that keeps ``S`` stages of shared memory starts the next stages' copies, commits a
group a stage, and before it reads a stage waits for all but the ``S - 2`` newest groups,
then ``syncthreads`` (each thread waits only for its own copies; the barrier makes every
thread's copies seen by all). :func:`stage_ring` is that walk, once for the staged kernels
(:mod:`.shrink_mma_staged`, :mod:`.expand_mma_staged`), each giving it how to start a
stage's copies and how to multiply a stage.

A copy goes from an address (:func:`address_of`) to a place counted from the start of the
kernel's shared array (:func:`stage_base_of`), so that a kernel that copies the same rows
chunk after chunk works their addresses out once. The simulator's arrays have no addresses:
there a kernel copies the words itself (at once), the base is 0, and committing and waiting
do nothing.
"""

from __future__ import annotations

import functools

from numba import int64, uint32

from .._cuda import SIMULATOR, cuda
from .dependent_launch import ptx_device_function
from .dtypes import element_pointer

__all__ = [
    "address_of",
    "group_committer",
    "group_waiter",
    "stage_base_of",
    "stage_ring",
    "stages_that_fit",
    "words_copier",
]

#: The most shared memory a block may declare statically (bytes), and the most stages a
#: staged kernel keeps there.
STATIC_SHARED_BYTES, MOST_STAGES = 48 * 1024, 8
#: The most dynamic shared memory a block may ask for on compute capability 9.0 (227 KB), which
#: the launcher allows a kernel above the 48 KB of the driver's default
#: (:func:`punica_numba._cuda.jit_kernel`'s ``shared_bytes``).
DYNAMIC_SHARED_BYTES = 227 * 1024


def stages_that_fit(stage_bytes: int, what: str, stages: int = 0) -> int:
    """The stages of ``stage_bytes`` each that a staged kernel's block keeps.

    ``stages`` 0: the most, up to :data:`MOST_STAGES`, that fit :data:`STATIC_SHARED_BYTES`
    (declared in the kernel); a ``ValueError`` naming ``what`` (the block) where two do not.
    Otherwise that many, in dynamic shared memory: a ``ValueError`` below 2 or past
    :data:`DYNAMIC_SHARED_BYTES`."""
    if stages:
        if stages < 2 or stages * stage_bytes > DYNAMIC_SHARED_BYTES:
            raise ValueError(
                f"{what} keeps 2 stages or more of {stage_bytes} bytes, at most "
                f"{DYNAMIC_SHARED_BYTES} bytes in all; got {stages}"
            )
        return stages
    stages = min(MOST_STAGES, STATIC_SHARED_BYTES // stage_bytes)
    if stages < 2:
        raise ValueError(
            f"{what} needs {2 * stage_bytes} bytes of shared memory for two stages; at most "
            f"{STATIC_SHARED_BYTES} are declared"
        )
    return stages


def address_of():
    """The device function ``address(row, q) -> int64``: the generic address of element
    ``q`` of the 1-D array ``row``, to be copied from later (GPU only: the simulator's
    arrays have no addresses a kernel can use)."""
    if SIMULATOR:
        raise RuntimeError("the simulator has no device addresses")
    return _address_on_gpu()


@functools.cache
def _address_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def element_address(typingctx, row, q):
        def codegen(context, builder, sig, args):
            pointer = element_pointer(context, builder, sig, args)
            return builder.ptrtoint(pointer, ir.IntType(64))

        return types.int64(row, q), codegen

    @cuda.jit(device=True)
    def address(row, q):
        return element_address(row, q)

    return address


@functools.cache
def _shared_address_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_address(typingctx, row, q):
        def codegen(context, builder, sig, args):
            generic = builder.ptrtoint(element_pointer(context, builder, sig, args), ir.IntType(64))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.IntType(32), [ir.IntType(64)]),
                "{ .reg .u64 s; cvta.to.shared.u64 s, $1; cvt.u32.u64 $0, s; }",
                "=r,l",
            )
            return builder.call(asm, [generic])

        return types.uint32(row, q), codegen

    @cuda.jit(device=True)
    def address(row, q):
        return shared_address(row, q)

    return address


@cuda.jit(device=True, inline="always")
def _no_stage_base(staged):
    return uint32(0)


@functools.cache
def stage_base_of():
    """The device function ``base(staged) -> uint32``: the shared-memory address of the 1-D
    shared array ``staged``'s first element, from which a staged kernel counts the places
    :func:`words_copier` copies to; on the simulator, whose kernels copy into the array
    itself, 0."""
    if SIMULATOR:
        return _no_stage_base
    shared_address = _shared_address_on_gpu()

    @cuda.jit(device=True, inline="always")
    def stage_base(staged):
        return shared_address(staged, 0)

    return stage_base


@functools.cache
def _copy_on_gpu(wide: bool):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    to_global = "{ .reg .u64 g; cvta.to.global.u64 g, $1; "  # (the same bits, made explicit)
    if wide:  # one 16-byte copy, bypassing L1 (.cg: the words are read once a block)
        copies = "cp.async.cg.shared.global [$0], [g], 16; }"
    else:  # two 8-byte copies (.ca: 8 bytes are not offered in .cg)
        copies = (
            "cp.async.ca.shared.global [$0], [g], 8; cp.async.ca.shared.global [$0+8], [g+8], 8; }"
        )

    @intrinsic
    def copy_words(typingctx, to, source):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64)]),
                to_global + copies,
                "r,l,~{memory}",
                side_effect=True,
            )
            builder.call(asm, list(args))
            return context.get_dummy_value()

        return types.void(types.uint32, types.int64), codegen

    @cuda.jit(device=True)
    def copy_two_words(to, source):
        copy_words(uint32(to), int64(source))

    return copy_two_words


def words_copier(wide: bool):
    """The device function ``copy(to, source)``: start copying the two int64 words at the
    global address ``source`` (:func:`address_of`) to the shared address ``to``
    (:func:`stage_base_of`). ``wide``: the caller's promise that both are multiples of 16
    bytes (one 16-byte copy); else two of 8 bytes. GPU only (see :func:`address_of`)."""
    if SIMULATOR:
        raise RuntimeError("the simulator has no device addresses")
    return _copy_on_gpu(wide)


@cuda.jit(device=True)
def _nothing():
    return


@functools.cache
def group_committer():
    """The device function ``commit()``: the copies this thread started since its last
    commit become one group."""
    return _nothing if SIMULATOR else ptx_device_function("cp.async.commit_group;")


@functools.cache
def group_waiter(newest_in_flight: int):
    """The device function ``wait()``: return once at most ``newest_in_flight`` of this
    thread's committed groups (its newest) are still being copied."""
    if newest_in_flight < 0:
        raise ValueError(f"newest_in_flight must be at least 0, got {newest_in_flight}")
    if SIMULATOR:
        return _nothing
    return ptx_device_function(f"cp.async.wait_group {newest_in_flight};")


@functools.cache
def stage_ring(stages: int, start_stage, multiply_stage):
    """``(fill, turn)``, the device functions of a ring of ``stages`` stages of shared memory
    through which a block walks chunks ``first .. end - 1`` of its operands:

    * ``fill(first, end, copying)`` starts copying the first ``stages - 1`` chunks, a
      committed group each (empty past ``end``);
    * ``turn(first, end, copying, multiplying)`` then, chunk by chunk, waits for this
      thread's copies of the chunk and (``syncthreads``) everyone's, starts copying the
      chunk ``stages - 1`` ahead into the stage the last chunk was read from, commits, and
      multiplies the chunk.

    ``start_stage(stage, chunk, copying)`` starts the thread's copies of a chunk into a
    stage, ``multiply_stage(stage, multiplying)`` adds a stage's products: each kernel's
    own, compiled into the ring, ``copying`` and ``multiplying`` the tuples of what else
    they take (a closure called here takes no ``*args``). A kernel may work between
    ``fill`` and ``turn`` while the copies fly."""
    commit, wait = group_committer(), group_waiter(stages - 2)

    @cuda.jit(device=True, inline="always")
    def fill(first, end, copying):
        for stage in range(stages - 1):
            if first + stage < end:
                start_stage(stage, first + stage, copying)
            commit()

    @cuda.jit(device=True, inline="always")
    def turn(first, end, copying, multiplying):
        read, write = 0, stages - 1  # the stages multiplied from and copied into next
        for chunk in range(first, end):
            wait()  # this thread's copies of ``chunk``
            cuda.syncthreads()  # everyone's; and every warp is done with the last chunk
            if chunk + stages - 1 < end:  # into the stage the last chunk was read from
                start_stage(write, chunk + stages - 1, copying)
            commit()
            multiply_stage(read, multiplying)
            write = read
            read = 0 if read == stages - 1 else read + 1

    return fill, turn
