"""MoE LoRA's one launch (version 11) beside version 9, on the ``bench --moe`` cases it takes
(at most ``FUSED_TO_PAIRS`` pairs; with ``--cases``, the cases named; with ``--tokens``, the
layer at those token counts over 1, 4 and 16 adapters), timed as ``bench --moe`` times the op.
A case of more pairs than ``FUSED_TO_PAIRS`` is taken by the one launch all the same (the
threshold raised to its pairs while version 11 is checked and timed), to see the crossing.

Version 11 differs from 9 only there: where 9 makes the table of pairs and launches the
dense op's row shrink and expand, 11 launches :mod:`punica_numba.kernels.moe_fused` once.
For each such case this checks both versions' results against the reference
and times, on one pool of argument sets (CUDA-graph replays, µs per call), version 9, then
version 11 under each configuration of :data:`VARIANTS` (the shipped ``FUSED_PAIRS`` first),
``--rounds`` times, alternating, keeping each one's least time. ``--against V`` sets another
version's pairs path beside the one launch instead of version 9's (from version 13 its own
one launch moved aside, its limits at 0 while it runs; the record's ``v<V>``):
version 14's pairs path has a faster table than version 9's.

    python docs/benchmarks/probes/moe_fused_ab.py [--json PATH] [--commit C] [--rounds N]
        [--variants shipped,t256_n8,...] [--cases w2:1:1,...] [--tokens 2,4,8] [--against 14]

GPU only.
"""

import argparse
import contextlib
import json

import torch

from punica_numba import bench
from punica_numba.bench_moe import LORAS, MoECase, _call, checked_pool, default_cases
from punica_numba.kernels import moe_blocks, moe_fused
from punica_numba.ops import moe as moe_ops
from punica_numba.ops.moe import FUSED_TO_PAIRS, FusedPairs

#: Version 11's configurations timed: name -> FusedPairs (threads, tile_n, tile_p, unroll,
#: splits, vec, values, full_grid_blocks).
VARIANTS = {
    "shipped": moe_ops.FUSED_PAIRS,
    "compact": moe_ops.FUSED_PAIRS._replace(full_grid_blocks=0),
    "full_grid": moe_ops.FUSED_PAIRS._replace(full_grid_blocks=1 << 30),
    "u2": moe_ops.FUSED_PAIRS._replace(unroll=2),
    "u8": moe_ops.FUSED_PAIRS._replace(unroll=8),
    "v2": moe_ops.FUSED_PAIRS._replace(vec=2),
    # more pairs a chunk: past 8 tokens a block's pairs run in more chunks one after another
    # (the one launch lost on 13 of 18 calls of 10-16 tokens at dfa2c7a)
    "p4": moe_ops.FUSED_PAIRS._replace(tile_p=4),
    "p8": moe_ops.FUSED_PAIRS._replace(tile_p=8),
    # fewer column groups a slice, so fewer CUDA blocks that each shrink the block's pairs
    # again (w2's 2048 columns: two groups of 1024, not four of 512; w13's 768: one). With
    # chunks of 4 pairs too it spills (ptxas for sm_90: sm90_moe_fused_leads_static.json). On
    # an H100 at 5d9b04e 0.72-0.82x shipped at 10 and 16 tokens over 4 and 16 adapters
    # (h100_moe_fused_chunks_5d9b04e.json)
    "v8": moe_ops.FUSED_PAIRS._replace(vec=8, values=128),
    # the shipped build, its compact grid's walk reading 16 slots' counts at once, not 8: one
    # trip to memory, not two, over 16 adapters (the one-token miss there); the same
    # registers for sm_90 (sm90_moe_fused_leads_static.json). On an H100 at 5d9b04e it did
    # not pay (h100_moe_fused_walk16_5d9b04e.json)
    "walk16": moe_ops.FUSED_PAIRS,
}
#: The slots the compact grid's walk reads at once, where a variant sets it (else the
#: package's ``MOST_SLOTS_AT_ONCE``).
WALKS = {"walk16": 16}
SHIPPED_WALK = moe_blocks.MOST_SLOTS_AT_ONCE


