"""The expand's configurations past r=64 at a few tokens a LoRA, checked and timed as
the tuner times them, to weigh the heuristic's rule that the lane-split expand comes before
the tensor cores there (``launch._LANES_FIRST_RANKS_A_TOKEN``) on a GPU without a
table, and at ranks the H200's table does not hold (r=256).

    python docs/benchmarks/probes/expand_lanes_rule.py [--json PATH] [--commit C]
        [--ranks 128,256] [--tokens 8,32,128,256] [--hiddens 2560,4096] [--per-lora 1,2]

Each problem is an expand of a real layer (:data:`punica_numba.bench_grid.MODELS`: QKV's
three slices, gate_up's two, o's one; the o projection's K is the model's hidden size), bf16,
its T tokens over T / n LoRAs for each n of ``--per-lora`` (default: one and two tokens a
LoRA). For each it records every configuration's µs (none staged: the heuristic never picks
those), the heuristic's pick with the rule and without it, and their ratio. GPU only.
"""

import argparse
import contextlib
import json
from unittest import mock

import torch

from punica_numba import launch
from punica_numba.bench_grid import MODELS
from punica_numba.launch import config_name, launch_configs
from punica_numba.tuning.near import heuristic_config
from punica_numba.tuning.sweep import SweepCase, _measure_all

#: No kernels of its own: it times the package's.
VARIANTS: dict = {}


def _pick(rank: int, T: int, loras: int, widths: tuple, rule: bool) -> str:
    off = mock.patch.object(launch, "_LANES_FIRST_RANKS_A_TOKEN", 1 << 30)
    with contextlib.nullcontext() if rule else off:
        config = heuristic_config(
            "expand", T, loras, rank, len(widths), rank, max(widths), True, True
        )
    return config_name(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--commit", default="")
    parser.add_argument("--ranks", default="128,256")
    parser.add_argument("--tokens", default="8,32,128,256")
    parser.add_argument("--hiddens", default="2560,4096")
    parser.add_argument("--per-lora", default="1,2", help="tokens a LoRA, comma-separated")
    args = parser.parse_args()
    configs = [c for c in launch_configs("expand") if not c.staged]
    result = {"gpu": torch.cuda.get_device_name(), "commit": args.commit, "problems": []}
    for hidden in map(int, args.hiddens.split(",")):
        layers = [(layer.kind, layer.slices) for layer in MODELS[hidden]]
        layers[-1] = ("o", (hidden,))  # (the attention's output projection: K = its hidden)
        for rank in map(int, args.ranks.split(",")):
            for T in map(int, args.tokens.split(",")):
                for kind, widths in layers:
                    for loras in (T // int(n) for n in args.per_lora.split(",")):
                        case = SweepCase(
                            "expand", T, "given", hidden, rank, "bf16", list(widths), loras=loras
                        )
                        times, failed = _measure_all(case, configs, 10, 0)[:2]
                        with_rule, without = (
                            _pick(rank, T, loras, widths, r) for r in (True, False)
                        )
                        record = {
                            "hidden": hidden, "layer": kind, "widths": list(widths), "rank": rank,
                            "T": T, "loras": loras, "with_rule": with_rule, "without": without,
                            "times_us": times, "failed": failed,
                        }  # fmt: skip
                        if with_rule in times and without in times:
                            record["ratio"] = round(times[with_rule] / times[without], 3)
                        result["problems"].append(record)
                        best = min(times, key=times.get) if times else None
                        print(
                            f"{hidden} {kind:6s} r={rank} T={T} loras={loras}: rule {with_rule} "
                            f"{times.get(with_rule, float('nan')):.2f} without {without} "
                            f"{times.get(without, float('nan')):.2f} best {best} "
                            f"{times.get(best, float('nan')):.2f} ratio {record.get('ratio')}",
                            flush=True,
                        )
                        for name, why in failed.items():
                            print("  failed", name, why[:160], flush=True)
                        if args.json:  # (after each problem: a time limit keeps those done)
                            with open(args.json, "w") as f:
                                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
