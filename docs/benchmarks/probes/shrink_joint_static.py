"""The tensor-core shrink with the slices side by side beside one slice a block, read for the
H200 without a GPU.

Not a timing: the registers and SASS instructions of the builds the launch table offers the
tuner (``mma_t512_m16_n24_j``, ``mma_t256_m16_n48_j``; :mod:`punica_numba.kernels.shrink_mma_joint`)
and of the one-slice builds the heuristic takes for the same layers, compiled as
``moe_static.py`` compiles the MoE kernels (numba-cuda's NVVM to PTX for ``sm_90``, ``ptxas
-arch=sm_90a -v``, ``cuobjdump -sass``; the same tools are needed). ptxas is not given the
launch's bound here, so a build of 512 threads over 128 registers would be held to 128 at
run time (``punica_numba._cuda.jit_kernel``).

Each build in ``VARIANTS`` is a 16-token tile, bf16 (or fp16) x and A in 16-byte loads, an
fp32 buffer added into: ``slice_*`` one slice's ranks a block (``n8``, ``n16``: the
heuristic's QKV picks at r=16 from 256 tokens), ``joint_*`` the slices' ranks side by side,
in groups of 24 (QKV at r=8 in one), 32 (gate_up at r=16 in one: the group of 48 built for
32 ranks) or 48 (QKV at r=16).

Run from the repository root: ``python docs/benchmarks/probes/shrink_joint_static.py [NAME
...]``. Prints one JSON line: the commit and ptxas's version, and for each build what
``moe_static._compiled`` reads.
"""

import os

VARIANTS = {  # name: (slices side by side, threads, 8-rank tiles, x's and A's dtype)
    "slice_t512_m16_n8": (False, 512, 1, "bf16"),
    "slice_t512_m16_n16": (False, 512, 2, "bf16"),
    "slice_t256_m16_n16": (False, 256, 2, "bf16"),
    "joint_t512_m16_n24": (True, 512, 3, "bf16"),
    "joint_t256_m16_n32": (True, 256, 4, "bf16"),
    "joint_t256_m16_n48": (True, 256, 6, "bf16"),
    "joint_t256_m16_n48_fp16": (True, 256, 6, "fp16"),
}


def build(joint, threads, n_tiles, dtype):
    """The shrink of a variant, built (on whatever machine runs this)."""
    import torch

    from punica_numba.kernels import build_joint_mma_shrink_kernel, build_mma_shrink_kernel

    x_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    builder = build_joint_mma_shrink_kernel if joint else build_mma_shrink_kernel
    return builder(x_dtype, torch.float32, threads, 1, n_tiles)


def _signature():
    """The shrink's argument types as the op passes them: x and each slice's A as int64
    words, the fp32 buffer, the first slice and the slice count, the tile table and the
    sorted tokens (int32), the scaling."""
    from numba.cuda import types

    def a(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    words = (a(types.int64, 3),) * 3
    return (a(types.int64, 2), *words, a(types.float32, 3), types.int64, types.int64,
            a(types.int32, 2), a(types.int32, 1), types.float32)  # fmt: skip


def main(argv=None) -> None:
    from moe_static import read_builds

    read_builds(VARIANTS, build, _signature, argv)


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
