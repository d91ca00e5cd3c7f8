"""Every kernel's first step: let the next kernel start, then wait for the one before.

On a CUDA stream a kernel normally starts only once the kernel before it has finished.
Between the two the GPU idles for a while: the last blocks of the first drain, the
second grid is set up, its first blocks are placed and only then issue their first
loads. At decode, where one of our kernels takes 2-4 µs, that gap is a large part of
a call. Hopper (sm_90) can shorten it with a *programmatic dependent launch*: a kernel
launched with the attribute ``programmatic_stream_serialization``
(:func:`.._cuda.dependent_launch`) may start before the kernel ahead of it has
finished, and two PTX instructions say what it may do meanwhile:

* ``griddepcontrol.launch_dependents``: the kernels launched after this one may start
  now (once every block of this grid has said so, or finished);
* ``griddepcontrol.wait``: wait until every kernel this one depends on has finished
  and its writes to memory are visible.

Our kernels give the first, then the second, as the first statement of their bodies
(``begin()``, made by :func:`prologue` when the kernel is built), before they read a
word of memory. So a kernel never reads what the kernel ahead of it may still be
writing, or writes what it may still be reading, whatever that kernel is (ours,
torch's, anyone's): the results are those of an ordinary launch. What overlaps is the
launch itself and the placing of the blocks. A kernel launched the ordinary way, or
with nothing ahead of it, passes both instructions at once.

Why wait at once, rather than after the reads that do not depend on the kernel ahead
(the tile table, the weights)? Measured on the H200 (session 24, the r=64 tensor-core
expand at 256 tokens on 16 LoRAs): waiting after the tile and the tokens had been read
saved less (6.44-6.69 µs, from 6.94-7.14) than waiting first (6.13-6.27); and a kernel
that reads nothing before the wait cannot depend on what ran before it.

On the simulator, below sm_90, or with ``PUNICA_NUMBA_DEPENDENT_LAUNCH=0``, ``begin()``
does nothing (and the launches are ordinary ones).
"""

from __future__ import annotations

from .._cuda import cuda, dependent_launch

__all__ = ["prologue"]


@cuda.jit(device=True)
def _nothing():
    """The prologue of a kernel launched the ordinary way (compiled out)."""
    return


def _launch_dependents_then_wait():
    """``begin()`` on the GPU: the two instructions, as one piece of inline PTX."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def launch_dependents_then_wait(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), []),
                "griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;",
                # "memory": no load or store may move above the wait
                "~{memory}",
                side_effect=True,
            )
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    @cuda.jit(device=True)
    def begin():
        launch_dependents_then_wait()

    return begin


def prologue():
    """The device function every kernel calls first, as ``begin()``: the dependent
    launch's two instructions where :func:`.._cuda.dependent_launch` holds, else
    nothing. Called when a kernel is built, after the device is known."""
    return _launch_dependents_then_wait() if dependent_launch() else _nothing
