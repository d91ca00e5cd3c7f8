"""Every shrink configuration, checked and timed as the tuner times it, on a few problems
named on the command line (``K:rank:T:loras[:slices]``), to see how a configuration's time
grows with K where tokens a LoRA are few.

    python docs/benchmarks/probes/shrink_all_configs.py [--json PATH] [--commit C]
        [--only NAME,...] [--fill-ab] 14336:32:32:8 4096:32:32:8 1024:32:32:8

``--fill-ab`` times each configuration twice a round, two rounds, keeping each side's
least time: as shipped, and with no spare counters (so each launch the tuner captures
fills counters of its own in the graph, as every split shrink did before the spare;
``kernels/shrink_split.py``, "The workspace").

GPU only. Prints each problem's configurations, fastest first.
"""

import argparse
import json
from unittest import mock

import torch

from punica_numba.kernels import shrink_split
from punica_numba.launch import config_name, launch_configs
from punica_numba.tuning.sweep import SweepCase, _measure_all

#: No kernels of its own: it times the package's configurations.
VARIANTS: dict = {}


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
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    configs = [c for c in launch_configs("shrink") if not only or config_name(c) in only]
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
            print(text, side, " ".join(f"{n}={t:.2f}" for n, t in ranked[:12]), flush=True)
        for name, why in failed.items():
            print("  failed", name, why[:160], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
