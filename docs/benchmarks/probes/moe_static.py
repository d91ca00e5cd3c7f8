"""The MoE kernels' registers and SASS for the H200, compiled on a machine without a GPU.

Not a timing: a static reading of what the compiler makes of each kernel, the figures of the
lab notes' "MoE LoRA version 6, built" (``docs/benchmarks/lab_notes.md``).
Each build in ``VARIANTS`` (Qwen3-30B-A3B's layer, r=16 unless named, bf16; compact grids
whose walk reads eight slots' counts at once, one slot's where named ``one_slot``) is compiled by
numba-cuda's NVVM to PTX for ``sm_90`` (``cuda.compile_ptx``, which needs no GPU), then by
``ptxas -arch=sm_90a -v`` (registers, spills) and disassembled by ``cuobjdump -sass``
(instructions). Where the kernel asks the device whether dependent launches exist, and Numba
which device it compiles for, the H200's answers are given (``sm_90``, yes).

Needs, besides the package: ``ptxas`` (the CUDA toolkit's, or the ``nvidia-cuda-nvcc`` wheel's)
and ``cuobjdump`` (the toolkit's, or the ``nvidia-cuda-cuobjdump`` wheel's, which from 13.2 on
calls ``nvdisasm``: the ``nvidia-cuda-nvdisasm`` wheel's) on ``PATH``, and an
NVRTC library numba-cuda can load (the ``nvidia-cuda-nvrtc`` wheel's ``lib`` folder on
``LD_LIBRARY_PATH``, with ``CUDA_HOME`` set). The figures of the notes were made with ptxas
13.0 and NVRTC 13.0, disassembled by cuobjdump 13.0 and later by cuobjdump 13.2 with nvdisasm
13.5 (the same counts for the same code).

Run from the repository root: ``python docs/benchmarks/probes/moe_static.py [NAME ...]``.
Prints one JSON line: the commit and ptxas's version, and for each build its PTX's sha256
(16 digits, the kernels' mangled names set aside and the shared arrays numbered in order:
equal digits, the same code), registers, spill and stack bytes, shared memory, and its SASS
instructions with the counts of its loads, stores, products, shuffles and barriers by kind
(``sm90_moe_static.json`` beside the benchmarks is its output, from before the sha256 was
read).

``python docs/benchmarks/probes/moe_static.py --bench VERSION`` reads instead every kernel
``fused_moe_lora(version=VERSION)`` launches for the 30 cases of ``bench --moe``, found by
running the op on host tensors with its launches recorded, not made (``bench_builds``), and
adds which builds each case launches: that they all compile for sm_90, and with how many
registers, is known before a GPU times them (``sm90_moe_v6_builds.json``). ``--shapes
VERSION`` does the same for :data:`OTHER_SHAPES` (``sm90_moe_v6_other_shapes.json``).
"""

import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

