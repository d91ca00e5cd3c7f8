"""MoE LoRA's calls of 4 to 16 pairs a (slot, expert) on average, under version 6's kernels
(as shipped: ``ops.moe.DENSE_FROM_PAIRS`` = 16) and under the dense op's tiles (the
threshold lowered), timed as ``bench --moe`` times the op.

Below ``DENSE_FROM_PAIRS`` pairs a (slot, expert) the op's default version runs version 6's
tensor-core shrink and outer-product expand; from it, the dense op's 16-pair tiles
(``ops.moe_dense``). The threshold was set at cb9702d against version 7's tiles, which
have since taken version 9's row kernels, the tuned MoE entries and, on a GPU without a
table, the 4-warp shrink. For each case this checks the op's result under each threshold
against the reference and times both on one pool of argument sets (CUDA-graph replays, µs
per call), ``--rounds`` times, alternating, keeping each one's least time.

    python docs/benchmarks/probes/moe_dense_from_pairs.py [--json PATH] [--commit C]
        [--rounds N] [--ranks 16,64] [--thresholds 4,8] [--cases w13:64:1,...]

The cases (default): both projections of ``bench --moe``'s layer (Qwen3-30B-A3B's, bf16)
at every token count from 64 to 2048 and 1, 4 or 16 adapters whose pairs a (slot, expert)
are 4 to 16 on average. GPU only.
"""

import argparse
import json

import torch

from punica_numba import bench
from punica_numba.bench_moe import MoECase, _call, checked_pool
from punica_numba.ops import moe as moe_ops

#: No kernels of its own: it times the package's.
VARIANTS: dict = {}

TOKENS = (64, 128, 256, 512, 1024, 2048)
LORAS = (1, 4, 16)


def _cases(ranks, named) -> list[MoECase]:
    if named:
        shapes = [(p, int(T), int(n)) for p, T, n in (c.split(":") for c in named.split(","))]
    else:
        shapes = [(p, T, n) for p in ("w13", "w2") for T in TOKENS for n in LORAS]
    cases = []
    for rank in ranks:
        for p, T, n in shapes:
            case = MoECase(p, T, n, rank=rank)
            average = moe_ops.pairs_per_block(T * case.top_k, n, case.experts)
            if named or moe_ops.MMA_SHRINK_FROM_PAIRS <= average < moe_ops.DENSE_FROM_PAIRS:
                cases.append(case)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", help="projection:T:loras,... (default: module docstring)")
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--thresholds", default="4", help="DENSE_FROM_PAIRS values to try")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (least kept)")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the JSON")
    opts = parser.parse_args()
    shipped = moe_ops.DENSE_FROM_PAIRS
    sides = [shipped] + [int(t) for t in opts.thresholds.split(",")]
    records = []
    for case in _cases([int(r) for r in opts.ranks.split(",")], opts.cases):
        first, pool, check = checked_pool(case)
        record = {"projection": case.projection, "T": case.T, "loras": case.loras}
        record |= {"rank": case.rank, "pool": len(pool)}
        times = {}
        try:
            for side in sides:
                moe_ops.DENSE_FROM_PAIRS = side
                record[f"error_{side}"] = check(lambda a, case=case: _call(case, a))
            for _ in range(opts.rounds):
                for side in sides:
                    moe_ops.DENSE_FROM_PAIRS = side
                    us = bench.time_calls([_call(case, a) for a in pool])
                    times[side] = min(times.get(side, us), us)
        finally:
            moe_ops.DENSE_FROM_PAIRS = shipped
        record["us"] = {str(side): round(us, 3) for side, us in times.items()}
        record["ratio"] = {str(s): round(times[s] / times[shipped], 3) for s in sides[1:]}
        records.append(record)
        print(record, flush=True)
        if opts.json:  # (after each case: a time limit keeps those done)
            with open(opts.json, "w") as f:
                doc = {"commit": opts.commit, "gpu": torch.cuda.get_device_name()}
                json.dump(doc | {"shipped": shipped, "cases": records}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
