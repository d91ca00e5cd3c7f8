"""Writers of fresh weights and metadata: a kernel just ahead of an op that rewrites what it reads.

The tensor-core expand that asks ahead (``punica_numba.kernels.expand_mma``, "B before the
wait") reads its tile-table row and loads its rows of B *before* its ``griddepcontrol.wait``.
That is safe while the kernel just ahead of it on the stream has ended before the expand
starts, or writes neither B nor the metadata. A caller's own kernel that says
``griddepcontrol.launch_dependents`` early and then writes the weights (an adapter loaded
into a slot) breaks that promise. These writers let a test put each kind of kernel just
ahead of an op:

* :func:`torch_writer`: ``dst.copy_(src)`` for every pair, torch's ordinary kernels (or
  copies), which let the next kernel start only as they end;
* :class:`NumbaWriter` with ``early=True`` (``"early"``): a kernel of our own whose first
  statement is ``griddepcontrol.launch_dependents``
  (:func:`punica_numba.kernels.dependent_launch.next_launch`), and which only then, slowly,
  writes the new values;
* :class:`NumbaWriter` with ``early=False`` (``"slow"``): the same kernel without that
  statement, a control: as slow, but the next kernel starts only as it ends.

Why the early writer is slow. The next kernel (ours) may be launched once every block of
the writer has said ``launch_dependents``, which with :data:`WRITER_BLOCKS` blocks, all
resident at once, is at once. The op's blocks are then placed on the SMs the writer leaves
free (it holds at most :data:`WRITER_BLOCKS` of them) and run their code before the wait
while the writer's threads still spin (:data:`SPIN_NS`, 2 ms of the GPU's ``%globaltimer``,
much longer than the time between the writer's launch and the op's, even with the host's
work of an eager call in between) and then copy, with few threads, for up to a millisecond
more. Whatever the op reads before its wait it therefore reads before the writer has
written it: the old value. What it reads after its wait, it reads
after the writer has finished (``griddepcontrol.wait`` waits for the whole kernel ahead and
its writes), so an op that reads nothing early cannot go wrong.

How the writer itself is launched does not matter: a dependent launch is a property of the
*next* kernel's launch (``punica_numba._cuda`` gives every launch of the package's kernels
the attribute ``programmatic_stream_serialization``), together with the trigger in the
kernel ahead. So the writer goes through Numba's own dispatcher, an ordinary launch on
torch's current stream (``punica_numba._cuda.launch_stream``): it starts only when what
came before it (the torch kernels that made the new values) has finished, and needs no
wait of its own. Inside a CUDA-graph capture that launch is captured like any other.

On the simulator ``next_launch()`` is a function that does nothing, there is no timer to
spin on, and the kernel is a plain copy: it runs there too, and its copying is checked
there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from punica_numba._cuda import SIMULATOR, cuda, kernel_array, launch_stream
from punica_numba.kernels.dependent_launch import next_launch

__all__ = [
    "SPIN_NS",
    "WRITER_BLOCKS",
    "WRITER_THREADS",
    "NumbaWriter",
    "torch_writer",
    "words",
]

#: Blocks of the writer: few, so that an H200's other SMs (it has 132) are free for the
#: op's blocks to be placed beside it while it runs, and so that all of them say
#: ``launch_dependents`` at once (a block that waited for a free SM would say it late).
WRITER_BLOCKS = 8
#: Threads a block. With 8 blocks, 2048 threads each copy one 4-byte word of every
#: 2048: for the 10 MB weight stacks of the tests, over a millisecond of copying.
WRITER_THREADS = 256
#: Nanoseconds each thread spins before its first write: 2 ms, so that the op's blocks
#: have been placed and done their reads before the wait long before any new value is
#: written, even in an eager call, where the host takes a while between the writer's launch
#: and the op's. (Timed by ``%globaltimer``, not by ``clock64``: the SM clock runs from
#: about 0.35 to 1.98 GHz on an H200, so cycles are no fixed time. A first version spun
#: 200,000 cycles, about 0.1 ms at full clock: against an expand that loaded B before its
#: wait, 12 of 60 eager iterations went wrong at r=64 and none at r=16, where graph replays,
#: which launch the op at once, went wrong in nearly all; spinning 2 ms, every eager one
#: did too. The eager op's launch often came after the writer had written B.)
SPIN_NS = 2_000_000


def words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a 1-D int32 tensor (a view, no copy): what the writer copies.

    Every buffer the ops read (bf16 weights with an even last dim, int32 and int64
    metadata) is a whole number of 4-byte words.
    """
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 4:
        raise ValueError(f"cannot view {t.dtype} {tuple(t.shape)} as whole int32 words")
    return t.reshape(-1).view(torch.int32)  # [numel * itemsize / 4] int32


