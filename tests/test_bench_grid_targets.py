"""The grid's targets (``bench_grid_targets``), counted on made-up records: each target's
rule, on both sides of its threshold, and the report and ``--against`` that print them."""

from __future__ import annotations

import json

import pytest

from punica_numba import bench_grid as grid
from punica_numba import bench_grid_targets as targets


def record(case_id: str, dtype: str = "bf16", error: bool = False, **runs) -> dict:
    """A grid record; each run given as ``(us, of_copy_bw)`` or ``(us, of_copy_bw,
    torch_us)`` for the pair."""
    out = {"id": f"{case_id} {dtype}", "dtype": dtype}
    for run, (us, share, *torch_us) in runs.items():
        out[run] = {"us": us, "of_copy_bw": share}
        if torch_us:
            out[run]["torch_gather_bmm_us"] = torch_us[0]
    if error:
        out["error"] = "AssertionError: made up"
    return out


def by_key(found):
    return {(t.name, t.run): t for t in found}


def test_the_pair_against_torch():
    found = by_key(
        targets.grid_targets(
            [
                record("a", pair=(10.0, None, 11.0)),
                record("b", pair=(10.0, None, 9.0)),
                record("c", pair=(10.0, None)),  # torch skipped: does not count
            ]
        )
    )
    t = found["torch", "pair"]
    assert (t.met, t.of) == (1, 2) and t.misses == [(10 / 9, "b bf16")]
    assert ("torch", "shrink") not in found


def test_bandwidth_counts_only_floors_of_10_us_or_more():
    found = by_key(
        targets.grid_targets(
            [
                record("a", shrink=(20.0, 0.69), expand=(20.0, 0.70)),  # floors 13.8, 14 µs
                record("b", shrink=(100.0, 0.099)),  # floor 9.9 µs: not counted
                record("c", shrink=(40.0, 0.25)),  # floor 10 µs
                record("d", shrink=(40.0, None)),  # the simulator: not counted
            ]
        )
    )
    shrink, expand = found["bandwidth", "shrink"], found["bandwidth", "expand"]
    assert (shrink.met, shrink.of) == (0, 2) and (expand.met, expand.of) == (1, 1)
    assert shrink.misses == [(0.25, "c bf16"), (0.69, "a bf16")]  # the furthest first


def test_fp16_against_its_bf16_twin():
    found = by_key(
        targets.grid_targets(
            [
                record("a", pair=(10.0, None)),
                record("a", "fp16", pair=(11.0, None)),  # 1.10x: meets
                record("b", pair=(10.0, None)),
                record("b", "fp16", pair=(11.2, None)),  # 1.12x: misses
                record("c", "fp16", pair=(50.0, None)),  # no twin: does not count
                record("d", error=True, pair=(1.0, None)),
                record("d", "fp16", pair=(9.0, None)),  # its twin failed: does not count
            ]
        )
    )
    t = found["fp16", "pair"]
    assert (t.met, t.of) == (1, 2)
    assert [(round(how, 3), case) for how, case in t.misses] == [(1.12, "b fp16")]


def test_against_another_grid_takes_the_best_of_it_and_torch():
    ours = [
        record("a", shrink=(10.3, None), pair=(10.0, None, 9.8)),  # shrink 1.03x: meets
        record("b", shrink=(10.5, None), pair=(10.0, None, 20.0)),  # shrink 1.05x: misses
        record("c", shrink=(10.0, None)),  # not in the other grid: does not count
    ]
    theirs = [
        record("a", shrink=(10.0, None), pair=(12.0, None)),  # best for the pair: torch 9.8
        record("b", shrink=(10.0, None), pair=(10.0, None)),
    ]
    found = by_key(targets.grid_targets(ours, theirs, "abc1234"))
    shrink, pair = found["against abc1234", "shrink"], found["against abc1234", "pair"]
    assert (shrink.met, shrink.of) == (1, 2) and shrink.misses[0][1] == "b bf16"
    assert (pair.met, pair.of) == (2, 2)  # 10.0 / 9.8 = 1.02x
    assert not any(name.startswith("against") for name, _ in by_key(targets.grid_targets(ours)))


def test_the_report_counts_and_names_the_furthest_misses():
    torch_us = (9.0, 9.5, 10.0, 11.0, 12.0)
    records = [record(c, pair=(10.0, 0.5, t)) for c, t in zip("abcde", torch_us)]
    text = targets.report(targets.grid_targets(records), worst=2)
    lines = text.splitlines()
    assert lines[1].split()[-3:] == ["-", "-", "2/5"]  # torch: d and e faster
    assert lines[2].split()[-3:] == ["-", "-", "-"]  # bandwidth: floors of 5 µs count nowhere
    assert "  torch, pair: 1.11x a bf16; 1.05x b bf16 (and 1 more)" in text
    assert "bandwidth, pair" not in text


def test_against_on_the_command_line(tmp_path, capsys):
    """``--merge ... --against``: the other grid's commit names the target; a file that
    is not a grid's JSON is refused by name."""
    case = grid.grid_cases(quick=True)[0]
    mine = {"commit": "new", "gpu": "a GPU", "copy_bandwidth_tbps": 4.0}
    mine["grid"] = {
        "format": grid.FORMAT,
        "part": None,
        "cases_in_grid": 3,
        "parts": [{"part": "1/1"}],
        "cases": [case.describe() | {"shrink": {"us": 9.0, "bytes": 1, "of_copy_bw": None}}],
    }
    theirs = json.loads(json.dumps(mine)) | {"commit": "old0123"}
    theirs["grid"]["cases"][0]["shrink"]["us"] = 8.0
    (tmp_path / "mine.json").write_text(json.dumps(mine))
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    args = ["--merge", str(tmp_path / "mine.json"), "--against", str(tmp_path / "theirs.json")]
    assert grid.main(args) == 0
    out = capsys.readouterr().out
    assert "at most the best of old0123 and torch, +3%" in out
    assert f"against old0123, shrink: 1.12x {case.id}" in out
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        grid.main(["--merge", str(tmp_path / "mine.json"), "--against", str(tmp_path / "bad.json")])
    assert "--against" in capsys.readouterr().err
