"""The shape grid of ``bench --grid``: its design, its layers, its floors, its parts, and a
tiny run (on the simulator) that writes the JSON and the plot."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from punica_numba import bench
from punica_numba import bench_grid as grid

# The axes as the task states them, written out here rather than read from the module, so
# that a value dropped from the module's axes fails these tests.
WANTED = {
    "rank": {8, 16, 32, 64, 128, 256},
    "hidden": {2560, 4096, 5120, 8192, 14336},
    "kind": {"qkv", "mlp_in", "mlp_out"},
    "T": {1, 8, 32, 128, 512, 2048, 8192},
    "lora_mode": {"identical", "eight", "distinct256"},
    "dtype": {"bf16", "fp16"},
}

# hidden -> (model, qkv widths, mlp_in widths, mlp_out's input), from the models' configs.
REAL_LAYERS = {
    2560: ("Qwen3-4B", (4096, 1024, 1024), (9728, 9728), 9728),
    4096: ("Llama-3-8B", (4096, 1024, 1024), (14336, 14336), 14336),
    5120: ("Qwen2.5-14B", (5120, 1024, 1024), (13824, 13824), 13824),
    8192: ("Llama-3-70B", (8192, 1024, 1024), (28672, 28672), 28672),
    14336: ("BLOOM-176B", (14336, 14336, 14336), (57344,), 57344),
}


@pytest.fixture(scope="module")
def cases() -> list[grid.GridCase]:
    return grid.grid_cases()


def axes_of(case: grid.GridCase) -> dict:
    layer = case.layer
    return {
        "rank": case.rank,
        "hidden": layer.hidden,
        "kind": layer.kind,
        "T": case.T,
        "lora_mode": case.lora_mode,
        "dtype": case.dtype,
    }


def exists(point: dict) -> bool:
    """1 token has one LoRA; 8 tokens on min(T, 256) LoRAs is the case of 8 LoRAs."""
    T, mode = point.get("T"), point.get("lora_mode")
    return not ((T == 1 and mode not in (None, "identical")) or (T == 8 and mode == "distinct256"))


def test_the_grid_has_at_least_60_distinct_cases(cases):
    assert len(cases) >= 60, len(cases)
    assert len({c.id for c in cases}) == len(cases)
    assert len({tuple(axes_of(c).values()) for c in cases}) == len(cases)


def test_the_docstring_states_the_grid_size_and_its_parts(cases):
    doc = " ".join(grid.__doc__.split())
    assert f"a structured subset of {len(cases)} cases" in doc
    assert f"{grid.parts_needed(cases)} parts of about" in doc


def test_twins_time_every_shape_in_both_dtypes(cases):
    twinned = grid.grid_cases(twins=True)
    shapes = {}
    for c in twinned:
        point = axes_of(c)
        shapes.setdefault(tuple(v for k, v in point.items() if k != "dtype"), set()).add(c.dtype)
    assert all(dtypes == {"bf16", "fp16"} for dtypes in shapes.values())
    assert len(twinned) == 2 * len(shapes) == len({c.id for c in twinned})
    assert set(cases) <= set(twinned)  # the grid's own cases, with their designs
    added = [c for c in twinned if c not in set(cases)]
    assert all(c.design == ("twin",) for c in added)
    assert twinned == sorted(twinned, key=grid._run_order)
    doc = " ".join(grid.__doc__.split())
    already = len(cases) - len(added)
    assert f"has {len(twinned)} cases (the {len(cases)}, of which {already} already" in doc
    assert f"and {len(added)} twins), estimated in {grid.parts_needed(twinned)} parts" in doc
    assert len(grid.grid_cases(quick=True, twins=True)) == 6


def test_every_value_of_every_axis_is_in_the_grid(cases):
    for name, wanted in WANTED.items():
        assert {axes_of(c)[name] for c in cases} == wanted, name


def test_every_pair_of_values_of_two_axes_is_in_the_grid(cases):
    seen = set()
    for c in cases:
        point = axes_of(c)
        seen |= {((a, point[a]), (b, point[b])) for a, b in itertools.combinations(WANTED, 2)}
    missing = [
        ((a, va), (b, vb))
        for a, b in itertools.combinations(WANTED, 2)
        for va in sorted(WANTED[a], key=str)
        for vb in sorted(WANTED[b], key=str)
        if exists({a: va, b: vb}) and ((a, va), (b, vb)) not in seen
    ]
    assert not missing, missing[:10]
    # the covering array alone, at the fewest cases possible: 7 token counts x 6 ranks
    assert len([c for c in cases if "pairs" in c.design]) == 7 * 6


def test_every_case_exists_and_takes_its_mixs_loras(cases):
    loras = {
        "identical": lambda t: 1,
        "eight": lambda t: min(8, t),
        "distinct256": lambda t: min(t, 256),
    }
    for c in cases:
        assert exists(axes_of(c)), c.id
        assert c.num_loras == loras[c.lora_mode](c.T), c.id


def test_the_star_varies_its_base_one_axis_at_a_time(cases):
    base = {
        "rank": 16,
        "hidden": 4096,
        "kind": "qkv",
        "T": 128,
        "lora_mode": "eight",
        "dtype": "bf16",
    }
    star = [axes_of(c) for c in cases if "star" in c.design]
    assert base in star
    for point in star:
        changed = {name for name in base if point[name] != base[name]}
        if point["T"] == 1:  # one token: one LoRA
            assert changed == {"T", "lora_mode"} and point["lora_mode"] == "identical", point
        else:
            assert len(changed) <= 1, point
    for name, wanted in WANTED.items():
        assert {p[name] for p in star} == wanted, name


def test_the_corners_are_the_extremes(cases):
    corners = [c for c in cases if "corner" in c.design]
    assert len(corners) == 8
    assert {(c.T, c.rank) for c in corners} == {(1, 8), (1, 256), (8192, 8), (8192, 256)}
    sizes = [len(x.slices) * x.in_features + sum(x.slices) for m in grid.MODELS.values() for x in m]
    assert {c.layer.weights_per_rank() for c in corners} == {min(sizes), max(sizes)}


def test_every_layer_has_its_models_real_widths(cases):
    assert set(grid.MODELS) == set(REAL_LAYERS)
    for c in cases:
        model, qkv, mlp_in, intermediate = REAL_LAYERS[c.layer.hidden]
        layer = c.layer
        assert layer.model == model, c.id
        want = {
            "qkv": (layer.hidden, qkv),
            "mlp_in": (layer.hidden, mlp_in),
            "mlp_out": (intermediate, (layer.hidden,)),
        }[layer.kind]
        assert (layer.in_features, layer.slices) == want, c.id


def test_every_cases_layer_shapes_are_consistent(cases):
    """q, k and v: k as wide as v, whole groups of query heads (of 128) per KV head; the
    MLP's input is the model's hidden size, gate and up equal; its output the hidden size,
    from the MLP's width. Each op's Case carries the layer as the kernels take it."""
    for c in cases:
        layer, (qkv, mlp_in, mlp_out) = c.layer, grid.MODELS[c.layer.hidden]
        if layer.kind == "qkv":
            q, k, v = layer.slices
            assert k == v and q % k == 0 and k % 128 == 0, c.id
            assert layer.in_features == layer.hidden, c.id
        elif layer.kind == "mlp_in":
            assert len(layer.slices) in (1, 2) and len(set(layer.slices)) == 1, c.id
            assert layer.in_features == layer.hidden, c.id
        else:
            assert layer.slices == (layer.hidden,), c.id
            assert layer.in_features == mlp_in.slices[0], c.id
        assert layer in (qkv, mlp_in, mlp_out)
        for op in ("shrink", "expand"):
            case = c.op_case(op)
            assert (case.op, case.hidden, case.slices) == (op, layer.in_features, [*layer.slices])
            assert (case.T, case.rank, case.dtype, case.num_loras) == (
                c.T,
                c.rank,
                c.dtype,
                c.num_loras,
            )


def test_floor_bytes_of_hand_checked_cases():
    # Llama-3-8B's QKV, r=16, 128 tokens on 8 LoRAs, bf16 (2 bytes), 3 slices of 4096/1024/1024.
    case = grid.GridCase(grid.MODELS[4096][0], 16, 128, "eight", "bf16")
    x = 128 * 4096 * 2  # x once
    a = 8 * 3 * 16 * 4096 * 2  # 8 LoRAs' A, 3 slices of [16, 4096]
    buffer = 3 * 128 * 16 * 4  # the fp32 buffer [3, 128, 16], written (shrink) or read (expand)
    b = 8 * (4096 + 1024 + 1024) * 16 * 2  # 8 LoRAs' B, [6144, 16] in all
    y = 2 * 128 * 6144 * 2  # y read and written
    assert case.floor_bytes("shrink") == x + a + buffer == 4_218_880
    assert case.floor_bytes("expand") == buffer + b + y == 4_743_168
    assert case.floor_bytes("pair") == 8_962_048
    # Llama-3-70B's down_proj, r=64, 8192 tokens on 256 LoRAs, fp16 (2 bytes): 28672 -> 8192.
    case = grid.GridCase(grid.MODELS[8192][2], 64, 8192, "distinct256", "fp16")
    shrink = 8192 * 28672 * 2 + 256 * 64 * 28672 * 2 + 8192 * 64 * 4
    expand = 8192 * 64 * 4 + 256 * 8192 * 64 * 2 + 2 * 8192 * 8192 * 2
    assert (case.floor_bytes("shrink"), case.floor_bytes("expand")) == (shrink, expand)
    assert case.floor_bytes("pair") == shrink + expand == 1_950_351_360


def test_the_new_lora_mixes_count_their_loras():
    assert bench.Case("shrink", 8192, "distinct256", 8, 4, "bf16", [8]).num_loras == 256
    assert bench.Case("shrink", 100, "distinct256", 8, 4, "bf16", [8]).num_loras == 100
    assert bench.Case("shrink", 5, "eight", 8, 4, "bf16", [8]).num_loras == 5
    assert bench.Case("shrink", 512, "eight", 8, 4, "bf16", [8]).num_loras == 8


def assert_partition(parts: list[list], cases: list) -> None:
    """Each part non-empty, no case in two, every case in one, the run order kept."""
    assert all(parts), [len(p) for p in parts]
    flat = [c for part in parts for c in part]
    assert len(set(flat)) == len(flat), "a case is in two parts"
    assert flat == list(cases), "the parts do not hold the grid, in order"


def test_a_broken_partition_is_caught(cases):
    with pytest.raises(AssertionError):
        assert_partition([cases[:10], cases[9:]], cases)  # one case twice
    with pytest.raises(AssertionError):
        assert_partition([cases[:10], cases[11:]], cases)  # one case missing
    with pytest.raises(AssertionError):
        assert_partition([cases[:10], [], cases[10:]], cases)  # an empty part


@pytest.mark.parametrize("n", [1, 2, 3, 5, 13])
def test_parts_partition_the_grid(cases, n):
    parts = grid.split(cases, n)
    assert len(parts) == n
    assert_partition(parts, cases)
    assert_partition(grid.split(cases, len(cases)), cases)  # as many parts as cases


def test_the_parts_needed_fit_the_budget_and_fewer_do_not(cases):
    n = grid.parts_needed(cases)
    assert all(grid.part_estimate_s(p) <= grid.PART_BUDGET_S for p in grid.split(cases, n))
    if n > 1:
        fewer = grid.split(cases, n - 1)
        assert max(grid.part_estimate_s(p) for p in fewer) > grid.PART_BUDGET_S
    # about equal shares: no part over 1.5 times the mean
    times = [grid.part_estimate_s(p) - grid.PROCESS_S for p in grid.split(cases, 3)]
    assert max(times) <= 1.5 * sum(times) / 3, times


def test_the_estimate_grows_with_the_pool_and_the_bytes():
    """A case's estimate: the fixed cost, plus host time per call of its pools (hundreds
    of sets for a tiny case), plus device time per byte (a large one)."""
    tiny = grid.GridCase(grid.MODELS[2560][2], 8, 1, "identical", "bf16")
    large = grid.GridCase(grid.MODELS[14336][0], 256, 8192, "distinct256", "bf16")
    middle = grid.GridCase(grid.MODELS[4096][0], 16, 512, "eight", "bf16")
    assert bench.pool_size(tiny.floor_bytes("shrink"), gpu=True) == 719  # 120 MiB / 171 KiB
    # tiny: 3 pools of hundreds of calls prepared twice each, and torch's of many ops
    assert grid.estimate_s(tiny) > grid.estimate_s(middle) > grid.CASE_S
    # large: 24 device runs of a pool of 2, at the assumed rate, for each of its three runs
    device = 24 * 2 * 2 * large.floor_bytes("pair") / (grid.ASSUMED_TBPS * 1e12)
    assert grid.estimate_s(large) >= grid.CASE_S + device


def test_every_case_fits_in_memory(cases):
    over = [c.id for c in cases if grid.peak_bytes(c) > grid.MEMORY_LIMIT]
    assert not over, over


def test_the_part_argument_is_checked(capsys):
    for bad in ("0/3", "4/3", "1", "one/two"):
        with pytest.raises(SystemExit):
            grid.main(["--list", "--part", bad])
    assert "--part" in capsys.readouterr().err


def test_a_part_lists_its_share_of_the_grid(cases, capsys):
    assert bench.main(["--grid", "--list", "--part", "2/3"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^ *\d+ +[\d.]+ s  (.+)  \[", out, flags=re.MULTILINE)
    assert listed == [c.id for c in grid.split(cases, 3)[1]]
    assert bench.main(["--grid", "--list", "--twins", "--part", "3/3"]) == 0
    out = capsys.readouterr().out
    listed = re.findall(r"^ *\d+ +[\d.]+ s  (.+)  \[", out, flags=re.MULTILINE)
    assert listed == [c.id for c in grid.split(grid.grid_cases(twins=True), 3)[2]]


def fake_record(case: grid.GridCase, us: float) -> dict:
    """A record shaped as a run's, with made-up times (a test of the plumbing only)."""
    record = case.describe()
    for run in ("shrink", "expand", "pair"):
        record[run] = {"us": us, "bytes": case.floor_bytes(run), "of_copy_bw": None}
    record["pair"]["torch_gather_bmm_us"] = 2 * us
    return record