#: The op's limits of the one launch past version 11's (13's, and 16's sparse one), which
#: :func:`pairs_path` sets to 0.
ONE_LAUNCH_LIMITS = ("ONE_LAUNCH_TO_PAIRS", "SPARSE_ONE_LAUNCH_TO_PAIRS")


@contextlib.contextmanager
def pairs_path():
    """Within it the op takes no one launch from version 13 on (:data:`ONE_LAUNCH_LIMITS` at
    0), so that the pairs path of the version set against the one launch runs."""
    saved = {name: getattr(moe_ops, name) for name in ONE_LAUNCH_LIMITS}
    for name in saved:
        setattr(moe_ops, name, 0)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(moe_ops, name, value)


def use(name: str) -> None:
    """Make variant ``name`` the one the op's version 11 launches."""
    moe_ops.FUSED_PAIRS = VARIANTS[name]
    moe_blocks.MOST_SLOTS_AT_ONCE = WALKS.get(name, SHIPPED_WALK)


def build(*config):
    """Version 11's kernel for Qwen3-30B-A3B's w13 at r=16 (bf16, in words, add_inputs)
    under one configuration of :data:`VARIANTS`."""
    threads, tile_n, tile_p, unroll, splits, vec, _, full_grid_blocks = FusedPairs(*config)
    return moe_fused.build_moe_fused_kernel(
        torch.bfloat16, torch.bfloat16, threads, tile_n, tile_p, unroll, splits, vec, 16, True,
        True, False, True, full_grid_blocks == 0, 1,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", help="projection:T:loras,... (default: every such case)")
    parser.add_argument("--variants", help="names of VARIANTS, comma-separated (default: all)")
    parser.add_argument("--tokens", help="token counts, comma-separated: the layer's cases there")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (least kept)")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the JSON")
    parser.add_argument("--against", type=int, default=9, help="the pairs path's version")
    opts = parser.parse_args()
    against = f"v{opts.against}"
    wanted = None
    if opts.cases:
        wanted = {tuple(c.split(":")) for c in opts.cases.split(",")}
    names = opts.variants.split(",") if opts.variants else list(VARIANTS)
    records = []
    if opts.tokens:
        tokens = [int(t) for t in opts.tokens.split(",")]
        cases = [MoECase(p, T, n) for p in ("w13", "w2") for T in tokens for n in LORAS]
    else:
        cases = default_cases()
    for case in cases:
        P = case.T * case.top_k
        if P > FUSED_TO_PAIRS and not (opts.cases or opts.tokens):
            continue
        moe_ops.FUSED_TO_PAIRS = max(FUSED_TO_PAIRS, P)  # version 11 takes it in one launch
        if wanted and (case.projection, str(case.T), str(case.loras)) not in wanted:
            continue
        first, pool, check = checked_pool(case)
        record = {"projection": case.projection, "T": case.T, "loras": case.loras}
        record["pool"] = len(pool)
        with pairs_path():
            record[f"error_{against}"] = check(lambda a, case=case: _call(case, a, opts.against))
        for name in names:
            use(name)
            record[f"error_{name}"] = check(lambda a, case=case: _call(case, a, 11))
        times = {}
        for _ in range(opts.rounds):
            use("shipped")
            with pairs_path():
                us = bench.time_calls([_call(case, a, opts.against) for a in pool])
            times[against] = min(times.get(against, us), us)
            for name in names:
                use(name)
                us = bench.time_calls([_call(case, a, 11) for a in pool])
                times[name] = min(times.get(name, us), us)
        use("shipped")
        moe_ops.FUSED_TO_PAIRS = FUSED_TO_PAIRS
        record.update(times)
        records.append({k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()})
        print(records[-1], flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            record = {
                "commit": opts.commit,
                "gpu": torch.cuda.get_device_name(),
                "variants": {name: list(VARIANTS[name]) for name in names},
                "walks": {name: WALKS[name] for name in names if name in WALKS},
                "cases": records,
            }
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