VARIANTS = {  # name: (kernel, its builder's arguments past the dtypes)
    "columns_expand_w13": ("columns", 128, 4, 2, 16, True, True, False, True),
    "outer_expand_w13": ("outer", 192, 4, 16, 16, True, True, False, True, False, True),
    "outer_expand_w13_chunk8": ("outer", 192, 4, 8, 16, True, True, False, True, False, True),
    "outer_expand_w13_vec8": ("outer", 96, 8, 8, 16, True, True, True, True, False, True),
    "outer_expand_w2": ("outer", 256, 4, 16, 16, True, True, False, True, True, True),
    "outer_expand_w13_r64": ("outer", 192, 4, 16, 64, True, True, False, True, False, True),
    "outer_expand_w13_r64_chunk8": ("outer", 192, 4, 8, 64, True, True, False, True, False, True),
    "outer_expand_w2_r64": ("outer", 256, 4, 16, 64, True, True, False, True, True, True),
    "outer_expand_w13_one_slot": ("outer", 192, 4, 16, 16, True, True, False, True, False, True, 1),
    "mma_shrink_version_5": ("mma", 128, 1, 2, True),
    "mma_shrink_runs_1": ("mma", 128, 1, 4, True, 1, True, True),
    "mma_shrink_runs_2": ("mma", 128, 2, 4, True, 2, True, True),
    "mma_shrink_runs_4": ("mma", 128, 4, 4, True, 4, True, True),
    "mma_shrink_runs_2_one_slot": ("mma", 128, 2, 4, True, 2, True, True, 1),
    "mma_shrink_runs_1_ahead": ("mma", 128, 1, 4, True, 1, True, True, 8, True),
    "mma_shrink_runs_2_ahead": ("mma", 128, 2, 4, True, 2, True, True, 8, True),
    "mma_shrink_runs_4_ahead": ("mma", 128, 4, 4, True, 4, True, True, 8, True),
    "split_shrink_version_5": ("split", 64, 4, 2, 2, True),
    "split_shrink_compact": ("split", 64, 4, 2, 2, True, True),
    # version 11's one launch: threads, tile_n, tile_p, unroll, splits, vec, rank, packed x and A,
    # packed B, weighted (w2), add_inputs, compact, slots at once
    "fused_w13": ("fused", 128, 4, 2, 2, 1, 4, 16, True, True, False, True, True, 1),
    "fused_w2": ("fused", 128, 4, 2, 2, 1, 4, 16, True, True, True, True, True, 1),
    "fused_w2_full_grid": ("fused", 128, 4, 2, 2, 1, 4, 16, True, True, True, True, False, 1),
    "fused_w13_r64": ("fused", 128, 4, 2, 2, 1, 1, 64, True, True, False, True, True, 1),
    # its shipped loads of four strides, and moe_fused_ab's chunks of 4 and 8 pairs and 8
    # columns a thread (the leads for its calls past 8 tokens)
    "fused_w2_u4": ("fused", 128, 4, 2, 4, 1, 4, 16, True, True, True, True, True, 1),
    "fused_w2_u4_p4": ("fused", 128, 4, 4, 4, 1, 4, 16, True, True, True, True, True, 1),
    "fused_w2_u4_p8": ("fused", 128, 4, 8, 4, 1, 4, 16, True, True, True, True, True, 1),
    "fused_w2_u4_v8": ("fused", 128, 4, 2, 4, 1, 8, 16, True, True, True, True, True, 1),
    "fused_w2_u4_p4_v8": ("fused", 128, 4, 4, 4, 1, 8, 16, True, True, True, True, True, 1),
    "fused_w13_u4_p4_v8": ("fused", 128, 4, 4, 4, 1, 8, 16, True, True, False, True, True, 1),
    # the compact grid's walk over the slots, 8 (as shipped for 8 slots or more) or 16 at once
    "fused_w2_u4_walk8": ("fused", 128, 4, 2, 4, 1, 4, 16, True, True, True, True, True, 8),
    "fused_w2_u4_walk16": ("fused", 128, 4, 2, 4, 1, 4, 16, True, True, True, True, True, 16),
}


def build(kernel, *args):
    """The kernel of a variant, built (on whatever machine runs this: a GPU, the simulator,
    or, from :func:`main`, the compiler alone)."""
    import torch

    from punica_numba.kernels import (
        moe_expand_columns,
        moe_expand_outer,
        moe_fused,
        moe_shrink_mma,
        moe_shrink_split,
    )

    bf16 = torch.bfloat16
    if kernel == "columns":
        return moe_expand_columns.build_moe_columns_expand_kernel(bf16, bf16, *args)
    if kernel == "outer":
        return moe_expand_outer.build_moe_outer_expand_kernel(bf16, bf16, *args)
    if kernel == "mma":
        return moe_shrink_mma.build_moe_mma_shrink_kernel(bf16, *args)
    if kernel == "fused":
        return moe_fused.build_moe_fused_kernel(bf16, bf16, *args)
    return moe_shrink_split.build_moe_split_shrink_kernel(bf16, *args)


def _signature(kernel, types):
    """The kernel's argument types as the op passes them (int64 words of x, A and B; int32
    metadata; an fp32 buffer; bf16 outputs as int16, or as int64 words)."""

    def a(dtype, ndim):  # a C-contiguous array
        return types.Array(dtype, ndim, "C")

    meta = (a(types.int32, 2), a(types.int32, 2), a(types.int32, 1), a(types.int32, 1))
    if kernel == "fused":
        words = a(types.int64, 4)
        return (a(types.int64, 2), words, words, words, words, a(types.int16, 2),
                a(types.float32, 1), *meta, types.int64, types.int64, types.boolean,
                types.int64)  # fmt: skip
    if kernel in ("columns", "outer"):
        out = a(types.int16 if kernel == "columns" else types.int64, 2)
        weights = (a(types.float32, 1),)
        return (a(types.float32, 3), a(types.int64, 4), a(types.int64, 4), out, *weights, *meta,
                types.int64, types.int64)  # fmt: skip
    return (a(types.int64, 2), a(types.int64, 4), a(types.int64, 4), a(types.float32, 3), *meta,
            types.int64, types.int64, types.boolean)  # fmt: skip


def _for_the_h200():
    """numba-cuda and the package, answering for an H200 where no GPU is there to ask."""
    from types import SimpleNamespace

    import numba.cuda.dispatcher

    import punica_numba._cuda
    from punica_numba.kernels import dependent_launch
    from punica_numba.tuning import table

    numba.cuda.dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
    punica_numba._cuda.dependent_launch = lambda: True
    dependent_launch.dependent_launch = lambda: True
    table.gpu_name = lambda: "NVIDIA H200"  # (its tuned table: the dense op's picks there)
    from punica_numba.ops import moe as moe_ops

    moe_ops._multiprocessors = lambda index: 132  # (the one launch's grid, from version 11)