def fake_result(records: list[dict], commit="abc", part="1/2") -> dict:
    return {
        "commit": commit,
        "gpu": "a GPU",
        "copy_bandwidth_tbps": 4.0,
        "grid": {
            "format": grid.FORMAT,
            "part": part,
            "cases_in_grid": 6,
            "parts": [{"part": part, "copy_bandwidth_tbps": 4.0}],
            "cases": records,
        },
    }


def test_merge_joins_parts_and_refuses_a_case_twice(cases, tmp_path):
    one = fake_result([fake_record(c, 5.0) for c in cases[:3]])
    two = fake_result([fake_record(c, 9.0) for c in cases[3:6]], part="2/2")
    paths = []
    for k, result in enumerate((one, two)):
        paths.append(tmp_path / f"part{k}.json")
        paths[-1].write_text(json.dumps(result))
    out, plot = tmp_path / "grid.json", tmp_path / "grid.png"
    assert grid.main(["--merge", *map(str, paths), "--json", str(out), "--plot", str(plot)]) == 0
    merged = json.loads(out.read_text())
    assert [c["id"] for c in merged["grid"]["cases"]] == [c.id for c in cases[:6]]
    assert [p["part"] for p in merged["grid"]["parts"]] == ["1/2", "2/2"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="more than one part"):
        grid.merge([one, one])
    with pytest.raises(ValueError, match="commit"):
        grid.merge([one, fake_result(two["grid"]["cases"], commit="def")])
    bigger = fake_result(two["grid"]["cases"], part="2/2")
    bigger["grid"]["cases_in_grid"] = 12  # a part of the grid with its twins
    with pytest.raises(ValueError, match="different grids"):
        grid.merge([one, bigger])


