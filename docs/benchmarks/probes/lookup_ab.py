"""The tuned table's lookup timed on a GPU: the weighed answer (``tuning/table.py``, ``pick``)
against the nearest entry's pick it replaced at 94c257c, and against no table at all.

    python docs/benchmarks/probes/lookup_ab.py --table PATH [--json OUT] [--rounds 2]
        [--twins] [--limit N] [--against nearest|heuristic] [--commit C]

``--table`` is read as this GPU's table (written under this GPU's name and file name into a
temporary folder that ``PUNICA_NUMBA_CONFIG_DIR`` names), so that a table never shipped, or one
tuned on another GPU, can be weighed here. For each case of ``bench --grid`` (``--twins``:
every shape in both dtypes) and each op, the launcher is asked for its configuration three
ways, on one argument set of the case:

* ``weighed``: the package's lookup, as shipped;
* ``nearest``: the nearest usable entry's own pick (``table.pick`` replaced for the probe);
* ``heuristic``: no table (``tuned_config`` answers None).

Each op whose weighed answer differs from the ``--against`` side's (default ``nearest``; with
``heuristic``, say, to weigh another machine's table against no table at all), at most
``--limit`` of them (spread evenly over the grid's order where more differ), is then timed
under all three as ``bench`` times an op (``bench.run_case``: a pool twice the L2, CUDA
graph replays), the sides in turn, each first in one round (``weighed nearest heuristic``,
then the reverse). Prints each op's times and the geometric means of weighed / nearest,
weighed / heuristic and nearest / heuristic (each side's least time over the rounds);
``--json`` writes them. GPU only.
"""

import argparse
import contextlib
import json
import math
import os
import tempfile
import time

#: No kernels of its own: it times the package's configurations.
VARIANTS: dict = {}

SIDES = ("weighed", "nearest", "heuristic")


def _nearest_pick(near, usable):
    """The lookup before 94c257c: the nearest usable entry's pick."""
    return near[0][1]["config"]


@contextlib.contextmanager
def side(name: str):
    """The launcher's table lookup as ``name`` answers, every remembered answer forgotten on
    the way in and out."""
    from punica_numba.tuning import table

    saved = table.pick, table._nothing
    table._found.clear()
    if name == "nearest":
        table.pick = _nearest_pick
    elif name == "heuristic":
        table._nothing = True
    try:
        yield
    finally:
        table.pick, table._nothing = saved
        table._found.clear()


def configs_taken(case, device) -> dict:
    """``side -> configuration name`` the op of bench ``case`` takes, on one argument set."""
    import torch

    from punica_numba import bench
    from punica_numba.launch import config_name
    from punica_numba.meta import LoRAKernelMeta

    gen = torch.Generator().manual_seed(0)
    slots = bench._slots(case, gen)
    meta = LoRAKernelMeta.make(case.num_loras, case.T, device)
    meta.prepare_tensors(slots.to(device))
    args = bench._argument_set(case, torch.Generator(device=device).manual_seed(0), device)
    taken = {}
    for name in SIDES:
        with side(name):
            taken[name] = config_name(bench._prepared_op(case, args, meta).config)
    del args
    torch.cuda.empty_cache()
    return taken


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", required=True, help="a tuned table's JSON")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--twins", action="store_true", help="both dtypes of every shape")
    parser.add_argument("--limit", type=int, default=60, help="ops timed at most")
    parser.add_argument("--against", choices=SIDES[1:], default="nearest")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args(argv)

    folder = tempfile.mkdtemp(prefix="lookup_ab_")
    os.environ["PUNICA_NUMBA_CONFIG_DIR"] = folder
    import torch

    from punica_numba import bench, bench_grid
    from punica_numba._cuda import device_of
    from punica_numba.tuning import table

    gpu = table.gpu_name()
    doc = table.read_table(args.table)
    tuned_on = doc["gpu"]
    doc["gpu"] = gpu  # read as this GPU's
    table.write_table(os.path.join(folder, table.table_file_name(gpu)), doc)
    table.reload_tuned_tables()
    print(f"{gpu}; table {args.table} ({tuned_on}, {len(doc['entries'])} entries)")

    start = time.perf_counter()
    moved, looked = [], 0
    for grid_case in bench_grid.grid_cases(twins=args.twins):
        for op in ("shrink", "expand"):
            case = grid_case.op_case(op)
            taken = configs_taken(case, device_of())
            looked += 1
            if taken["weighed"] != taken[args.against]:
                moved.append((grid_case, op, case, taken))
    print(
        f"{len(moved)} of {looked} ops answered otherwise than {args.against} "
        f"({time.perf_counter() - start:.0f} s)"
    )

    if len(moved) > args.limit:  # spread over the grid, not its first cases
        moved = [moved[i * len(moved) // args.limit] for i in range(args.limit)]
    records = []
    for grid_case, op, case, taken in moved:
        times = {name: [] for name in SIDES}
        for round_ in range(args.rounds):
            order = SIDES if round_ % 2 == 0 else SIDES[::-1]
            for name in order:
                with side(name):
                    got = bench.run_case(case, baseline=False, device_fill=True)
                assert got["config"] == taken[name], (got["config"], taken[name])
                times[name].append(got["us"])
                torch.cuda.empty_cache()
        best = {name: min(us) for name, us in times.items()}
        record = dict(case=grid_case.id, op=op, configs=taken, us=times, best_us=best)
        records.append(record)
        print(
            f"{grid_case.id} {op}: "
            + ", ".join(f"{n} {best[n]:.2f} ({taken[n]})" for n in SIDES)
            + f"; weighed/{args.against} {best['weighed'] / best[args.against]:.3f}",
            flush=True,
        )

    def geomean(a: str, b: str) -> float:
        logs = [math.log(r["best_us"][a] / r["best_us"][b]) for r in records]
        return math.exp(sum(logs) / len(logs)) if logs else float("nan")

    summary = dict(
        weighed_over_nearest=geomean("weighed", "nearest"),
        weighed_over_heuristic=geomean("weighed", "heuristic"),
        nearest_over_heuristic=geomean("nearest", "heuristic"),
    )
    print("geometric means: " + ", ".join(f"{k} {v:.4f}" for k, v in summary.items()))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                dict(
                    gpu=gpu,
                    commit=args.commit,
                    table=os.path.basename(args.table),
                    tuned_on=tuned_on,
                    twins=args.twins,
                    against=args.against,
                    looked_up=looked,
                    moved=len(moved),
                    timed=len(records),
                    rounds=args.rounds,
                    summary=summary,
                    records=records,
                ),
                out,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
