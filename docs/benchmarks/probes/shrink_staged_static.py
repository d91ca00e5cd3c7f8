"""The staged tensor-core shrink beside the blocks the table takes at high rank, read for the
H200 without a GPU.

Not a timing: the registers, shared memory and SASS instructions of the staged builds the
launch table offers the tuner (:mod:`punica_numba.kernels.shrink_mma_staged` and its split
twin) and of the tensor-core shrink the tuned table takes at r=128 with many tokens a slot
(``mma_t128_m16_n64``: 16 tokens x 64 ranks, four warps walking K), compiled as
``moe_static.py`` compiles the MoE kernels (numba-cuda's NVVM to PTX for ``sm_90``, ``ptxas
-arch=sm_90a -v``, ``cuobjdump -sass``; the same tools are needed).

Each build in ``VARIANTS`` takes bf16 x and A in 16-byte rows and adds into an fp32 buffer:
``staged_t<threads>_m<tokens>_n<ranks>`` (``_k<n>``: K in n runs; ``staged_joint_``: the slices'
ranks side by side; ``_s<n>``: n stages in dynamic shared memory) and ``walk_t128_m16_n64``.

Run from the repository root: ``python docs/benchmarks/probes/shrink_staged_static.py [NAME
...]``. Prints one JSON line: the commit and ptxas's version, and for each build what
``moe_static._compiled`` reads.
"""

import os

# name: (staged, threads, 16-token tiles, 8-rank tiles a warp (staged) or a block, splits,
# the slices' ranks side by side[, stages in dynamic shared memory])
VARIANTS = {
    "walk_t128_m16_n64": (False, 128, 1, 8, 1, False),
    "staged_t128_m32_n128": (True, 128, 2, 4, 1, False),
    "staged_t128_m32_n64": (True, 128, 2, 2, 1, False),
    "staged_t256_m32_n128": (True, 256, 2, 2, 1, False),
    "staged_t128_m16_n128": (True, 128, 1, 4, 1, False),
    "staged_t128_m32_n128_k4": (True, 128, 2, 4, 4, False),
    "staged_t128_m16_n64_k8": (True, 128, 1, 2, 8, False),
    "staged_t128_m64_n128": (True, 128, 4, 4, 1, False),
    "staged_t256_m64_n128": (True, 256, 4, 2, 1, False),
    "staged_t128_m64_n64": (True, 128, 4, 2, 1, False),
    "staged_t64_m64_n32": (True, 64, 4, 2, 1, False),
    "staged_joint_t96_m32_n48": (True, 96, 2, 2, 1, True),
    "staged_joint_t128_m32_n64": (True, 128, 2, 2, 1, True),
    "staged_joint_t128_m32_n128": (True, 128, 2, 4, 1, True),
    "staged_t128_m32_n128_s8": (True, 128, 2, 4, 1, False, 8),
    "staged_t128_m32_n128_s16": (True, 128, 2, 4, 1, False, 16),
    "staged_t256_m64_n128_s8": (True, 256, 4, 2, 1, False, 8),
    "staged_t128_m64_n128_s12": (True, 128, 4, 4, 1, False, 12),
}


def build(staged, threads, m_tiles, n_tiles, splits, joint, stages=0):
    """The shrink of a variant, built (on whatever machine runs this)."""
    import torch

    from punica_numba.kernels import (
        build_mma_shrink_kernel,
        build_split_staged_mma_shrink_kernel,
        build_staged_mma_shrink_kernel,
    )

    tiles = (torch.bfloat16, torch.float32, threads, m_tiles, n_tiles)
    if not staged:
        return build_mma_shrink_kernel(*tiles)
    if splits > 1:
        return build_split_staged_mma_shrink_kernel(*tiles, splits, stages=stages)
    return build_staged_mma_shrink_kernel(*tiles, joint=joint, stages=stages)


def _signature(split):
    """The shrink's argument types as the op passes them (``shrink_joint_static``'s), with the
    workspace's partial sums and counters after the slice count where K is split."""
    from numba.cuda import types
    from shrink_joint_static import _signature as unsplit

    types_ = unsplit()
    workspace = (types.Array(types.float32, 1, "C"), types.Array(types.int32, 1, "C"))
    return (*types_[:7], *workspace, *types_[7:]) if split else types_


def main(argv=None) -> None:
    from moe_static import read_builds

    read_builds(VARIANTS, build, lambda *variant: _signature(variant[4] > 1), argv, True)


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