def _reading(name, folder):
    """Registers, memory and SASS of one variant."""
    from numba.cuda import types

    kernel, *args = VARIANTS[name]
    return _compiled(build(kernel, *args), _signature(kernel, types), name, folder)


def _compiled(kernel, signature, name, folder):
    """Registers, memory and SASS of ``kernel`` (a built kernel) for these argument types, as
    the launcher runs it: where the kernel has a register ceiling that the compiler's own
    count passes (``punica_numba._cuda.jit_kernel``), compiled again under it (ptxas's
    ``-maxrregcount``), with the count it passed as ``registers_uncapped``."""
    from numba import cuda

    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=(9, 0))
    path = os.path.join(folder, name)
    with open(path + ".ptx", "w") as f:
        f.write(ptx)

    def ptxas(*options):
        return subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", *options, path + ".ptx", "-o", path + ".cubin"],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip

    def number(pattern, report):
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    report, uncapped = ptxas(), {}
    ceiling = getattr(kernel, "register_ceiling", None)
    if ceiling is not None and number(r"Used (\d+) registers", report) > ceiling.registers:
        uncapped = {"registers_uncapped": number(r"Used (\d+) registers", report)}
        report = ptxas(f"-maxrregcount={ceiling.registers}")
    sass = subprocess.run(
        ["cuobjdump", "-sass", path + ".cubin"], capture_output=True, text=True, check=True
    ).stdout
    lines = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?(\S+)", sass)]
    kinds = collections.Counter(
        op for op in lines if re.match(r"(LDG|STG|LDS|STS|LDL|STL|FFMA|HMMA|SHFL|BAR)", op)
    )
    # The kernels' mangled names set aside, and the shared arrays numbered in the order they
    # appear (Numba numbers them across the process: the builds compiled before count).
    unnamed, arrays = re.sub(r"_Z[A-Za-z0-9_]*", "", ptx), {}
    unnamed = re.sub(
        r"_cudapy_smem_\d+", lambda m: f"smem{arrays.setdefault(m[0], len(arrays))}", unnamed
    )
    return {
        "ptx_sha256": hashlib.sha256(unnamed.encode()).hexdigest()[:16],
        "registers": number(r"Used (\d+) registers", report),
        **uncapped,
        "spill_store_bytes": number(r"(\d+) bytes spill stores", report),
        "stack_frame_bytes": number(r"(\d+) bytes stack frame", report),
        "shared_bytes": number(r"(\d+) bytes smem", report),
        "sass_instructions": len(lines),
        "kinds": dict(sorted(kinds.items())),
    }


def _argument_type(value, types):
    """The Numba type a kernel is compiled for, of one argument as the op passes it to the
    launcher (``punica_numba._cuda.KernelLauncher``: bf16 tensors as their int16 bits)."""
    import numpy as np
    import torch

    if isinstance(value, bool):
        return types.boolean
    if isinstance(value, int):
        return types.int64
    if isinstance(value, np.floating):
        return types.float32
    dtype = torch.int16 if value.dtype == torch.bfloat16 else value.dtype
    element = getattr(types, str(dtype).removeprefix("torch."))  # float32, int64, ...
    return types.Array(element, value.ndim, "C" if value.is_contiguous() else "A")


#: Shapes beside the benchmark's, one or two things changed from Qwen3-30B-A3B's layer (r=16,
#: bf16, hidden 2048, intermediate 768, 128 experts, top-8, blocks of 16): other ranks and
#: dtypes, a larger model, other block sizes, Mixtral's few experts; each at 16 tokens over 4
#: adapters, 256 and 2048 on one (``--shapes``).
OTHER_SHAPES = (
    dict(dtype="fp16"),
    dict(rank=32),
    dict(rank=64),
    dict(rank=64, dtype="fp16"),
    dict(rank=8, block_size=32),
    dict(hidden=4096, intermediate=1536, experts=64),
    dict(block_size=64),
    dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
)


def other_cases():
    """The cases of :data:`OTHER_SHAPES`, both projections."""
    from punica_numba.bench_moe import MoECase

    return [
        MoECase(projection, T, loras, **shape)
        for shape in OTHER_SHAPES
        for projection in ("w13", "w2")
        for T, loras in ((16, 4), (256, 1), (2048, 1))
    ]