def torch_writer(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for each pair: torch's own kernels, on torch's current stream."""
    for dst, src in pairs:
        dst.copy_(src)


if SIMULATOR:

    @cuda.jit(device=True)
    def spin(nanoseconds):
        """Nothing: the simulator has no timer (and no launch to overlap)."""
        return

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def globaltimer(typingctx):
        """The GPU's nanosecond timer (PTX ``%globaltimer``); volatile, so never hoisted or
        merged."""

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.IntType(64), []),
                "mov.u64 $0, %globaltimer;",
                "=l",
                side_effect=True,
            )
            return builder.call(asm, [])

        return types.int64(), codegen

    @cuda.jit(device=True)
    def spin(nanoseconds):
        """Busy-wait ``nanoseconds`` of the GPU's timer."""
        start = globaltimer()
        while globaltimer() - start < nanoseconds:
            pass


@cuda.jit(device=True)
def _no_trigger():
    """The slow control's first statement: nothing (the next kernel starts as it ends)."""
    return


@functools.cache
def writer_kernel(early: bool):
    """The copy kernel; with ``early``, its first statement lets the next kernel be launched.

    Semantics:
        dsts, srcs: tuples of P 1-D int32 arrays, dsts[p] and srcs[p] of one length
        (early: griddepcontrol.launch_dependents, first)
        every thread spins ``spin_ns`` nanoseconds (GPU only), then
        for p < P: dsts[p][:] = srcs[p][:]     (grid-stride, one int32 word at a time)
    Reads and writes sum(len(dsts[p])) words; built on first use, once the device is known.
    """
    let_next = next_launch() if early else _no_trigger

    @cuda.jit
    def write(dsts, srcs, spin_ns):
        let_next()  # (early) the next kernel on the stream may be launched now
        spin(spin_ns)
        first, step = cuda.grid(1), cuda.gridsize(1)
        for p in range(len(dsts)):  # p < P: every pair, in order
            dst, src = dsts[p], srcs[p]
            for i in range(first, dst.shape[0], step):  # this thread's words of pair p
                dst[i] = src[i]

    return write


class NumbaWriter:
    """The copy kernel of :func:`writer_kernel`, launched on torch's current stream.

    Args:
        early: say ``launch_dependents`` first (the writer under test), or not (a control).
        blocks, threads: its grid (:data:`WRITER_BLOCKS`, :data:`WRITER_THREADS`).
        spin_ns: nanoseconds each thread waits before it writes (:data:`SPIN_NS`).
    """

    def __init__(
        self,
        early: bool = True,
        blocks: int = WRITER_BLOCKS,
        threads: int = WRITER_THREADS,
        spin_ns: int = SPIN_NS,
    ):
        self.early = early
        self.blocks, self.threads = blocks, threads
        self.spin_ns = np.int64(spin_ns)

    def __call__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy every ``(dst, src)`` pair (same shape and dtype) in one launch."""
        for dst, src in pairs:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(
                    f"cannot copy {src.dtype} {tuple(src.shape)} into "
                    f"{dst.dtype} {tuple(dst.shape)}"
                )
        dsts = tuple(kernel_array(words(dst)) for dst, _ in pairs)
        srcs = tuple(kernel_array(words(src)) for _, src in pairs)
        kernel = writer_kernel(self.early)
        kernel[self.blocks, self.threads, launch_stream()](dsts, srcs, self.spin_ns)
