"""Version 6's MoE expand against version 5's, and its shapes against each other.

A probe for the H200, written at 7897e55 and not yet run. Version 6 (``ops.moe``) keeps
version 5's shrinks and takes the expand of :mod:`punica_numba.kernels.moe_expand_outer`: a
chunk of a block's pairs at once, their old outputs asked for together in words, their
buffer rows staged in shared memory, outer products a rank. Its parameters
(``ops.moe.OUTER_EXPAND``) are a first design; the variants below are the shapes to choose
from (name: threads at most, columns a thread, pairs at once, registers held):

* ``vec4_chunk16``, the shipped one: 8-byte words, a block of 16 pairs in one chunk
  (ptxas 13.0 for sm_90, static: 163 registers at w13's 192 threads, r=16);
* ``vec4_chunk8`` and ``vec4_chunk4``: fewer pairs at once, fewer registers (79 at
  chunk 8), more CUDA blocks an SM;
* ``vec8_chunk8``: 16-byte loads and stores, 96 threads for w13's 768 columns (147
  registers);
* ``vec4_chunk16_128``: at most 128 threads (w2's 2048 columns in four groups, not two).

For each case of ``bench --moe`` named on the command line (default: w13 and w2 at 16, 256
and 2048 tokens on 1 and 16 adapters), the op is timed as the benchmark times it
(``bench_moe.run_case``: checked against the reference, then CUDA-graph replays over a
pool larger than the L2) at version 5, then at version 6 with each variant. The shrink is
the same in both versions, so the differences are the expands'.

Run on a GPU from the repository root: ``python docs/benchmarks/probes/moe_outer_expand.py
[--limit SECONDS] [CASE ...]`` (a case as ``w13:2048:16``). Prints one JSON line: per case,
µs of version 5 and of each variant, and each one's relative error.
"""

import argparse
import json
import sys
import time

import torch

from punica_numba import bench, bench_moe
from punica_numba.ops import moe as moe_ops

VARIANTS = {  # name: OuterExpand(threads, vec, chunk, values)
    "vec4_chunk16": (256, 4, 16, 160),
    "vec4_chunk8": (256, 4, 8, 160),
    "vec4_chunk4": (256, 4, 4, 160),
    "vec8_chunk8": (256, 8, 8, 160),
    "vec4_chunk16_128": (128, 4, 16, 160),
}

#: The cases run unless others are named: (projection, tokens, adapters).
CASES = [(p, T, n) for p in ("w13", "w2") for T in (16, 256, 2048) for n in (1, 16)]


def build(*config):
    """The expand a variant launches for Qwen3-30B-A3B's w13 (768 columns a slice, r=16, bf16,
    blocks of 16, 8-byte or 16-byte words of output, add_inputs): its kernel, built."""
    config = moe_ops.OuterExpand(*config)
    threads, chunk = moe_ops.outer_shape(16, 768, 16, config)
    wide = config.vec % 8 == 0
    return moe_ops.outer_expand.build_moe_outer_expand_kernel(
        torch.bfloat16, torch.bfloat16, threads, config.vec, chunk, 16, True, True, wide, True,
        False, True,
    )  # fmt: skip


def _case(text: str) -> bench_moe.MoECase:
    projection, tokens, adapters = text.split(":")
    return bench_moe.MoECase(projection, int(tokens), int(adapters))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", type=_case)
    parser.add_argument("--limit", type=float, default=1e9, help="stop after this many seconds")
    args = parser.parse_args(argv)
    cases = args.cases or [bench_moe.MoECase(*c) for c in CASES]
    bandwidth = bench.copy_bandwidth_tbps()
    shipped, start, rows = moe_ops.OUTER_EXPAND, time.time(), []
    try:
        for case in cases:
            if time.time() - start > args.limit:
                break
            row = {"case": case.name}
            for name, config in [("version_5", None), *VARIANTS.items()]:
                if config is not None:
                    moe_ops.OUTER_EXPAND = moe_ops.OuterExpand(*config)
                record = bench_moe.run_case(case, bandwidth, 5 if config is None else 6)
                row[name] = {"us": record["us"], "relative_error": record["relative_error"]}
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    finally:
        moe_ops.OUTER_EXPAND = shipped
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "cases": rows}))


if __name__ == "__main__":
    main()