def bench_builds(version, cases=None):
    """``(kernels, cases)``: every kernel ``fused_moe_lora(version=version)`` launches for
    ``cases`` (default: those of ``bench --moe``, at Qwen3-30B-A3B's shape), as the H200
    would build them, with no GPU: the op runs on host tensors with its launches recorded,
    not made.
    ``kernels[key] = (kernel, signature)``, the key naming the builder and its arguments
    (and, for a kernel launched with other argument types too, a number);
    ``cases[case name] = [key, ...]`` in launch order."""
    import functools

    import torch
    from numba.cuda import types

    import punica_numba._checks
    from punica_numba import bench_moe
    from punica_numba.ops import choice, moe_dense, operands
    from punica_numba.ops import moe as moe_ops

    punica_numba._checks.SIMULATOR = True  # (host tensors pass the op's checks)
    operands.SIMULATOR = True  # (the dense op's weights as tensors, not launch descriptors)
    built = {}  # id of a kernel -> the builder's name and arguments

    def recording(builder):
        @functools.cache
        def recorded(*args, **options):
            kernel = builder(*args, **options)
            built[id(kernel)] = f"{builder.__name__}{args}{options or ''}"
            return kernel

        return recorded

    for module in (moe_ops.columns_expand, moe_ops.mma_expand, moe_ops.outer_expand,
                   moe_ops.mma_shrink, moe_ops.split_shrink, moe_ops.tiled_shrink,
                   choice, moe_dense):  # fmt: skip
        for name in [n for n in dir(module) if n.startswith("build_")]:
            setattr(module, name, recording(getattr(module, name)))
    launched = []

    def recorded_launch(kernel):
        return lambda grid, block, args: launched.append((kernel, args))

    for module in (moe_ops, moe_dense):  # (versions 7 to 9 launch the dense op's kernels)
        module.launcher_of = recorded_launch
    kernels, found = {}, {}
    for case in cases if cases is not None else bench_moe.default_cases():
        args = bench_moe.argument_set(case, torch.Generator().manual_seed(0), "cpu")
        launched.clear()
        bench_moe._call(case, args, version=version)()
        case_name = case.name if cases is None else f"{case.name} {_changed(case)}"
        found[case_name] = []
        for kernel, arguments in launched:
            signature = tuple(_argument_type(a, types) for a in arguments)
            name = key = built.get(id(kernel), kernel.py_func.__qualname__)
            other = 1
            while key in kernels and kernels[key] != (kernel, signature):
                other += 1
                key = f"{name} #{other}"
            kernels[key] = (kernel, signature)
            found[case_name].append(key)
    return kernels, found


def _changed(case):
    """What a case changes from the benchmark's shape, as ``name=value`` words."""
    from dataclasses import MISSING, fields

    return " ".join(
        f"{f.name}={getattr(case, f.name)}"
        for f in fields(case)
        if f.default is not MISSING and getattr(case, f.name) != f.default
    )


def _output(command):
    """A command's standard output, stripped (None where it cannot run)."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> None:
    argv = argv if argv is not None else sys.argv[1:]
    _for_the_h200()
    found = {}
    with tempfile.TemporaryDirectory() as folder:
        if argv[:1] in (["--bench"], ["--shapes"]):  # every build a version launches
            shapes = other_cases() if argv[0] == "--shapes" else None
            kernels, cases = bench_builds(int(argv[1]), shapes)
            builds = {
                key: _compiled(kernel, signature, f"build{i}", folder)
                for i, (key, (kernel, signature)) in enumerate(kernels.items())
            }
            found = {"version": int(argv[1]), "cases": cases}
        else:
            builds = {name: _reading(name, folder) for name in argv or list(VARIANTS)}
    print_readings(builds, **found)


def read_builds(variants, build, signature, argv=None, per_variant=False) -> None:
    """A static probe's ``main``: each build of ``variants`` named in ``argv`` (default: the
    command line's, else all), built by ``build`` and compiled for ``signature()``'s types
    (``per_variant``: ``signature(*arguments)``, the variant's own), its readings printed
    (:func:`print_readings`)."""
    names = (argv if argv is not None else sys.argv[1:]) or list(variants)
    _for_the_h200()
    with tempfile.TemporaryDirectory() as folder:
        builds = {}
        for name in names:
            types = signature(*variants[name]) if per_variant else signature()
            builds[name] = _compiled(build(*variants[name]), types, name, folder)
    print_readings(builds)


def print_readings(builds, **more):
    """One JSON line: the commit, ptxas's version, ``more``, and the builds' readings."""
    ptxas = _output(["ptxas", "--version"])
    commit = _output(["git", "rev-parse", "--short", "HEAD"])
    version = ptxas.splitlines()[-1] if ptxas else None
    print(json.dumps({"commit": commit, "ptxas": version, **more, "builds": builds}))


if __name__ == "__main__":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for the GPU, with or without one
    main()
