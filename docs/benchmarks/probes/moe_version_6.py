"""Version 6's MoE kernels against version 5's, and their shapes against each other.

A probe for the H200, written at f43fae1 and not yet run (the registers below are those of
the kernels as of the loads ahead in the tensor-core shrink, ``probes/moe_static.py``).
Version 6 (``ops.moe``) keeps version 5's choice between the shrinks, but its tensor-core
shrink takes both slices of w13 in one CUDA block and runs of neighbouring blocks of one
expert in passes of several tiles (``ops.moe.MMA_SHRINK_RUNS``, ``mma_shrink_runs``), a
warp's next chunk of K loaded ahead (``MMA_SHRINK_AHEAD``); its expand is
:mod:`punica_numba.kernels.moe_expand_outer`: a chunk of a block's pairs at once, their old
outputs asked for together in words, their buffer rows staged in shared memory, outer
products a rank (``ops.moe.OUTER_EXPAND``); and all three kernels run on compact grids,
sized to the blocks in use rather than to every slot's bound (``moe_blocks.unit_walker``).
These are first designs; the variants below are the shapes to choose from (ptxas 13.0 for
sm_90, static, registers at r=16):

* expand (threads at most, columns a thread, pairs at once, registers held):
  ``vec4_chunk16``, the shipped one, 8-byte words and a block of 16 pairs in one chunk (156
  registers at w13's 192 threads); ``vec4_chunk8`` (95) and ``vec4_chunk4``, fewer pairs at
  once and more CUDA blocks an SM; ``vec8_chunk8``, 16-byte loads and stores, 96 threads for
  w13's 768 columns (153); ``vec4_chunk16_128``, at most 128 threads (w2's 2048 columns in
  four groups, not two);
* shrink (threads, 16-pair tiles of a pass at most, 8-rank tiles; the shipped one is
  ``(128, 2, 4)``, runs of up to two blocks, each warp's next chunk loaded ahead, 254
  registers with both slices, no spills): ``mma_m4_n4``, runs of four (255 registers, 336
  bytes of spills), ``mma_m1_n4``, one block a unit (180), and ``mma_not_ahead``, the
  shipped shape without the next chunk loaded ahead (``ops.moe.MMA_SHRINK_AHEAD``; 176);
* the split shrink of blocks of few pairs (threads, ranks and pairs of a chunk, strides of
  K whose loads go together; ``ops.moe.SPLIT_SHRINK``, shipped ``(64, 4, 2, 2)``, whose 8
  words of K a thread at K = 2048 go in 4 trips): ``split_u4`` and ``split_u8``, 2 trips
  and 1; ``split_t128_u4``, 128 threads, 1 trip;
* the choice between the expands (``ops.moe.OUTER_EXPAND_FROM_PAIRS``, shipped 1: the
  outer-product one always): ``outer_from_pairs_4``, ``_8`` and ``_16``, version 3's
  expand below that many pairs a block on average, and ``columns_expand``, version 3's
  always; and the split shrink on version 5's grid, not a compact one
  (``ops.moe.COMPACT_SPLIT_SHRINK``): ``split_full_grid``;
* version 6's tensor-core shrink where its units are single blocks (fewer than 32 pairs a
  block): ``mma_apart``, each slice of w13 in CUDA blocks of its own (``ops.moe.MMA_SHRINK_JOINT``),
  and ``mma_full_grid``, version 5's grid, not a compact one
  (``ops.moe.COMPACT_SINGLE_BLOCK_MMA_SHRINK``); since f166693 the shipped shape is version 5's
  grid, so ``mma_not_ahead`` is version 6's shrink on version 5's grid without the loads
  ahead, and ``mma_apart_not_ahead`` (two settings at once) is also without the joint slices:
  at w13 2048 / 16 version 6 then calls the builder with version 5's own arguments (read by
  ``moe_static.bench_builds`` at c368da8), so it times version 5's shrink through version 6's
  choices, a control on the probe: what version 6's shrink adds there is the joint slices and
  the loads ahead alone;
* the choice between the shrinks (``ops.moe.MMA_SHRINK_FROM_PAIRS``, shipped 4 pairs a
  (slot, expert) block on average, a point between version 4's measured 1 and 8):
  ``from_pairs_1``, the tensor cores wherever the operands allow, and ``from_pairs_16``.

For each case of ``bench --moe`` named on the command line (default: ``CASES``, w13 and w2
at 16, 64, 256 and 2048 tokens on 1 and 16 adapters, the furthest from the aim first), the
op is timed as the benchmark times it (each run checked against the float64 reference on the
first argument set, then CUDA-graph replays over a pool larger than the L2:
``bench_moe.checked_pool``, one pool for all the runs of a case) at version 5, at version 6
as shipped, then at version 6 with each variant in place of the shipped shape of its kernel
(or those named by ``--variants``). With ``--kernels``, each run also records its kernels'
device µs a call by name (``torch.profiler``, the pool's calls once each, eagerly).

Run on a GPU from the repository root: ``python docs/benchmarks/probes/moe_version_6.py
[--limit SECONDS] [--variants NAME,...] [--kernels] [CASE ...]`` (a case as
``w13:2048:16``). Prints one JSON line: per case,
µs of each and its relative error.
"""

