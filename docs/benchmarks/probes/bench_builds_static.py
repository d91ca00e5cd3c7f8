"""The builds of the benchmark's cases that ran slower than v29's run in the configuration
v29 took, read for sm_90 at this tree or another, without a GPU.

Not a timing. Three of the 40 bf16 cases of ``bench`` took more than 3 % longer at 8cdd36a
than in v29's run (``git show 5d81db4:docs/benchmarks/h200.json``) in the same
configuration: the expand of 256 tokens on one LoRA at r=16 (``mma_t128_m16_n512``, 3.01 ->
3.54 µs), the QKV shrink of 256 tokens each on its own LoRA at r=16 (``rows_t128_m1_n8``,
29.4 -> 32.7) and the expand of 256 tokens over 16 LoRAs at r=64 (``mma_t32_m16_n64``, 5.84
-> 6.05). Each build in ``VARIANTS`` is the kernel one of them launches, with the arguments the
op gives it there; compiled as ``moe_static.py`` compiles (its readings include the PTX's
sha256 with the kernels' names set aside), the same digits at two trees say the kernel's code
did not change between them.

Run from the repository root: ``python docs/benchmarks/probes/bench_builds_static.py [--tree
PATH] [NAME ...]``, ``PATH`` holding another tree's ``punica_numba/`` (``git archive 5d81db4
punica_numba | tar -x -C PATH``), whose package is then the one built. Prints one JSON line
as ``moe_static.py`` does (its ``commit`` is this repository's HEAD, whatever the tree).
"""

import os
import sys

VARIANTS = {  # name: (builder, its arguments)
    # 256 tokens on one LoRA, r=16: 4 warps of 16 column tiles each, one rank step, whole
    # steps, 16-byte output words, whole column groups, 16-byte buffer loads, B in 8-byte
    # words (r=16), one pass, one slot, no asking ahead
    "expand_256_identical_r16": (
        "expand", "float32", 128, 1, 16, 1, True, True, True, True, False, True, True, False,
        False,
    ),
    # 256 tokens over 16 LoRAs, r=64: one warp of 8 column tiles, four rank steps, B in
    # 16-byte words, one pass, asking ahead (one slice), B after the wait (the bare op)
    "expand_256_uniform_r64": (
        "expand", "float32", 32, 1, 8, 4, True, True, True, True, True, True, False, True,
        False,
    ),
    # the QKV shrink of 256 tokens each on its own LoRA, r=16: 128 threads, a token and 8
    # ranks a block, packed words, added into the buffer
    "shrink_256_distinct_qkv_r16": (
        "shrink", "bfloat16", "float32", 128, 1, 8, True, True, False, False,
    ),
}  # fmt: skip


def build(kernel, *args):
    """The kernel of a variant, built from the ``punica_numba`` this process imports."""
    import torch

    from punica_numba.kernels import build_mma_expand_kernel, build_shrink_kernel, expand_mma

    # (the asking expand asks dependent_launch(), which answers for a GPU: the H200's answer)
    expand_mma.dependent_launch = lambda: True
    args = [getattr(torch, a) if a in ("float32", "bfloat16") else a for a in args]
    return {"expand": build_mma_expand_kernel, "shrink": build_shrink_kernel}[kernel](*args)


def _signature(kernel):
    """The kernel's argument types as the op passes them: the expand's fp32 buffer, B and the
    output as int64 words, the slice base and first words, the tile table and each tile's
    rows (one slot: the mapping and the sorted tokens, one row each), ``add_inputs``; the
    shrink's x and A as int64 words, the fp32 buffer, the slice base, the tile table, the
    sorted tokens and the scaling."""
    from numba.cuda import types

    def a(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    words = (a(types.int64, 3),) * 3
    if kernel == "shrink":
        return (a(types.int64, 2), *words, a(types.float32, 3), types.int64, a(types.int32, 2),
                a(types.int32, 1), types.float32)  # fmt: skip
    return lambda ndim: (a(types.float32, 3), *words, a(types.int64, 2), *(types.int64,) * 4,
                         a(types.int32, ndim), a(types.int32, ndim), types.boolean)  # fmt: skip


def main(argv=None) -> None:
    import tempfile

    argv = list(argv if argv is not None else sys.argv[1:])
    if argv[:1] == ["--tree"]:
        sys.path.insert(0, os.path.abspath(argv[1]))  # (before punica_numba is imported)
        argv = argv[2:]
    from moe_static import _compiled, _for_the_h200, print_readings

    _for_the_h200()
    builds = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in argv or list(VARIANTS):
            kernel, *args = VARIANTS[name]
            signature = _signature(kernel)
            if kernel == "expand":  # (one slot: the mapping and the sorted tokens, 1-D)
                signature = signature(1 if args[11] else 2)
            builds[name] = _compiled(build(kernel, *args), signature, name, folder)
    import punica_numba

    print_readings(builds, package=os.path.dirname(punica_numba.__file__))


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
