"""The tensor-core expand's fp16 builds beside bf16's, read for the H200 without a GPU.

Not a timing: the registers and SASS instructions of the builds of the lab notes' "fp16
without a table of its own" section, compiled as ``moe_static.py`` compiles the MoE kernels
(numba-cuda's NVVM to PTX for ``sm_90``, ``ptxas -arch=sm_90a -v`` under the kernel's own
register ceiling where it passes it, ``cuobjdump -sass``; the same tools are needed).

Each build in ``VARIANTS`` is one warp of 64 columns (8-column tiles, 16-byte words of output
in whole column groups), 16 tokens, an fp32 buffer in 16-byte loads, no dependent-launch
tricks, at r=16, 64 and 128 (the last in rank chunks): with fp16 B on the f16 products (each
row of the buffer scaled into fp16's range by its largest magnitude first) or bf16 B.

Run from the repository root: ``python docs/benchmarks/probes/expand_f16_static.py [NAME ...]``.
Prints one JSON line: the commit and ptxas's version, and for each build what
``moe_static._compiled`` reads.
"""

import os


def _flags(rank, dtype):
    """The builder's arguments past the buffer's dtype: 32 threads, one 16-token tile, eight
    8-column tiles, the rank's steps, whole steps, 16-byte output words, whole column groups,
    16-byte buffer loads, B in 16-byte loads where the rank is a multiple of 32, then no
    one-pass grid, several slots, no asking ahead, B after the wait; B's dtype."""
    return (32, 1, 8, -(-rank // 16), rank % 16 == 0, True, True, True, rank % 32 == 0,
            False, False, False, False, dtype)  # fmt: skip


VARIANTS = {  # name: (rank, B's dtype)
    "r16_fp16": (16, "fp16"),
    "r16_bf16": (16, "bf16"),
    "r64_fp16": (64, "fp16"),
    "r64_bf16": (64, "bf16"),
    "r128_fp16": (128, "fp16"),
    "r128_bf16": (128, "bf16"),
}


def build(rank, dtype):
    """The expand of a variant, built (on whatever machine runs this)."""
    import torch

    from punica_numba.kernels.expand_mma import build_mma_expand_kernel

    b_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    return build_mma_expand_kernel(torch.float32, *_flags(rank, b_dtype))


def _signature():
    """The expand's argument types as the op passes them: the fp32 buffer, B and the output
    as int64 words, the slices' base and first words, the tile table and each tile's rows
    (int32), ``add_inputs``."""
    from numba.cuda import types

    def a(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    words = (a(types.int64, 3),) * 3
    return (a(types.float32, 3), *words, a(types.int64, 2), *(types.int64,) * 4,
            a(types.int32, 2), a(types.int32, 2), types.boolean)  # fmt: skip


def main(argv=None) -> None:
    from moe_static import read_builds

    read_builds(VARIANTS, build, _signature, argv)


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