import argparse
import contextlib
import json
import re
import sys
import time

import torch

from punica_numba import bench, bench_moe
from punica_numba.ops import moe as moe_ops

VARIANTS = {  # name: (kernel, its shape's fields)
    "vec4_chunk16": ("expand", 256, 4, 16, 160),
    "vec4_chunk8": ("expand", 256, 4, 8, 160),
    "vec4_chunk4": ("expand", 256, 4, 4, 160),
    "vec8_chunk8": ("expand", 256, 8, 8, 160),
    "vec4_chunk16_128": ("expand", 128, 4, 16, 160),
    "mma_m4_n4": ("shrink", 128, 4, 4),
    "mma_m1_n4": ("shrink", 128, 1, 4),
    "mma_not_ahead": ("ahead", False),
    "split_u4": ("split", 64, 4, 2, 4),
    "split_u8": ("split", 64, 4, 2, 8),
    "split_t128_u4": ("split", 128, 4, 2, 4),
    "from_pairs_1": ("threshold", 1),
    "from_pairs_16": ("threshold", 16),
    "outer_from_pairs_4": ("outer_from", 4),
    "outer_from_pairs_8": ("outer_from", 8),
    "outer_from_pairs_16": ("outer_from", 16),
    "columns_expand": ("outer_from", 1 << 30),
    "split_full_grid": ("compact_split", False),
    "mma_apart": ("joint", False),
    "mma_full_grid": ("compact_single", False),
    "mma_apart_not_ahead": (("joint", False), ("ahead", False)),
}

#: Each kernel's knob in ``ops.moe`` and the type of its shape.
KNOBS = {
    "expand": ("OUTER_EXPAND", moe_ops.OuterExpand),
    "shrink": ("MMA_SHRINK_RUNS", moe_ops.MmaShrink),
    "split": ("SPLIT_SHRINK", moe_ops.SplitShrink),
    "threshold": ("MMA_SHRINK_FROM_PAIRS", int),
    "ahead": ("MMA_SHRINK_AHEAD", bool),
    "outer_from": ("OUTER_EXPAND_FROM_PAIRS", int),
    "compact_split": ("COMPACT_SPLIT_SHRINK", bool),
    "joint": ("MMA_SHRINK_JOINT", bool),
    "compact_single": ("COMPACT_SINGLE_BLOCK_MMA_SHRINK", bool),
}


def settings(variant) -> list[tuple]:
    """A variant's knob settings: one ``(kernel, *shape)``, or a tuple of them together."""
    return list(variant) if isinstance(variant[0], tuple) else [variant]


@contextlib.contextmanager
def knobs_set(variant):
    """``ops.moe``'s knobs as shipped but for the variant's (none for ``None``), put back
    after."""
    shipped = {name: getattr(moe_ops, name) for name, _ in KNOBS.values()}
    try:
        for kernel, *shape in settings(variant) if variant else ():
            name, kind = KNOBS[kernel]
            setattr(moe_ops, name, kind(*shape))
        yield
    finally:
        for name, value in shipped.items():
            setattr(moe_ops, name, value)


#: The cases run unless others are named: (projection, tokens, adapters), w13 and w2 at 16,
#: 64, 256 and 2048 tokens on 1 and 16 adapters, those where version 5 is furthest from the
#: aim first (its time over vLLM 0.33's, h200_moe_v5.json over h200_moe_vllm_0.33.json: 1.85x
#: down to 0.56x), so that a run cut short by ``--limit`` has the ones that matter most.
CASES = [
    ("w13", 2048, 1), ("w2", 2048, 1), ("w13", 256, 1), ("w2", 256, 1), ("w13", 16, 16),
    ("w13", 64, 1), ("w2", 64, 1), ("w2", 64, 16), ("w2", 16, 16), ("w13", 64, 16),
    ("w13", 256, 16), ("w2", 256, 16), ("w2", 16, 1), ("w13", 16, 1), ("w2", 2048, 16),
    ("w13", 2048, 16),
]  # fmt: skip