def test_resume_keeps_the_records_it_is_given(tmp_path):
    """With every case of the (tiny) grid in the earlier file, nothing is run again."""
    quick = grid.grid_cases(quick=True)
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(fake_result([fake_record(c, 7.0) for c in quick])))
    out = tmp_path / "again.json"
    args = ["--quick", "--commit", "abc", "--resume", str(earlier), "--json", str(out)]
    assert grid.main(args) == 0
    got = json.loads(out.read_text())["grid"]
    assert [c["shrink"]["us"] for c in got["cases"]] == [7.0] * len(quick)
    assert [p["part"] for p in got["parts"]] == ["1/2", "1/1"]  # the earlier run's, this one's
    with pytest.raises(SystemExit):  # a file of another commit is not resumed
        grid.main(["--quick", "--commit", "def", "--resume", str(earlier), "--json", str(out)])


def test_the_quick_grid_runs_and_writes_json_and_plot(tmp_path, capsys):
    """Through ``bench --grid``: every run of every tiny case checked, timed (on the
    simulator: host times, meaningless), recorded with its floor; the plot written."""
    out, plot = tmp_path / "grid.json", tmp_path / "grid.png"
    assert bench.main(["--grid", "--quick", "--json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert {"commit", "gpu", "copy_bandwidth_tbps", "grid"} <= set(result)
    got = result["grid"]
    quick = grid.grid_cases(quick=True)
    assert got["format"] == grid.FORMAT and got["cases_in_grid"] == len(quick)
    assert 2 <= len(got["cases"]) <= 4
    assert [c["id"] for c in got["cases"]] == [c.id for c in quick]
    assert {c["kind"] for c in got["cases"]} == {"qkv", "mlp_in", "mlp_out"}
    assert {c["dtype"] for c in got["cases"]} == {"bf16", "fp16"}
    simulator = result["gpu"] == "simulator"
    for case, record in zip(quick, got["cases"]):
        assert "error" not in record, record
        for run in ("shrink", "expand", "pair"):
            entry = record[run]
            assert entry["us"] > 0 and entry["bytes"] == case.floor_bytes(run), (run, entry)
            assert entry["relative_error"] <= 1e-2, (run, entry)
            assert (entry["of_copy_bw"] is None) == simulator, (run, entry)
        assert record["pair"]["torch_gather_bmm_us"] > 0
        assert record["wall_s"] >= 0 and record["estimate_s"] > 0
    assert got["parts"][0]["cases"] == len(quick) and got["parts"][0]["wall_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "gate_up_proj" in printed
    assert re.search(r"the pair faster than torch's gather \+ bmm +- +- +\d+/3", printed)
    if simulator:
        assert "say nothing about GPU speed" in printed
