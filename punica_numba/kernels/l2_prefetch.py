"""Asking L2 for memory a kernel will load soon, without waiting for it.

A prefetch names an address and returns at once: no register receives a value, and no
later instruction waits on it. The memory system brings the line into L2, so a load of it
a little later finds it there instead of in DRAM. Two forms (inline PTX, sm_90):

* :func:`line_asker`: ``prefetch.global.L2`` of the 128-byte line holding one element;
* :func:`bytes_asker`: ``cp.async.bulk.prefetch.L2`` of a run of bytes, one instruction
  for a whole contiguous region (a warp's rows of B: 8 KB at r=64), in 16-byte granules.

A prefetch reads nothing into the program, so it cannot change a result: asking for the
wrong lines (a stale address) only wastes bandwidth. That is what lets a kernel ask before
``griddepcontrol.wait`` (:mod:`.dependent_launch`), while the kernel ahead of it may still
write those lines: its later loads, after the wait, read L2, which holds every write of the
kernel ahead once the wait has passed. :mod:`.expand_mma`'s "Asking ahead" does this.

On the simulator (no L2 to ask) both are device functions that do nothing.
"""

from __future__ import annotations

import functools

from .._cuda import SIMULATOR, cuda
from .dtypes import element_pointer

__all__ = ["bytes_asker", "line_asker"]

#: Bytes a bulk prefetch's address and size are multiples of.
GRANULE = 16


def _element_address(context, builder, sig, args):
    """In an intrinsic's codegen whose first two arguments are ``(row, q)``: the address
    of element ``q`` of the 1-D array ``row``, as a 64-bit integer."""
    from llvmlite import ir

    return builder.ptrtoint(element_pointer(context, builder, sig, args), ir.IntType(64))


@functools.cache
def _line_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def prefetch_line(typingctx, row, q):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                "{ .reg .u64 a; cvta.to.global.u64 a, $0; prefetch.global.L2 [a]; }",
                "l",
                side_effect=True,
            )
            builder.call(asm, [_element_address(context, builder, sig, args)])
            return context.get_dummy_value()

        return types.void(row, q), codegen

    @cuda.jit(device=True)
    def ask_line(row, q):
        prefetch_line(row, q)

    return ask_line


@functools.cache
def _bytes_on_gpu():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def prefetch_bytes(typingctx, row, q, count):
        def codegen(context, builder, sig, args):
            start = _element_address(context, builder, sig, args)
            count = context.cast(builder, args[2], sig.args[2], types.int64)
            end = builder.add(start, count)
            # Whole granules covering [start, end): down from the start, up to the end.
            # They stay inside memory the allocation maps (CUDA allocates in 256-byte or
            # larger steps, from boundaries of as many bytes), and a prefetch reads nothing.
            mask = ir.Constant(ir.IntType(64), ~(GRANULE - 1))
            first = builder.and_(start, mask)
            last = builder.and_(builder.add(end, ir.Constant(ir.IntType(64), GRANULE - 1)), mask)
            size = builder.trunc(builder.sub(last, first), ir.IntType(32))
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)]),
                "{ .reg .u64 a; cvta.to.global.u64 a, $0; "
                "cp.async.bulk.prefetch.L2.global [a], $1; }",
                "l,r",
                side_effect=True,
            )
            builder.call(asm, [first, size])
            return context.get_dummy_value()

        return types.void(row, q, count), codegen

    @cuda.jit(device=True)
    def ask_bytes(row, q, count):
        prefetch_bytes(row, q, count)

    return ask_bytes


@cuda.jit(device=True)
def _ask_nothing(row, q):
    return


@cuda.jit(device=True)
def _ask_no_bytes(row, q, count):
    return


def line_asker():
    """The device function ``ask_line(row, q)``: ask L2 for the line holding ``row[q]``
    (``row`` a 1-D array, ``q`` inside it)."""
    return _ask_nothing if SIMULATOR else _line_on_gpu()


def bytes_asker():
    """The device function ``ask_bytes(row, q, count)``: ask L2 for the ``count`` bytes
    from ``row[q]`` on (inside ``row``'s allocation)."""
    return _ask_no_bytes if SIMULATOR else _bytes_on_gpu()
