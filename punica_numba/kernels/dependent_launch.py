"""Every kernel's first step: wait for the kernels before it.

On a CUDA stream a kernel normally starts only once the kernel before it has finished.
Between the two the GPU idles for a while: the first kernel's last blocks drain and its
end is made known, the second grid is set up, its blocks are placed, and only then do
they issue their first loads. At decode, where one of our kernels takes 2-4 µs, that
gap is a large part of a call. Hopper (sm_90) can shorten it with a *programmatic
dependent launch*: a kernel launched with the attribute
``programmatic_stream_serialization`` (:func:`.._cuda.dependent_launch`) may be
launched once every block of the kernel ahead of it has ended, or has said so with
``griddepcontrol.launch_dependents``, before that kernel is known to have finished. It
must then wait before it touches what that kernel wrote:

* ``griddepcontrol.wait``: wait until every kernel this one depends on has finished and
  its writes to memory are visible.

Our kernels wait as the first statement of their bodies (``begin()``, made by
:func:`prologue` when the kernel is built), before they read or write a word of memory
that another kernel sees. So a kernel never reads what the kernel ahead of it may still
be writing, or writes what it may still be reading, whatever that kernel is (ours,
torch's, anyone's): the results are those of an ordinary launch. What overlaps is the
launch itself and the placing of the blocks. A kernel launched the ordinary way, or
with nothing ahead of it, passes the wait at once. (One build does more before its wait:
the tensor-core expand that asks ahead, below, reads its tile table and tokens there to
choose lines to prefetch, which a stale entry cannot make wrong. Only where the wrapper
launches it just behind its own shrink does it also load its rows of B there and, with no
tile, leave: a caller's kernel just ahead that says ``launch_dependents`` early and writes
the weights would otherwise be read half-written, as the H200 showed in v29.
:mod:`.expand_mma`, "B before the wait".)

**Why not say ``launch_dependents`` too?** Said first, it lets the next kernel be
launched as soon as every block of this one has started, so that kernel's blocks are
placed on the SMs while this one's still run, wherever room is left, and wait there.
Measured on the H200 (at 44a29fd, two rounds, one process per setting, µs; "ends":
only the wait, the next kernel launched as this one's blocks end):

| case | ordinary | said first | ends |
| --- | --- | --- | --- |
| expand T=1 | 2.22-2.23 | 1.61 | 1.70-1.71 |
| QKV expand 256 over 16 LoRAs | 6.14-6.20 | 8.75-8.76 | 5.51-5.55 |
| QKV shrink 4096 over 64 LoRAs | 27.2 | 30.9-31.2 | 26.9-28.1 |
| expand 256 on one LoRA | 3.68-3.71 | 3.58-3.94 | 3.00 |

Said first, it gained 0.1 µs more on the smallest kernels and lost up to 41 % where a kernel's
blocks are many and short; waiting alone lost nowhere. Said later, by the tensor-core expand after
its loads, after its products or after its stores (``h200_v30_candidates.json``), it tied on the
r=64 expand at 256 tokens over 16 LoRAs and lost up to 1.3 µs elsewhere (the QKV layer's expand at
256 over 16 LoRAs: 5.62-5.71 -> 6.16-6.89). Nor does a kernel wait later, after reads that do not
depend on the kernel ahead (its tile, its weights): on the r=64 tensor-core expand that saved less
(``h200_v26_candidates.json``), and a kernel that reads nothing before the wait cannot depend on
what ran before it. Nor does it prefetch its weights into L2 before the wait: that lost on the r=64
expand at 256 over 16 LoRAs (6.34-6.47 -> 6.46-6.64 µs, ``h200_v27_candidates.json``), as if little
time passed between a block's start and the end of its wait.

**Said first, with the tile asked of L2.** The two together pay where neither did alone:
said first, the next launch's blocks are placed while this one's run, and so have time to ask L2 for
their tiles before their wait. The tensor-core expand of one slice does both (:func:`next_launch`;
:mod:`.expand_mma`, "Asking ahead"): on the H200 (``h200_v31_candidates.json``) r=64 at 256 tokens
over 16 LoRAs went from 6.14-6.46 to 5.73-5.93 µs, and 64 over 8 LoRAs from 4.15-4.28 to 3.66-3.79;
launches of three slices and of one slot lost, and keep the wait alone. Since v29 the same expand
also loads its rows of B into registers before its wait, and a block with no tile leaves there
(:mod:`.expand_mma`, "B before the wait"): with the next launch placed early, a block now has time
before its wait that a load can use (r=64 at 256 over 16 LoRAs 5.77-6.02 -> 5.35-5.61 µs,
``h200_v34_candidates.json``). Since v30 it does so only just behind the wrapper's own shrink,
where nothing still running can be writing B (:mod:`.expand_mma`, "B before the wait").

On the simulator, below sm_90, or with ``PUNICA_NUMBA_DEPENDENT_LAUNCH=0``, ``begin()``
does nothing (and the launches are ordinary ones).
"""

from __future__ import annotations

import functools

from .._cuda import cuda, dependent_launch

__all__ = ["next_launch", "prologue"]


@cuda.jit(device=True)
def _nothing():
    """The prologue of a kernel launched the ordinary way (compiled out)."""
    return


@functools.cache
def ptx_statement(text: str):
    """The intrinsic of no arguments that is the one PTX statement ``text``: inline asm
    across which no load or store of memory may move (GPU only; the benchmark probes use it
    too)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def statement(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True
            )
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return statement


def ptx_device_function(text: str):
    """A device function ``()`` that runs the one PTX statement ``text`` (GPU only)."""
    statement = ptx_statement(text)

    @cuda.jit(device=True)
    def run():
        statement()

    return run


def next_launch():
    """The device function ``let_next()``: ``griddepcontrol.launch_dependents``, so that the
    next kernel on the stream may be launched once every block of this one has said it
    (used only where it was measured to pay: :mod:`.expand_mma`, "Asking ahead"); nothing
    where :func:`prologue`'s wait is nothing too."""
    return (
        ptx_device_function("griddepcontrol.launch_dependents;") if dependent_launch() else _nothing
    )


def prologue():
    """The device function every kernel calls first, as ``begin()``: the wait where
    :func:`.._cuda.dependent_launch` holds, else nothing. Called when a kernel is built,
    once the device is known."""
    return ptx_device_function("griddepcontrol.wait;") if dependent_launch() else _nothing
