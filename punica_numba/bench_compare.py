"""``python -m punica_numba bench --compare OLD NEW``: two benchmark runs, case by case.

A change is judged against the code before it, measured on the same machine in the
same hour: a benchmark's figures differ between machines and days by more than many a
change's effect. So the benchmark is run alternately at the old and the new code
(``tests/gpu_check.sh ab``) and the runs are compared here: for each case (op, tokens,
LoRA mix, hidden size, rank, dtype, slices) the median device time of each side's runs,
and their ratio.

Semantics:
    OLD, NEW: comma-separated JSON files written by ``bench --json`` (or ``bench --grid
    --json``, whose cases are timed as shrink, expand and the pair: three entries each;
    or ``bench --moe --json``, or a peer's figures of its cases, matched by their shape:
    :func:`punica_numba.bench_moe.case_shape`)
    per case c present on both sides: old_us = median over OLD's runs, new_us likewise
    ratio = new_us / old_us; a case is "slower" when ratio > 1 + tolerance
Prints a table (the slowest first), and exits 1 when a case is slower, 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence

__all__ = ["CASE_FIELDS", "GRID_FIELDS", "compare", "main"]

#: The fields that name a case of ``bench`` (the rest of a record is what was measured).
CASE_FIELDS = ("op", "T", "lora_mode", "hidden", "rank", "dtype", "slices")
#: The fields that name a case of ``bench --grid``, whose record holds one entry per run.
GRID_FIELDS = ("layer", "T", "lora_mode", "rank", "dtype")
GRID_RUNS = ("shrink", "expand", "pair")

#: A case whose median is more than this fraction slower is reported as slower.
TOLERANCE = 0.03


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def entries(record: dict):
    """``(key, us)`` for each time a record holds: one for ``bench``'s and ``bench --moe``'s,
    one per run (shrink, expand, pair) for ``bench --grid``'s."""
    if "op" in record:
        yield tuple(_hashable(record.get(f)) for f in CASE_FIELDS), record["us"]
        return
    if "projection" in record:  # an MoE LoRA case (bench --moe's, or a peer's)
        from .bench_moe import case_shape

        yield ("moe", *case_shape(record)), record["us"]
        return
    for run in GRID_RUNS:
        if isinstance(record.get(run), dict) and "us" in record[run]:
            yield ("grid", run, *(_hashable(record.get(f)) for f in GRID_FIELDS)), record[run]["us"]


def _medians(runs: Sequence[dict]) -> dict[tuple, float]:
    """Per case, the median ``us`` over the runs that hold it."""
    times: dict[tuple, list[float]] = {}
    for run in runs:
        for record in run["cases"]:
            for key, us in entries(record):
                times.setdefault(key, []).append(us)
    return {key: statistics.median(values) for key, values in times.items()}


def compare(old: Sequence[dict], new: Sequence[dict]) -> list[dict]:
    """Rows ``{case, old_us, new_us, ratio}`` for the cases both sides hold, the largest
    ratio first."""
    return _rows(_medians(old), _medians(new))


def _rows(before: dict[tuple, float], after: dict[tuple, float]) -> list[dict]:
    rows = [
        dict(case=key, old_us=before[key], new_us=after[key], ratio=after[key] / before[key])
        for key in before
        if key in after
    ]
    return sorted(rows, key=lambda row: -row["ratio"])


def _label(key: tuple) -> str:
    if key[0] == "moe":  # ("moe", *bench_moe.case_shape(record))
        from .bench_moe import SHAPE_FIELDS

        c = dict(zip(SHAPE_FIELDS, key[1:], strict=True))
        return (
            f"moe {c['projection']} T={c['T']} loras={c['loras']} H={c['hidden']}"
            f" E={c['experts']} top-{c['top_k']} I={c['intermediate']} r={c['rank']} {c['dtype']}"
        )
    if key[0] == "grid":  # ("grid", run, layer, T, mode, rank, dtype)
        _, run, layer, T, mode, rank, dtype = key
        return f"{run} {layer} T={T} {mode} r={rank} {dtype}"
    op, T, mode, hidden, rank, dtype, slices = key
    return f"{op} T={T} {mode} H={hidden} r={rank} {dtype} {'/'.join(map(str, slices or ()))}"


def _read(paths: str) -> list[dict]:
    runs = []
    for path in paths.split(","):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m punica_numba bench --compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("old", help="the old code's runs: JSON files, comma-separated")
    parser.add_argument("new", help="the new code's runs: JSON files, comma-separated")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE,
        help=f"a ratio above 1 + this is 'slower' (default {TOLERANCE})",
    )
    args = parser.parse_args(argv)
    old, new = _read(args.old), _read(args.new)
    before, after = _medians(old), _medians(new)
    rows = _rows(before, after)
    commits = (
        ",".join(sorted({r.get("commit", "?") for r in old})),
        ",".join(sorted({r.get("commit", "?") for r in new})),
    )
    print(f"old: {commits[0]} ({len(old)} runs)   new: {commits[1]} ({len(new)} runs)")
    print(f"{'case':<60}{'old µs':>12}{'new µs':>12}{'new/old':>9}")
    slower = 0
    for row in rows:
        flag = ""
        if row["ratio"] > 1 + args.tolerance:
            flag, slower = "  slower", slower + 1
        print(
            f"{_label(row['case']):<60}{row['old_us']:>12.3f}{row['new_us']:>12.3f}"
            f"{row['ratio']:>9.3f}{flag}"
        )
    missing = len(before.keys() ^ after.keys())
    print(
        f"{len(rows)} cases on both sides ({missing} on one side only); "
        f"{slower} slower by more than {args.tolerance:.0%}"
    )
    return 1 if slower else 0


if __name__ == "__main__":
    sys.exit(main())
