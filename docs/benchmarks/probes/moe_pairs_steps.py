"""Where MoE LoRA's pairs path spends its time: each launch of version 9's calls of few pairs
a (slot, expert) timed as ``bench --moe`` times the op.

Below :data:`punica_numba.ops.moe.MMA_SHRINK_FROM_PAIRS` pairs a (slot, expert) the op makes
a table of the pairs, then runs the dense op's row shrink and expand on it. The table is
:func:`punica_numba.ops.moe_dense.moe_pairs` (one CUDA block's running sum) up to version 13,
:func:`punica_numba.ops.moe_dense.claimed_pairs` (two launches, runs of entries claiming their
rows) from 14. For every ``bench --moe`` case on that path, this times, on the benchmark's
pool of argument sets (CUDA-graph replays, µs per call):

* ``op`` (``op_v<version>`` for each of ``--versions``): the whole op;
* ``pairs``, ``claimed``: each table alone;
* ``pairs_shrink``, ``claimed_shrink``: each table, then the shrink;

so that the expand is ``op - pairs_shrink`` and the shrink ``pairs_shrink - pairs``. What a
replay costs beyond its kernels is in all of them, and so in the tables (the first step); it
is per argument set, so it weighs more where the pool (recorded) is small.

With ``--path tiles`` the same for the cases of :func:`punica_numba.ops.moe.tiles_from_pairs`
or more pairs a (slot, expert), which take the tiles: ``tiles``, the table of tiles
(:func:`punica_numba.ops.moe_dense.moe_tiles`), and ``tiles_shrink``, then the dense op's
tensor-core shrink (the router's weights in its stores, as the op does from version 9).

    python docs/benchmarks/probes/moe_pairs_steps.py [--json PATH] [--commit C]
        [--cases w2:1:1,...] [--versions 13,14] [--path pairs|tiles]

GPU only.
"""

import argparse
import json

import torch

from punica_numba import bench
from punica_numba.bench_moe import _call, checked_pool, default_cases
from punica_numba.ops.moe import MMA_SHRINK_FROM_PAIRS, pairs_per_block, tiles_from_pairs
from punica_numba.ops.moe_dense import (
    claimed_pairs,
    dense_shrink,
    moe_pairs,
    moe_tiles,
    row_shrink,
)

#: The tables, by the name of their steps, and the shrink each feeds.
TABLES = {
    "pairs": (moe_pairs, row_shrink),
    "claimed": (claimed_pairs, row_shrink),
    "tiles": (moe_tiles, dense_shrink),
}
#: Each path's tables.
PATHS = {"pairs": ("pairs", "claimed"), "tiles": ("tiles",)}
#: The steps timed beside the whole op, as :func:`build`'s arguments.
VARIANTS = {name: (name,) for table in TABLES for name in (table, f"{table}_shrink")}


def build(step: str):
    """``make(case, args)``: the call of the op's launches up to ``step`` on one argument set
    (``pairs``, ``claimed``, ``tiles``: a table; ``pairs_shrink``, ``claimed_shrink``,
    ``tiles_shrink``: the table, then the shrink it feeds)."""
    if step not in VARIANTS:
        raise ValueError(f"step must be one of {sorted(VARIANTS)}, got {step!r}")

    def make(case, args):
        P = case.T * case.top_k
        average = pairs_per_block(P, case.loras, case.experts)
        weights = args["topk_weights"].reshape(-1).to(torch.float32)
        buffer = torch.empty(
            case.slices, P, case.rank, dtype=torch.float32, device=args["x"].device
        )
        x_rows = 1 if case.by_pair else case.top_k
        routed = weights if case.by_pair else None

        table, shrink = TABLES[step.removesuffix("_shrink")]

        def pairs():
            return table(*args["blocks"], args["enabled"], case.block_size, P, case.experts)

        def pairs_shrink():
            shrink(buffer, args["x"], args["lora_a"], pairs(), x_rows, average, routed)

        return pairs_shrink if step.endswith("_shrink") else pairs

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", help="projection:T:loras,... (default: every case of the path)")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the JSON")
    parser.add_argument("--versions", default="13,14", help="the op's versions timed whole")
    parser.add_argument("--path", choices=sorted(PATHS), default="pairs", help="the cases' path")
    opts = parser.parse_args()
    versions = [int(v) for v in opts.versions.split(",")]
    wanted = None
    if opts.cases:
        wanted = {tuple(c.split(":")) for c in opts.cases.split(",")}
    records = []
    for case in default_cases():
        P = case.T * case.top_k
        average = pairs_per_block(P, case.loras, case.experts)
        if opts.path == "pairs":
            on_path = average < MMA_SHRINK_FROM_PAIRS
        else:
            on_path = average >= tiles_from_pairs()
        if not on_path:
            continue
        if wanted and (case.projection, str(case.T), str(case.loras)) not in wanted:
            continue
        first, pool, check = checked_pool(case)
        for version in versions:  # each against the reference first
            check(lambda a, case=case, version=version: _call(case, a, version))
        record = {"projection": case.projection, "T": case.T, "loras": case.loras}
        record["pool"] = len(pool)  # (the argument sets a graph replays: the time is per set)
        for version in versions:
            record[f"op_v{version}"] = bench.time_calls([_call(case, a, version) for a in pool])
        for table in PATHS[opts.path]:
            for step in (table, f"{table}_shrink"):
                record[step] = bench.time_calls([build(step)(case, a) for a in pool])
        records.append({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()})
        print(records[-1], flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            record = {"commit": opts.commit, "gpu": torch.cuda.get_device_name(), "cases": records}
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
