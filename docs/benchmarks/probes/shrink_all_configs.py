"""Every shrink configuration, checked and timed as the tuner times it, on a few problems
named on the command line (``K:rank:T:loras[:slices]``), to see how a configuration's time
grows with K where tokens a LoRA are few.

    python docs/benchmarks/probes/shrink_all_configs.py [--json PATH] [--commit C]
        [--only NAME,...] [--fill-ab] [--extra] 14336:32:32:8 4096:32:32:8 1024:32:32:8

``--fill-ab`` times each configuration twice a round, two rounds, keeping each side's
least time: as shipped, and with no spare counters (so each launch the tuner captures
fills counters of its own in the graph, as every split shrink did before the spare;
``kernels/shrink_split.py``, "The workspace").

``--extra`` times :data:`EXTRA` too: tensor-core shrinks with K split that the package does
not offer (more runs of K, fewer warps a run, two passes of loads ahead), to see whether
the split blocks' time at a down projection is their walk or what follows it; and the
cluster's form (``kernels/shrink_mma_split.py``, "In one cluster") of every tensor-core
split of 2-8 runs that the package does not offer.

GPU only. Prints each problem's configurations, fastest first.
"""

import argparse
import dataclasses
import json
from unittest import mock

import torch

from punica_numba import launch
from punica_numba.kernels import shrink_split
from punica_numba.kernels.cluster import PORTABLE_CLUSTER
from punica_numba.launch import LaunchConfig, config_name, launch_configs
from punica_numba.tuning.sweep import SweepCase, _measure_all

#: No kernels of its own: it times the package's configurations ...
VARIANTS: dict = {}

#: ... and, with ``--extra``, these launches of its kernels: 16-token tiles of every rank
#: (``tile_n`` 0), 8 or 16 ranks, K in 4-32 runs, one or two passes ahead.
EXTRA = tuple(
    LaunchConfig(
        "mma", threads=t, tile_m=16, tile_n=n, spread=n > 0, splits=k, ahead=a, tuned_only=True
    )
    for t, n, k, a in (
        (256, 0, 16, 1),
        (256, 0, 32, 1),
        (128, 0, 32, 1),
        (512, 0, 32, 1),
        (512, 8, 4, 2),
        (512, 8, 16, 1),
        (256, 8, 8, 1),
        (256, 8, 8, 2),
        (256, 8, 16, 1),
        (256, 8, 32, 1),
        (128, 8, 16, 2),
        (128, 8, 32, 1),
        (256, 16, 16, 1),
        (512, 16, 8, 1),
    )
)


def _timed(case, configs, fill: bool) -> tuple[dict, dict]:
    shrink_split.clear_split_workspaces()
    if not fill:
        return _measure_all(case, configs, 10, 0)[:2]
    with mock.patch.object(shrink_split, "_keep_a_spare", lambda *args: None):
        return _measure_all(case, configs, 10, 0)[:2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("problems", nargs="+")
    parser.add_argument("--json")
    parser.add_argument("--commit", default="")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--fill-ab", action="store_true")
    parser.add_argument("--extra", action="store_true", help="time EXTRA's launches too")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    if args.extra:  # (a configuration is forced only where the machine offers it)
        shrinks = launch_configs("shrink") + EXTRA
        twins = (  # and the cluster's form of every split of 2-8 runs
            dataclasses.replace(c, cluster=True)
            for c in shrinks
            if c.kernel == "mma"
            and 2 <= c.splits <= PORTABLE_CLUSTER
            and not (c.staged or c.cluster)
        )
        shrinks += tuple(c for c in twins if c not in shrinks)
        mock.patch.dict(launch._GPU_CONFIGS, {"shrink": shrinks}).start()
    offered = launch_configs("shrink")
    configs = [c for c in offered if not only or config_name(c) in only]
    result = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "problems": {}}
    sides = ("spare", "fill") if args.fill_ab else ("spare",)
    for text in args.problems:
        K, rank, T, loras, *rest = map(int, text.split(":"))
        slices = [1024] * (rest[0] if rest else 1)
        case = SweepCase("shrink", T, "given", K, rank, "bf16", slices, loras=loras)
        best = {side: {} for side in sides}
        failed = {}
        for _ in range(2 if args.fill_ab else 1):
            for side in sides:
                times, why = _timed(case, configs, side == "fill")
                failed.update(why)
                for name, t in times.items():
                    best[side][name] = min(t, best[side].get(name, t))
        result["problems"][text] = {"times_us": best, "failed": failed}
        for side in sides:
            ranked = sorted(best[side].items(), key=lambda kv: kv[1])
            print(text, side, " ".join(f"{n}={t:.2f}" for n, t in ranked), flush=True)
        for name, why in failed.items():
            print("  failed", name, why[:160], flush=True)
        if args.json:  # (after each problem: a time limit that stops the run keeps those done)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
