"""The staged tensor-core expand's builds, read for the H200 without a GPU.

Not a timing: the registers, shared memory and SASS instructions of the staged expands the
launch table offers the tuner (:mod:`punica_numba.kernels.expand_mma_staged`), compiled as
``moe_static.py`` compiles the MoE kernels (numba-cuda's NVVM to PTX for ``sm_90``, ``ptxas
-arch=sm_90a -v``, ``cuobjdump -sass``; the same tools are needed).

Each build in ``VARIANTS`` takes an fp32 buffer and writes 16-byte words of output:
``t<threads>_m<tokens>_n<columns>_r<rank>_<B's dtype>``, and ``_s<stages>`` for a ring of
that many stages in dynamic shared memory.

Run from the repository root: ``python docs/benchmarks/probes/expand_staged_static.py [NAME
...]``. Prints one JSON line: the commit and ptxas's version, and for each build what
``moe_static._compiled`` reads.
"""

import os

VARIANTS = {  # name: (threads, tokens, columns, rank, B's dtype)
    "t64_m32_n64_r128_bf16": (64, 32, 64, 128, "bf16"),
    "t128_m64_n64_r128_bf16": (128, 64, 64, 128, "bf16"),
    "t128_m32_n128_r128_bf16": (128, 32, 128, 128, "bf16"),
    "t256_m64_n128_r128_bf16": (256, 64, 128, 128, "bf16"),
    "t128_m64_n128_r128_bf16": (128, 64, 128, 128, "bf16"),
    "t128_m64_n64_r128_fp16": (128, 64, 64, 128, "fp16"),
    "t128_m64_n64_r256_bf16": (128, 64, 64, 256, "bf16"),
    "t256_m64_n128_r128_bf16_s5": (256, 64, 128, 128, "bf16", 5),
    "t128_m64_n128_r128_bf16_s5": (128, 64, 128, 128, "bf16", 5),
    "t256_m64_n256_r128_bf16_s4": (256, 64, 256, 128, "bf16", 4),
    "t256_m64_n256_r128_fp16_s4": (256, 64, 256, 128, "fp16", 4),
}


def build(threads, tile_m, tile_n, rank, dtype, stages=0):
    """The expand of a variant, built (on whatever machine runs this)."""
    import torch

    from punica_numba.kernels import build_staged_mma_expand_kernel

    b_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    return build_staged_mma_expand_kernel(
        threads, tile_m, tile_n, rank // 16, True, b_dtype, stages
    )


def _signature():
    """The expand's argument types as the op passes them: the fp32 buffer, B and the output
    as int64 words, the slices' base and first words, the tile table and the sorted tokens
    (int32), ``add_inputs``."""
    from numba.cuda import types

    def a(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    words = (a(types.int64, 3),) * 3
    return (a(types.float32, 3), *words, a(types.int64, 2), *(types.int64,) * 4,
            a(types.int32, 2), a(types.int32, 1), types.boolean)  # fmt: skip


def main(argv=None) -> None:
    from moe_static import read_builds

    read_builds(VARIANTS, build, _signature, argv)


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
