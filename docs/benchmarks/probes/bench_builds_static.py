"""The builds of the benchmark's cases that ran slower than v29's run in the configuration
v29 took, read for sm_90 at this tree or another, without a GPU.

Not a timing. 17 of the 40 bf16 cases of ``bench`` took more than 3 % longer at 8cdd36a than
in v29's run (``git show 5d81db4:docs/benchmarks/h200.json``, at dab1d2e), 12 of them in the
configuration v29 took there. Each build in ``VARIANTS`` is a kernel those 12 launch, with
the arguments the op gives it there (named after a case; the row shrink of 128 threads and 8
ranks serves three, whose rank is not compiled in). Compiled as ``moe_static.py`` compiles
(its readings include the PTX's sha256 with the kernels' names set aside), the same digits at
two trees say the kernel's code did not change between them.

Run from the repository root: ``python docs/benchmarks/probes/bench_builds_static.py [--tree
PATH] [NAME ...]``, ``PATH`` holding another tree's ``punica_numba/`` (``git archive dab1d2e
punica_numba | tar -x -C PATH``), whose package is then the one built. Prints one JSON line
as ``moe_static.py`` does (its ``commit`` is this repository's HEAD, whatever the tree).
"""

import os
import sys

VARIANTS = {  # name: (builder, its arguments)
    # 256 tokens on one LoRA, r=16 (mma_t128_m16_n512): 4 warps of 16 column tiles, one
    # rank step, whole steps, 16-byte output words, whole column groups, 16-byte buffer
    # loads, B in 8-byte words (r=16), one pass, one slot, no asking ahead
    "expand_256_identical_r16": (
        "expand", "float32", 128, 1, 16, 1, True, True, True, True, False, True, True, False,
        False,
    ),
    # 256 tokens over 16 LoRAs, r=64 (mma_t32_m16_n64): one warp of 8 column tiles, four
    # rank steps, B in 16-byte words, one pass, asking ahead (one slice), B after the wait
    # (the bare op)
    "expand_256_uniform_r64": (
        "expand", "float32", 32, 1, 8, 4, True, True, True, True, True, True, False, True,
        False,
    ),
    # 64 tokens over 8 LoRAs, r=16 (mma_t32_m16_n64): the same at one rank step, B in
    # 8-byte words
    "expand_64_uniform_r16": (
        "expand", "float32", 32, 1, 8, 1, True, True, True, True, False, True, False, True,
        False,
    ),
    # 4096 tokens on one LoRA, r=16 (mma_t64_m16_n128_p2): 2 warps of 8 column tiles, two
    # column groups a block, one slot
    "expand_4096_identical_r16": (
        "expand", "float32", 64, 1, 8, 1, True, True, True, True, False, False, True, False,
        False,
    ),
    # 4096 tokens over 64 LoRAs, r=16, one slice (mma_t64_m16_n128_p2)
    "expand_4096_uniform_r16": (
        "expand", "float32", 64, 1, 8, 1, True, True, True, True, False, False, False, False,
        False,
    ),
    # one token, r=64 (lanes_t64_m1_n0): fp32 buffer, bf16 B and output, 64 threads, a
    # token a block, one column a lane group, B packed (16 words a row), 16-byte rows, one
    # slot
    "expand_1_identical_r64": (
        "lanes", "float32", "bfloat16", "bfloat16", 64, 1, 1, True, 16, True, True,
    ),
    # the QKV shrink of 256 tokens each on its own LoRA, r=16 (rows_t128_m1_n8; also the
    # one-slice shrinks of 256 distinct tokens at r=16 and 64): 128 threads, a token and 8
    # ranks a block, packed words, added into the buffer
    "shrink_256_distinct_qkv_r16": (
        "shrink", "bfloat16", "float32", 128, 1, 8, True, True, False, False,
    ),
    # one token on one LoRA (rows_t256_m1_n1, taken as the one-token kernel): 256 threads,
    # x's row of 4096 elements in 1024 words, added
    "shrink_1_identical": ("token", "bfloat16", "float32", 256, 1024, True),
    # 4096 tokens over 64 LoRAs, QKV, r=16 (mma_t128_m32_n0): 4 warps of two 16-token tiles
    # and every rank (two 8-rank tiles), added, 16-byte loads
    "shrink_4096_uniform_qkv_r16": ("mma_shrink", "bfloat16", "float32", 128, 2, 2, True, True),
}  # fmt: skip


def build(kernel, *args):
    """The kernel of a variant, built from the ``punica_numba`` this process imports."""
    import inspect

    import torch

    from punica_numba.kernels import (
        build_lanes_expand_kernel,
        build_mma_expand_kernel,
        build_mma_shrink_kernel,
        build_shrink_kernel,
        build_token_shrink_kernel,
        expand_mma,
    )

    # (the asking expand asks dependent_launch(), which answers for a GPU: the H200's answer)
    expand_mma.dependent_launch = lambda: True
    args = [getattr(torch, a) if a in ("float32", "bfloat16") else a for a in args]
    builder = {
        "expand": build_mma_expand_kernel,
        "lanes": build_lanes_expand_kernel,
        "shrink": build_shrink_kernel,
        "token": build_token_shrink_kernel,
        "mma_shrink": build_mma_shrink_kernel,
    }[kernel]
    # An older builder may take fewer flags (v29's expand had no b_before_the_wait: its
    # asking builds loaded B before the wait); those past its own must be off.
    taken = len(inspect.signature(builder).parameters)
    if any(args[taken:]):
        raise ValueError(f"{builder.__name__} of this tree takes no {args[taken:]}")
    return builder(*args[:taken])


def _signature(kernel, one_slot):
    """The kernel's argument types as the op passes them (the mapping and the sorted tokens
    1-D int32 where a kernel takes its tokens in their own order, ``one_slot``): the
    expands' fp32 buffer, B as int64 words, the output (int64 words on the tensor cores, bf16
    as its int16 bits for the lanes), the slice base and first columns, the tile table or the
    mapping, each tile's rows or the sorted tokens, ``add_inputs``; the shrinks' x and A as
    int64 words, the fp32 buffer, the slice base (and the slice count on the tensor cores),
    the tile table or the mapping, the sorted tokens and the scaling."""
    from numba.cuda import types

    def a(dtype, ndim):
        return types.Array(dtype, ndim, "C")

    words = (a(types.int64, 3),) * 3
    table = a(types.int32, 1 if one_slot else 2)
    if kernel in ("shrink", "token", "mma_shrink"):
        count = (types.int64,) if kernel == "mma_shrink" else ()
        return (a(types.int64, 2), *words, a(types.float32, 3), types.int64, *count, table,
                a(types.int32, 1), types.float32)  # fmt: skip
    out = a(types.int16, 2) if kernel == "lanes" else a(types.int64, 2)
    rows = a(types.int32, 1) if kernel == "lanes" or one_slot else a(types.int32, 2)
    return (a(types.float32, 3), *words, out, *(types.int64,) * 4, table, rows,
            types.boolean)  # fmt: skip


def _one_slot(kernel, args) -> bool:
    """Whether a variant's kernel takes its tokens in their own order (the mapping and the
    sorted tokens, not the tile table): the expands' ``one_slot`` flag, the one-token
    shrink always."""
    if kernel == "expand":
        return args[11]
    if kernel == "lanes":
        return args[-1]
    return kernel == "token"


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
            one_slot = _one_slot(kernel, args)
            signature = _signature(kernel, one_slot)
            builds[name] = _compiled(build(kernel, *args), signature, name, folder)
    import punica_numba

    print_readings(builds, package=os.path.dirname(punica_numba.__file__))


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
