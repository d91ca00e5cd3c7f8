"""``bench --compare``: two sets of benchmark runs, case by case.

The medians and ratios on made-up runs of ``bench``, ``bench --grid`` and ``bench --moe``
records, the exit code (1 where a case is slower by more than the tolerance), and that the
fields naming a case are fields the benchmarks write.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from punica_numba import bench, bench_compare, bench_grid, bench_moe


def _record(op: str, T: int, us: float, **extra) -> dict:
    base = dict(op=op, T=T, lora_mode="uniform", hidden=64, rank=16, dtype="bf16", slices=[64])
    return base | {"us": us} | extra


def _grid_record(layer: str, T: int, shrink: float, expand: float) -> dict:
    record = dict(layer=layer, T=T, lora_mode="eight", rank=16, dtype="bf16")
    pair = {"us": shrink + expand}
    return record | {"shrink": {"us": shrink}, "expand": {"us": expand}, "pair": pair}


def _write(tmp_path, name: str, cases: list[dict], commit: str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"commit": commit, "cases": cases}))
    return str(path)


def test_medians_and_ratios_of_each_case(tmp_path):
    old = [
        _write(tmp_path, "old1", [_record("shrink", 1, 2.0), _record("expand", 1, 4.0)], "a"),
        _write(tmp_path, "old2", [_record("shrink", 1, 3.0), _record("expand", 1, 4.4)], "a"),
        _write(tmp_path, "old3", [_record("shrink", 1, 2.5), _record("expand", 1, 9.0)], "a"),
    ]
    new = [
        _write(tmp_path, "new1", [_record("shrink", 1, 2.5), _record("expand", 1, 4.0)], "b"),
        _write(tmp_path, "new2", [_record("shrink", 1, 2.6), _record("shrink", 8, 1.0)], "b"),
    ]
    runs = [[json.loads(Path(p).read_text()) for p in side] for side in (old, new)]
    rows = {row["case"][:2]: row for row in bench_compare.compare(*runs)}
    assert set(rows) == {("shrink", 1), ("expand", 1)}, "a case on one side only is left out"
    assert rows[("shrink", 1)]["old_us"] == 2.5 and rows[("shrink", 1)]["new_us"] == 2.55
    assert rows[("expand", 1)]["old_us"] == 4.4 and rows[("expand", 1)]["new_us"] == 4.0
    assert rows[("shrink", 1)]["ratio"] == pytest.approx(2.55 / 2.5)
    assert [r["case"][0] for r in bench_compare.compare(*runs)] == ["shrink", "expand"]


@pytest.mark.parametrize("new_us, code", [(1.02, 0), (1.04, 1)])
def test_the_exit_code_says_whether_a_case_is_slower(tmp_path, capsys, new_us, code):
    old = _write(tmp_path, "old", [_record("expand", 4, 1.0), _grid_record("qkv", 4, 1, 2)], "a")
    new = _write(tmp_path, "new", [_record("expand", 4, new_us), _grid_record("qkv", 4, 1, 2)], "b")
    assert bench.main(["--compare", old, new]) == code
    out = capsys.readouterr().out
    assert "old: a (1 runs)   new: b (1 runs)" in out
    assert "4 cases on both sides" in out  # bench's one, the grid's shrink, expand and pair
    flagged = [line for line in out.splitlines() if line.endswith("  slower")]
    assert [line.split()[0] for line in flagged] == (["expand"] if code else [])
    assert f"{code} slower by more than 3%" in out
    assert "pair qkv T=4 eight r=16 bf16" in out


def test_the_fields_naming_a_case_are_written_by_the_benchmarks():
    assert set(bench_compare.CASE_FIELDS) <= {f.name for f in dataclasses.fields(bench.Case)}
    grid = bench_grid.grid_cases(quick=True)[0]
    assert set(bench_compare.GRID_FIELDS) <= set(grid.describe())
    assert set(bench_moe.SHAPE_FIELDS) <= {f.name for f in dataclasses.fields(bench_moe.MoECase)}


def test_moe_runs_are_compared_case_by_case_by_their_shape(tmp_path, capsys):
    """Two ``bench --moe`` runs, and a peer's figures that name only the projection, T and
    adapters (the benchmark's own layer): each case by its shape, whatever its order; a
    case of another layer is on one side only."""
    ours = [dataclasses.asdict(c) | {"us": 2.0} for c in bench_moe.default_cases()[:2]]
    peer = [{k: c[k] for k in ("projection", "T", "loras")} | {"us": 4.0} for c in ours]
    other = dict(ours[0], hidden=64)  # the same projection, T and adapters, another layer
    old = _write(tmp_path, "peer", peer[::-1] + [other], "vllm")
    new = _write(tmp_path, "ours", ours, "b")
    assert bench.main(["--compare", old, new]) == 0
    out = capsys.readouterr().out
    assert "2 cases on both sides (1 on one side only); 0 slower" in out
    assert out.count("0.500") == 2
    assert "moe w13 T=1 loras=1 H=2048 E=128 top-8 I=768 r=16 bf16" in out
