"""The dense op's configurations on MoE LoRA's calls: which is fastest where version 9 runs them.

Version 9 of ``fused_moe_lora`` hands two kinds of call to the dense op's kernels
(``punica_numba/ops/moe_dense.py``): from ``DENSE_FROM_PAIRS`` pairs a (slot, expert) on, its
tensor-core shrink and expand on tiles of 16 pairs; below ``MMA_SHRINK_FROM_PAIRS``, its row
kernels on one-token tiles, a pair each. Either takes the configuration that the dense op's
tuned table (or its heuristic) names for P rows over ``P / average`` slots: an entry tuned on a
dense layer of other sizes (no tuned problem has K = 2048 or 768, nor slices 768 wide), the
nearest by the table's distance. Whether that pick is the fastest at MoE's own shapes was never
measured.

For each case of ``bench --moe`` where version 9 takes one of those paths, this probe checks and
times the op (the benchmark's pool and method: ``bench_moe.checked_pool``) under each
configuration of each op that the path can run (``force_launch_config``; one the op turns down,
or that fails its check, is listed apart), and under its own pick. One JSON line: for each case
and op, the pick, its µs, the fastest and its µs, every time. What it says decides whether the
tuner should tune MoE's own shapes.

Run on a GPU from the repository root::

    python docs/benchmarks/probes/moe_dense_configs.py [--cases w13 T=2048 ...] [--json PATH]

``--cases`` keeps the cases whose name contains every word given (``w2``, ``T=256``,
``loras=16``). ``--json`` is written again after each case, so a run that a time limit stops
keeps the cases it finished. ``--quick`` runs ``bench --moe --quick``'s tiny cases (on the
simulator too, where the times mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

#: None of its own kernels: it forces the op's configurations (the tests build each VARIANT).
VARIANTS: dict = {}


def path_of(case) -> str | None:
    """``"tiles"`` (the dense tensor-core kernels), ``"pairs"`` (the row kernels) or None
    (version 6's kernels): what the op's default version takes for ``case``."""
    from punica_numba.ops import moe as moe_ops

    average = moe_ops.pairs_per_block(case.T * case.top_k, case.loras, case.experts)
    if moe_ops.DEFAULT_VERSION < 9:
        return None
    if average < moe_ops.MMA_SHRINK_FROM_PAIRS:  # (in the op's order)
        return "pairs"
    if average >= moe_ops.DENSE_FROM_PAIRS:
        return "tiles"
    return None


def runs_on(path: str, op: str, rank: int):
    """The test of a configuration the path runs for ``op`` (``moe_dense``'s own)."""
    from punica_numba.ops import moe_dense

    if path == "pairs":
        return moe_dense._one_token_rows
    if op == "shrink":
        return functools.partial(moe_dense._shrink_runs, rank=rank)
    return moe_dense._expand_runs


def weigh(case) -> dict:
    """The case's record: for each op, the pick and each configuration's µs."""
    from punica_numba import bench, bench_moe
    from punica_numba.launch import config_name, force_launch_config, launch_configs
    from punica_numba.ops import moe_dense

    path = path_of(case)
    record = {"case": case.name, "path": path}
    _, pool, check = bench_moe.checked_pool(case)
    taken = {}
    real = moe_dense._config

    def spying(op, *args, **options):  # the configuration each op's launch takes
        config = real(op, *args, **options)
        taken[op] = config
        return config

    moe_dense._config = spying
    try:
        calls = [bench_moe._call(case, a) for a in pool]
        check(lambda a: bench_moe._call(case, a))
        pick = dict(taken)
        pick_us = bench.time_calls(calls)
        for op in ("shrink", "expand"):
            runs = runs_on(path, op, case.rank)
            times, refused, failed = {}, [], {}
            for config in launch_configs(op):
                if not runs(config):
                    continue
                name = config_name(config)
                with force_launch_config(op, config):
                    taken.clear()
                    try:
                        check(lambda a: bench_moe._call(case, a))
                    except Exception as error:  # a wrong result, or a launch that fails
                        failed[name] = f"{type(error).__name__}: {error}"[:200]
                        continue
                    if taken.get(op) != config:  # turned down: another configuration ran
                        refused.append(name)
                        continue
                    times[name] = round(bench.time_calls(calls), 3)
            fastest = min(times, key=times.get) if times else None
            record[op] = {
                "pick": config_name(pick[op]) if op in pick else None,
                "pick_us": round(pick_us, 3),
                "fastest": fastest,
                "fastest_us": times.get(fastest),
                "times_us": times,
                "refused": refused,
                "failed": failed,
            }
    finally:
        moe_dense._config = real
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], help="words a case's name must hold")
    parser.add_argument("--quick", action="store_true", help="bench --moe --quick's tiny cases")
    parser.add_argument("--json", help="also write the line to this file, after each case")
    args = parser.parse_args(argv)
    from punica_numba import bench, bench_moe
    from punica_numba._cuda import SIMULATOR

    records = []
    doc = {"commit": bench._commit(), "simulator": SIMULATOR, "cases": records}
    for case in bench_moe.default_cases(quick=args.quick):
        if path_of(case) is None or not all(word in case.name for word in args.cases):
            continue
        start = time.perf_counter()
        records.append(weigh(case))
        seconds = time.perf_counter() - start
        print(f"{case.name}: {records[-1]['path']}, {seconds:.0f} s", file=sys.stderr)
        if args.json:  # after each case: a run a time limit stops keeps the cases done
            with open(args.json, "w") as out:
                out.write(json.dumps(doc) + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