def build(kernel, *config):
    """The kernel a variant launches for Qwen3-30B-A3B's w13 at 2048 tokens on one adapter
    (768 columns and K = 2048, r=16, bf16, blocks of 16, add_inputs), built; of a variant of
    several settings, the last one's kernel with the others set."""
    if isinstance(kernel, tuple):
        *others, last = (kernel, *config)
        with knobs_set(tuple(others)):
            return build(*last)
    if kernel == "threshold":  # the kernel a lower threshold lets run
        return build("shrink", *moe_ops.MMA_SHRINK_RUNS)
    if kernel == "outer_from":  # the expand a threshold lets run where blocks are full
        return build("expand", *moe_ops.OUTER_EXPAND)
    if kernel == "compact_split":  # the split shrink on a compact grid, or on version 5's
        walk = (1,) if config[0] else ()
        return moe_ops.split_shrink.build_moe_split_shrink_kernel(
            torch.bfloat16, *moe_ops.SPLIT_SHRINK, True, config[0], *walk
        )
    ahead = moe_ops.MMA_SHRINK_AHEAD
    if kernel in ("joint", "compact_single"):  # 256 tokens: units of one block
        slices = 1 if kernel == "joint" else 2  # apart: a block holds one slice's ranks
        config = moe_ops.MMA_SHRINK_RUNS
        shape = moe_ops.mma_shrink_runs(256 * 8, 1, 128, 16, slices, 16, config)
        m_tiles, n_tiles, blocks, joint = shape
        return moe_ops.mma_shrink.build_moe_mma_shrink_kernel(
            torch.bfloat16, config.threads, m_tiles, n_tiles, True, blocks, joint,
            kernel != "compact_single", 1, ahead,
        )  # fmt: skip
    if kernel == "ahead":  # the shipped shrink, its next chunk loaded ahead or not
        kernel, config, ahead = "shrink", moe_ops.MMA_SHRINK_RUNS, config[0]
    if kernel == "split":
        return moe_ops.split_shrink.build_moe_split_shrink_kernel(
            torch.bfloat16, *config, True, True
        )
    if kernel == "shrink":
        config = moe_ops.MmaShrink(*config)
        shape = moe_ops.mma_shrink_runs(2048 * 8, 1, 128, 16, 2, 16, config)
        m_tiles, n_tiles, blocks, joint = shape
        return moe_ops.mma_shrink.build_moe_mma_shrink_kernel(
            torch.bfloat16, config.threads, m_tiles, n_tiles, True, blocks, joint, True, 1, ahead
        )
    config = moe_ops.OuterExpand(*config)
    threads, chunk = moe_ops.outer_shape(16, 768, 16, config)
    wide = config.vec % 8 == 0
    return moe_ops.outer_expand.build_moe_outer_expand_kernel(
        torch.bfloat16, torch.bfloat16, threads, config.vec, chunk, 16, True, True, wide, True,
        False, True,
    )  # fmt: skip


def kernel_times(calls) -> dict[str, float]:
    """Device µs a call of each kernel the calls launch (by its Python name), each call
    once, eagerly, under ``torch.profiler``."""
    from punica_numba.profile import kernel_table, one_cycle_profiler

    torch.cuda.synchronize()
    with one_cycle_profiler([torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for call in calls:
            call()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for name, us, _ in kernel_table(profiler.events()):
        short = re.search(r"moe_[a-z_]+", name)
        key = short.group(0) if short else name[:40]
        times[key] = round(times.get(key, 0.0) + us / len(calls), 3)
    return times


def _case(text: str) -> bench_moe.MoECase:
    projection, tokens, adapters = text.split(":")
    return bench_moe.MoECase(projection, int(tokens), int(adapters))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", type=_case)
    parser.add_argument("--limit", type=float, default=1e9, help="stop after this many seconds")
    parser.add_argument("--variants", help="comma-separated names of VARIANTS (default: all)")
    parser.add_argument("--kernels", action="store_true", help="device µs of each kernel")
    args = parser.parse_args(argv)
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    cases = args.cases or [bench_moe.MoECase(*c) for c in CASES]
    bandwidth = bench.copy_bandwidth_tbps()
    runs = [("version_5", 5, None), ("version_6", 6, None)]
    runs += [(name, 6, VARIANTS[name]) for name in chosen]
    start, rows = time.time(), []
    for case in cases:
        if time.time() - start > args.limit:
            break
        _, pool, check = bench_moe.checked_pool(case)  # one pool for every run of the case
        row = {"case": case.name}
        for name, version, variant in runs:

            def make_call(args, case=case, version=version):
                return bench_moe._call(case, args, version)

            with knobs_set(variant):  # the shipped shapes but for the variant's
                error = check(make_call)
                us = bench.time_calls([make_call(args) for args in pool])
                row[name] = {"us": round(us, 3), "relative_error": error}
                if args.kernels:
                    row[name]["kernels"] = kernel_times([make_call(args) for args in pool])
        rows.append(row)
        del pool
        torch.cuda.empty_cache()
        print(row, file=sys.stderr, flush=True)
    print(
        json.dumps(
            {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_tbps": bandwidth, "cases": rows}
        )
    )


if __name__ == "__main__":
    main()
