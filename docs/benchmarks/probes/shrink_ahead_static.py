"""The tensor-core shrink with one pass of loads ahead and with two, read for the H200
without a GPU.

Not a timing: the registers, spills and SASS instructions of the builds the launch table
offers with ``ahead=2`` (:mod:`punica_numba.kernels.shrink_mma`, "Passes ahead") beside the
same blocks with ``ahead=1``, compiled as ``moe_static.py`` compiles the MoE kernels
(numba-cuda's NVVM to PTX for ``sm_90``, ``ptxas -arch=sm_90a -v``, ``cuobjdump -sass``; the
same tools are needed). A build of 512 threads is held to 128 registers a thread by its
launch bound.

Each build in ``VARIANTS`` takes bf16 x and A in 16-byte rows and adds into an fp32 buffer:
``t<threads>_m<tokens>_n<ranks, 0 every rank>_r<rank>[_k<runs of K>]_a<passes ahead>`` (the
build of 16-rank groups at r=32 is the one of every rank at r=16).

Run from the repository root: ``python docs/benchmarks/probes/shrink_ahead_static.py [NAME
...]``. Prints one JSON line: the commit and ptxas's version, and for each build what
``moe_static._compiled`` reads.
"""

import os

# name: (threads, 16-token tiles, 8-rank tiles, runs of K, passes ahead)
VARIANTS = {
    f"{name}_a{ahead}": (*shape, ahead)
    for name, shape in {
        "t256_m16_n0_r16": (256, 1, 2, 1),
        "t128_m32_n0_r16": (128, 2, 2, 1),
        # the MoE tiles' shrink (16-pair tiles): its 4-warp block, and a 2-warp one
        "t128_m16_n0_r16": (128, 1, 2, 1),
        "t64_m16_n0_r16": (64, 1, 2, 1),
        "t128_m16_n0_r32": (128, 1, 4, 1),
        "t64_m16_n0_r32": (64, 1, 4, 1),
        "t128_m16_n0_r64": (128, 1, 8, 1),
        "t64_m16_n0_r64": (64, 1, 8, 1),
    }.items()
    for ahead in (1, 2)
}


def build(threads, m_tiles, n_tiles, splits, ahead):
    """The shrink of a variant, built (on whatever machine runs this)."""
    import torch

    from punica_numba.kernels import build_mma_shrink_kernel, build_split_mma_shrink_kernel

    tiles = (torch.bfloat16, torch.float32, threads, m_tiles, n_tiles)
    if splits > 1:
        return build_split_mma_shrink_kernel(*tiles, splits, ahead=ahead)
    return build_mma_shrink_kernel(*tiles, ahead=ahead)


def main(argv=None) -> None:
    from moe_static import read_builds
    from shrink_staged_static import _signature

    read_builds(VARIANTS, build, lambda *variant: _signature(variant[3] > 1), argv, True)


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
