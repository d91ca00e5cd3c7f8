"""Thread block clusters (compute capability 9.0, Hopper): blocks that wait for each other
and read each other's shared memory.

A launch may group its blocks into *clusters* (a launch attribute: :mod:`.._cuda`'s
``jit_kernel(..., cluster=n)``, here n blocks along grid.z). The blocks of a cluster are
placed at the same time on one GPC (a group of SMs), so they can do two things blocks of
a grid cannot:

* wait for each other, ``cluster_sync``: every thread of every block of the cluster
  arrives (``barrier.cluster.arrive.release``: its writes to shared memory are made
  visible to the cluster first), then waits until all have (``barrier.cluster.wait
  .acquire``: the other blocks' writes are visible after it);
* read another block's shared memory, ``cluster_load`` (*distributed shared memory*):
  ``mapa`` turns the address of an element of this block's shared array into the address
  of the same element in block ``rank`` of the cluster, and ``ld.shared::cluster`` reads
  it, over the SMs' own network, not through L2 or DRAM.

So a cluster can add up what its blocks computed without a trip to global memory: the
split shrink's runs of K (:mod:`.shrink_mma_split`, "In one cluster") each leave their
sums in shared memory, and the first block of the cluster adds them, where otherwise each
run stores them to a workspace in global memory, makes them visible to the whole GPU
(``threadfence``), counts itself in with an atomic, and the last to arrive reads them back
(:mod:`.shrink_split`).

A block must not leave while another block may still read its shared memory: a kernel
that reads across the cluster passes ``cluster_sync`` once more after the reads.
Every thread of every block must call ``cluster_sync`` the same number of times (the
``.aligned`` forms: all threads of a warp together).

GPU only (inline PTX, sm_90): the simulator runs the blocks of a grid one after another,
so no block can wait for another. The kernels that use these are not built there.
"""

from __future__ import annotations

import functools

from .dtypes import element_pointer

__all__ = ["PORTABLE_CLUSTER", "cluster_device_functions"]

#: The most blocks a cluster may hold on every GPU that has clusters (larger ones are an
#: opt-in of some GPUs).
PORTABLE_CLUSTER = 8


@functools.cache
def cluster_device_functions():
    """``(cluster_sync, cluster_load)``, the intrinsics of the module notes, for a kernel
    built for the GPU (a kernel launched in clusters):

    * ``cluster_sync()``: every thread of every block of the cluster waits here until all
      have come, their writes to shared memory then visible to the others;
    * ``cluster_load(array, q, rank)``: element ``q`` (fp32) of the 1-D shared array
      ``array`` of block ``rank`` of the cluster (the same array of the same kernel)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def cluster_sync(typingctx):
        signature = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), []),
                "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;",
                "~{memory}",
                side_effect=True,
            )
            builder.call(asm, [])
            return context.get_dummy_value()

        return signature, codegen

    @intrinsic
    def cluster_load(typingctx, array, q, rank):
        signature = types.float32(array, q, rank)

        def codegen(context, builder, sig, args):
            i64, i32 = ir.IntType(64), ir.IntType(32)
            address = builder.ptrtoint(element_pointer(context, builder, sig, args), i64)
            block = context.cast(builder, args[2], sig.args[2], types.int32)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.FloatType(), [i64, i32]),
                "{\n\t.reg .u64 pn_g;\n\t.reg .u32 pn_s, pn_r;\n\t"
                "cvta.to.shared.u64 pn_g, $1;\n\tcvt.u32.u64 pn_s, pn_g;\n\t"
                "mapa.shared::cluster.u32 pn_r, pn_s, $2;\n\t"
                "ld.shared::cluster.f32 $0, [pn_r];\n\t}",
                "=f,l,r,~{memory}",
                side_effect=True,
            )
            return builder.call(asm, [address, block])

        return signature, codegen

    return cluster_sync, cluster_load
