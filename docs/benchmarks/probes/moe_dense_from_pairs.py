"""MoE LoRA's calls under the kernels the op's version gives them and under the dense op's
tiles from fewer pairs a (slot, expert) (the thresholds lowered), timed as ``bench --moe``
times the op.

A version from 8 takes the dense op's 16-pair tiles (``ops.moe_dense``) from
``ops.moe.tiles_from_pairs(version)`` pairs a (slot, expert) on average: 16
(``DENSE_FROM_PAIRS``) up to version 11, with version 6's kernels from 4 up to it; 4
(``TILES_FROM_PAIRS``) from version 12. Below ``MMA_SHRINK_FROM_PAIRS`` (4) versions 9 and
later run the pairs path (the dense op's row kernels, a pair a one-token tile). Each threshold
``N`` of ``--thresholds`` is a side: the tiles from ``N`` (the version's tiles threshold at
``N``, and the pairs path's at ``N`` where that is lower). For each case this checks the op's
result on each side against the reference and times them on one pool of argument sets
(CUDA-graph replays, µs per call), ``--rounds`` times, alternating, keeping each one's least.

    python docs/benchmarks/probes/moe_dense_from_pairs.py [--json PATH] [--commit C]
        [--version V] [--rounds N] [--ranks 16,64] [--thresholds 1,2] [--cases w13:64:1,...]

``--version 11 --thresholds 4`` is the comparison that made version 12 (version 6's kernels
against the tiles at 4-16 pairs; at 470088f, whose probe took version 11's
``DENSE_FROM_PAIRS`` alone). The cases (default): both projections of ``bench --moe``'s layer
(Qwen3-30B-A3B's, bf16) at 16 to 2048 tokens on 1, 4 or 16 adapters whose pairs a (slot,
expert) are at least the lowest threshold and below the version's tiles threshold, and more
than the one launch takes. GPU only.
"""

import argparse
import json

import torch

from punica_numba import bench
from punica_numba.bench_moe import MoECase, _call, checked_pool
from punica_numba.ops import moe as moe_ops

#: No kernels of its own: it times the package's.
VARIANTS: dict = {}

TOKENS = (16, 64, 128, 256, 512, 1024, 2048)
LORAS = (1, 4, 16)


def _cases(ranks, named, lowest: float, version: int) -> list[MoECase]:
    if named:
        shapes = [(p, int(T), int(n)) for p, T, n in (c.split(":") for c in named.split(","))]
    else:
        shapes = [(p, T, n) for p in ("w13", "w2") for T in TOKENS for n in LORAS]
    cases = []
    for rank in ranks:
        for p, T, n in shapes:
            case = MoECase(p, T, n, rank=rank)
            pairs = T * case.top_k
            average = moe_ops.pairs_per_block(pairs, n, case.experts)
            moved = lowest <= average < moe_ops.tiles_from_pairs(version)
            if named or (moved and not moe_ops.one_launch(pairs, version)):
                cases.append(case)
    return cases


def _side(threshold: int | None) -> dict:
    """The module constants for the tiles from ``threshold`` (None: as shipped): both tiles
    thresholds, so that ``ops.moe.tiles_from_pairs`` alone says which one the version reads."""
    shipped = {
        name: getattr(moe_ops, name)
        for name in ("DENSE_FROM_PAIRS", "TILES_FROM_PAIRS", "MMA_SHRINK_FROM_PAIRS")
    }
    if threshold is None:
        return shipped
    pairs = min(shipped["MMA_SHRINK_FROM_PAIRS"], threshold)
    tiles = {"DENSE_FROM_PAIRS": threshold, "TILES_FROM_PAIRS": threshold}
    return shipped | tiles | {"MMA_SHRINK_FROM_PAIRS": pairs}


def _set(constants: dict) -> None:
    """Put a side's constants (:func:`_side`) into the op's module."""
    for constant, value in constants.items():
        setattr(moe_ops, constant, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", help="projection:T:loras,... (default: module docstring)")
    parser.add_argument("--version", type=int, default=moe_ops.DEFAULT_VERSION)
    parser.add_argument("--ranks", default="16,64")
    parser.add_argument("--thresholds", default="1,2", help="the tiles from these pairs")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (least kept)")
    parser.add_argument("--commit", default="unknown", help="the commit measured, for the JSON")
    opts = parser.parse_args()
    thresholds = [int(t) for t in opts.thresholds.split(",")]
    sides = {"shipped": _side(None)}
    sides |= {str(t): _side(t) for t in thresholds}
    ranks = [int(r) for r in opts.ranks.split(",")]
    records = []
    for case in _cases(ranks, opts.cases, min(thresholds), opts.version):
        _, pool, check = checked_pool(case)
        record = {"projection": case.projection, "T": case.T, "loras": case.loras}
        record |= {"rank": case.rank, "version": opts.version, "pool": len(pool)}
        times = {}

        def call(a, case=case):
            return _call(case, a, opts.version)

        try:
            for name, constants in sides.items():
                _set(constants)
                record[f"error_{name}"] = check(call)
            for _ in range(opts.rounds):
                for name, constants in sides.items():
                    _set(constants)
                    us = bench.time_calls([call(a) for a in pool])
                    times[name] = min(times.get(name, us), us)
        finally:
            _set(sides["shipped"])
        record["us"] = {name: round(us, 3) for name, us in times.items()}
        record["ratio"] = {
            n: round(times[n] / times["shipped"], 3) for n in sides if n != "shipped"
        }
        records.append(record)
        print(record, flush=True)
        if opts.json:  # (after each case: a time limit keeps those done)
            with open(opts.json, "w") as f:
                doc = {"commit": opts.commit, "gpu": torch.cuda.get_device_name()}
                json.dump(doc | {"sides": sides, "cases": records}, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
