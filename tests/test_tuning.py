"""The tuned table and the tuner: format, lookup, the launcher's use of it, the CLI.

The table tests fake a GPU (a name, the GPU's configuration table, folders in tmp_path);
the tuner tests run the simulator's smoke grid (three tiny problems; ``--moe``'s four),
whose times mean nothing but whose pipeline is the GPU's: pools, checks, timing, the file.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from punica_numba import __main__ as cli
from punica_numba import bench, bench_moe, launch
from punica_numba.launch import (
    choose_launch_config,
    config_name,
    force_launch_config,
    launch_configs,
)
from punica_numba.ops import api, moe_dense
from punica_numba.ops import moe as moe_ops
from punica_numba.tuning import moe_sweep, near, report, sweep, table
from punica_numba.tuning.table import (
    CONFIG_DIR_VARIABLE,
    MAX_DISTANCE,
    TunedTableError,
    distance,
    entry_key,
    layer_of,
    new_table,
    read_table,
    reload_tuned_tables,
    tokens_per_lora,
    tuned_config,
    tuned_table_path,
    validate_table,
    write_table,
)

GPU = "Fake GPU 9000"
FILE = "Fake_GPU_9000.json"


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU named :data:`GPU`, of compute capability 9.0, with the GPU's configurations,
    its package folder empty (returned), no user folder; the loaded table forgotten before
    and after."""
    monkeypatch.setattr(table, "SIMULATOR", False)
    monkeypatch.setattr(launch, "SIMULATOR", False)
    monkeypatch.setattr(table, "gpu_name", lambda: GPU)
    monkeypatch.setattr(table, "gpu_capability", lambda: (9, 0))
    monkeypatch.delenv(table.FALLBACK_VARIABLE, raising=False)
    package = tmp_path / "package"
    package.mkdir()
    monkeypatch.setattr(table, "PACKAGE_DIR", package)
    monkeypatch.delenv(CONFIG_DIR_VARIABLE, raising=False)
    reload_tuned_tables()
    yield package
    reload_tuned_tables()


def named(op: str, name: str):
    """The configuration of ``op`` called ``name`` on this machine's table."""
    configs = {config_name(c): c for c in launch_configs(op)}
    assert name in configs, f"test setup: {name} not in {sorted(configs)}"
    return configs[name]


def entry(op="shrink", config="rows_t256_m1_n2", **fields) -> dict:
    """A valid entry: shrink bf16, one slice, K=4096, r=16, T=256 on 16 LoRAs."""
    rank = fields.get("rank", 16)
    base = dict(op=op, dtype="bf16", slices=1, K=4096, N=rank, rank=rank, T=256)
    if op == "expand":
        base.update(K=rank, N=4096)
    base.update(tokens_per_lora=16, config=config, us=5.0, runner_up=None, runner_up_us=None)
    base.update(fields)
    return base


def save(folder, *entries, gpu=GPU, capability=None) -> None:
    doc = new_table(gpu, "0.1.0", "abc123", capability)
    doc["entries"] = list(entries)
    write_table(folder / table.table_file_name(gpu), doc)


def shrink_call(T=256, active=16, rank=16, K=4096, slices=1, dtype=torch.bfloat16):
    return tuned_config("shrink", dtype, slices, K, rank, rank, T, active)


# --------------------------------------------------------------------------- #
# The file
# --------------------------------------------------------------------------- #
def test_table_round_trips(fake_gpu):
    doc = new_table(GPU, "0.1.0", "abc123")
    doc["entries"] = [
        entry(T=1024, tokens_per_lora=64, runner_up="rows_t256_m1_n4", runner_up_us=6.5),
        entry(
            op="expand",
            config="mma_t32_m16_n64",
            slices=3,
            widths=[4096, 1024, 1024],
            heuristic="rows_t128_m1_n128",
            heuristic_us=9.0,
            times_us={"mma_t32_m16_n64": 5.0, "rows_t128_m1_n128": 9.0},
            failed={"lanes_t64_m1_n0": "AssertionError: relative error 1"},
            skipped=["lanes_t128_m1_n0_v4"],
            tuned_s=1.5,
        ),
    ]
    doc["unresolved"] = [
        {k: v for k, v in entry(T=8).items() if k in table.KEY_FIELDS} | {"failed": {}}
    ]
    path = fake_gpu / FILE
    write_table(path, doc)
    back = read_table(path)
    assert back["gpu"] == GPU and back["format"] == table.FORMAT
    assert back["package"] == {"version": "0.1.0", "commit": "abc123"}
    assert sorted(back["entries"], key=entry_key) == sorted(doc["entries"], key=entry_key)
    assert back["unresolved"] == doc["unresolved"]
    assert json.loads(path.read_text()) == back


def _broken(doc, change):
    doc = copy.deepcopy(doc)
    change(doc)
    return doc


def _set(**fields):
    return lambda doc: doc["entries"][0].update(fields)


def _unresolved(**fields) -> dict:
    """An unresolved key (T=8), with ``fields``."""
    return {k: v for k, v in entry(T=8).items() if k in table.KEY_FIELDS} | {"failed": {}} | fields


BROKEN = {
    "format 2": (lambda d: d.update(format=2), "format: expected 1, got 2"),
    "no gpu": (lambda d: d.pop("gpu"), "gpu: expected str"),
    "no commit": (lambda d: d["package"].pop("commit"), "package: expected"),
    "entries not a list": (lambda d: d.update(entries={}), "entries: expected a list"),
    "unknown top field": (lambda d: d.update(extra=1), "unknown fields ['extra']"),
    "op": (_set(op="gemm"), "entries[0].op: expected one of"),
    "op a list": (_set(op=["shrink"]), "entries[0].op: expected one of"),
    "dtype": (_set(dtype="int8"), "entries[0].dtype: expected one of"),
    "skipped a number": (_set(skipped=[3]), "entries[0].skipped[0]: expected str, got 3"),
    "widths": (_set(widths=[4096, "1024"]), "entries[0].widths[1]: expected int"),
    "K zero": (_set(K=0), "entries[0].K: expected an integer >= 1, got 0"),
    "T text": (_set(T="256"), "entries[0].T: expected int, got '256'"),
    "T bool": (_set(T=True), "entries[0].T: expected int, got True"),
    "bucket": (_set(tokens_per_lora=3), "entries[0].tokens_per_lora: expected a power of two"),
    "shrink N": (_set(N=32), "entries[0].N: shrink's N is its rank 16, got 32"),
    "missing config": (
        lambda d: d["entries"][0].pop("config"),
        "entries[0].config: missing",
    ),
    "unknown config": (
        _set(config="rows_t7_m1_n1"),
        "entries[0].config: unknown configuration 'rows_t7_m1_n1' of 'shrink'",
    ),
    "expand's config": (_set(config="mma_t32_m16_n64"), "unknown configuration 'mma_t32_m16_n64'"),
    "unknown runner-up": (
        _set(runner_up="nope", runner_up_us=6.0),
        "entries[0].runner_up: unknown configuration 'nope'",
    ),
    "runner-up faster": (
        _set(runner_up="rows_t256_m1_n4", runner_up_us=4.0),
        "entries[0].runner_up_us: 4.0 µs is faster than the winner's 5.0",
    ),
    "runner-up without time": (_set(runner_up="rows_t256_m1_n4"), "entries[0].runner_up_us"),
    "negative time": (_set(us=-1.0), "entries[0].us: expected a finite time > 0"),
    "nan time": (_set(us=float("nan")), "entries[0].us: expected a finite time > 0"),
    "failed winner": (
        _set(failed={"rows_t256_m1_n2": "wrong"}),
        "entries[0].config: 'rows_t256_m1_n2' failed its check",
    ),
    "typo field": (_set(rnak=16), "entries[0]: unknown fields ['rnak']"),
    "past to_rank": (
        _set(config="mma_t512_m16_n0", rank=64, N=64),
        "entries[0].config: 'mma_t512_m16_n0' cannot take rank 64 (to_rank 32)",
    ),
    "times disagree": (_set(times_us={"rows_t256_m1_n2": 7.0}), "entries[0].us: 5.0 is not"),
    "duplicate key": (
        lambda d: d["entries"].append(dict(d["entries"][0])),
        "entries[1]: the same key as entries[0]",
    ),
    "layer": (
        _set(layer="other"),
        "entries[0].layer: expected one of ('dense', 'moe'), got 'other'",
    ),
    "layer a list": (_set(layer=["moe"]), "entries[0].layer: expected one of"),
    "dense by name": (  # "dense" written out is the key of an entry without a layer
        lambda d: d["entries"].append(dict(d["entries"][0], layer="dense")),
        "entries[1]: the same key as entries[0]",
    ),
    "duplicate moe key": (
        lambda d: d["entries"].extend([dict(d["entries"][0], layer="moe")] * 2),
        "entries[2]: the same key as entries[1]: {'op': 'shrink', 'dtype': 'bf16', 'slices': 1, "
        "'K': 4096, 'N': 16, 'rank': 16, 'T': 256, 'tokens_per_lora': 16, 'layer': 'moe'}",
    ),
    "tokens text": (_set(layer="moe", tokens="32"), "entries[0].tokens: expected int, got '32'"),
    "experts float": (_set(layer="moe", experts=8.0), "entries[0].experts: expected int, got 8.0"),
    "top_k bool": (_set(layer="moe", top_k=True), "entries[0].top_k: expected int, got True"),
    "unresolved top_k": (
        lambda d: d.update(unresolved=[_unresolved(layer="moe", top_k="8")]),
        "unresolved[0].top_k: expected int, got '8'",
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_bad_table_names_the_file_and_the_field(fake_gpu, name):
    change, message = BROKEN[name]
    good = new_table(GPU, "0.1.0", "abc123")
    good["entries"] = [entry()]
    validate_table(good, "good.json")  # (the unbroken table passes)
    path = fake_gpu / FILE
    path.write_text(json.dumps(_broken(good, change)))
    with pytest.raises(TunedTableError) as caught:
        read_table(path)
    assert str(caught.value).startswith(f"{path}: "), caught.value
    assert message in str(caught.value), caught.value


def test_a_moe_entry_beside_a_dense_one_of_the_same_key(fake_gpu):
    """The layer is part of the key: a MoE entry (with its call's tokens, experts and top-k)
    and a dense one of the same sizes both validate, and both come back, each with its own
    layer (the dense one without the field); so do unresolved keys of both layers."""
    dense = entry()
    moe = entry(config="mma_t512_m16_n8", layer="moe", tokens=32, experts=8, top_k=8, us=4.0)
    assert entry_key(moe)[:-1] == entry_key(dense)[:-1]
    assert (entry_key(dense)[-1], entry_key(moe)[-1]) == ("dense", "moe")
    assert layer_of(dense) == "dense" and layer_of(moe) == "moe"
    doc = new_table(GPU, "0.1.0", "abc123")
    doc["entries"] = [moe, dense]
    doc["unresolved"] = [_unresolved(), _unresolved(layer="moe", tokens=8, experts=8, top_k=1)]
    path = fake_gpu / FILE
    write_table(path, doc)
    back = read_table(path)
    assert back["entries"] == [dense, moe]  # sorted by key: "dense" before "moe"
    assert "layer" not in back["entries"][0] and back["entries"][1]["layer"] == "moe"
    assert back["unresolved"] == doc["unresolved"]
    assert (back["entries"][1]["tokens"], back["entries"][1]["top_k"]) == (32, 8)


def test_bad_json_and_bad_writes_are_refused(fake_gpu):
    path = fake_gpu / FILE
    path.write_text('{"format": 1,')
    with pytest.raises(TunedTableError, match=re.escape(f"{path}: not JSON")):
        read_table(path)
    doc = new_table(GPU, "0.1.0", "abc123")
    doc["entries"] = [entry(config="unknown_config")]
    other = fake_gpu / "Other.json"
    with pytest.raises(TunedTableError, match="unknown configuration 'unknown_config'"):
        write_table(other, doc)
    assert not other.exists()


def test_file_names_and_buckets():
    assert table.table_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert table.table_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert table.table_file_name("A/B (c)") == "A_B__c_.json"
    # T / active slots to the nearest power of two in log2, halves up; at least 1
    buckets = {(256, 16): 16, (8, 3): 2, (12, 4): 4, (1, 1): 1, (4, None): 1, (4, 0): 1}
    buckets.update({(3, 1): 4, (5, 1): 4, (6, 1): 8, (2, 4): 1})
    for (T, active), want in buckets.items():
        assert tokens_per_lora(T, active) == want, (T, active)
    assert tokens_per_lora(2**1.5, 1) == 4  # exactly half-way: up


# --------------------------------------------------------------------------- #
# Lookup
# --------------------------------------------------------------------------- #
def test_lookup_matches_op_slices_and_dtype(fake_gpu):
    save(fake_gpu, entry(), entry(dtype="fp32", config="rows_t128_m1_n8"))
    want = named("shrink", "rows_t256_m1_n2")
    assert shrink_call() == want
    assert tuned_config("shrink", "bf16", 1, 4096, 16, 16, 256, 16) == want  # a name for dtype
    assert shrink_call(dtype=torch.float32) == named("shrink", "rows_t128_m1_n8")
    assert shrink_call(slices=3) is None
    assert tuned_config("expand", torch.bfloat16, 1, 16, 4096, 16, 256, 16) is None
    assert tuned_table_path() == fake_gpu / FILE


def test_a_16_bit_call_takes_the_other_16_bit_dtype_where_its_own_has_nothing_near(fake_gpu):
    """bf16 and fp16 run the same kernels: an fp16 call with no fp16 entry near takes the
    nearest bf16 one, and the other way round; its own dtype's entry wins wherever one is
    near, however much nearer the other's; fp32 has no sibling."""
    bf16, fp16 = "rows_t256_m1_n2", "rows_t128_m1_n8"
    save(fake_gpu, entry(config=bf16), entry(config=fp16, dtype="fp16", T=2048))
    assert shrink_call(dtype=torch.float16) == named("shrink", fp16)  # 3 away: still near
    assert shrink_call(dtype=torch.float16, T=32, active=2) == named("shrink", bf16)  # 6 away
    assert shrink_call(dtype=torch.bfloat16, T=2048, active=128) == named("shrink", bf16)
    assert shrink_call(dtype=torch.bfloat16, T=2048, active=128, rank=32) == named("shrink", fp16)
    assert shrink_call(dtype=torch.float32) is None


def test_nearest_is_by_log_distance(fake_gpu):
    small, large = "rows_t256_m1_n4", "rows_t128_m1_n8"
    save(
        fake_gpu,
        entry(config=small, T=16, tokens_per_lora=1),
        entry(config=large, T=256, tokens_per_lora=1),
        entry(config="rows_t128_m4_n4", T=256, tokens_per_lora=1, K=14336),
    )
    assert shrink_call(T=32, active=32) == named("shrink", small)  # 1 from 16, 3 from 256
    assert shrink_call(T=128, active=128) == named("shrink", large)  # 3 from 16, 1 from 256
    # K=8192 is nearer 14336 than 4096 in log2 (0.81 against 1), not in plain numbers
    assert shrink_call(T=256, active=256, K=8192) == named("shrink", "rows_t128_m4_n4")
    sizes = dict(K=4096, N=16, rank=16, T=64, tokens_per_lora=1)
    assert distance(sizes, dict(sizes, T=16)) == 2.0
    assert distance(sizes, dict(sizes, rank=32, N=32, tokens_per_lora=4)) == 4.0


def test_ties_go_to_the_smaller_problem_in_any_file_order(fake_gpu):
    small, large = entry(config="rows_t256_m1_n4", T=16), entry(config="rows_t128_m1_n8", T=64)
    for order in ([small, large], [large, small]):
        doc = new_table(GPU, "0.1.0", "abc123")
        doc["entries"] = order
        (fake_gpu / FILE).write_text(json.dumps(doc))  # in this order (write_table sorts)
        reload_tuned_tables()
        assert shrink_call(T=32, active=2) == named("shrink", "rows_t256_m1_n4")  # 1 and 1


def test_each_layer_looks_among_its_own_entries(fake_gpu):
    """A dense call never takes a MoE entry, however much nearer, and a MoE lookup never a
    dense one; ``kernels`` passes over the nearer entries of other kernels (each answer
    remembered apart)."""
    far = dict(T=512, tokens_per_lora=32)  # 2 from the calls below
    save(
        fake_gpu,
        entry(config="rows_t128_m1_n8", **far),
        entry(config="rows_t256_m1_n2", layer="moe"),  # the call's own key
        entry(config="mma_t512_m16_n8", layer="moe", **far),
    )
    moe = functools.partial(tuned_config, "shrink", torch.bfloat16, 1, 4096, 16, 16, 256, 16)
    assert shrink_call() == named("shrink", "rows_t128_m1_n8")
    assert moe(layer="dense") == named("shrink", "rows_t128_m1_n8")
    assert moe(layer="moe") == named("shrink", "rows_t256_m1_n2")
    assert moe(layer="moe", kernels=("mma",)) == named("shrink", "mma_t512_m16_n8")
    assert moe(layer="moe", kernels=("rows", "lanes")) == named("shrink", "rows_t256_m1_n2")
    assert moe(layer="moe", kernels=("lanes",)) is None
    assert moe(layer="dense", kernels=("mma",)) is None
    save(fake_gpu, entry(config="rows_t128_m1_n8"))  # a dense entry alone, at the call's key
    reload_tuned_tables()
    assert shrink_call() == named("shrink", "rows_t128_m1_n8")
    assert moe(layer="moe") is None


def test_the_pick_weighs_every_near_entry(fake_gpu):
    """Off the table's keys, a lookup weighs each configuration on the nearest entries
    (``2 ** -distance`` each): ``a``, the nearest entry's fastest by 1 %, is 3x slower on the
    two entries behind it, so ``b``, near the fastest on all three, is taken; on an entry's
    own key, its pick; a configuration with no time on an entry counts twice its fastest
    there, and one the call cannot use is never taken."""
    a, b, c = "rows_t256_m1_n2", "rows_t256_m1_n4", "mma_t512_m16_n8"
    save(
        fake_gpu,
        entry(config=a, T=128, tokens_per_lora=8, us=1.0, times_us={a: 1.0, b: 1.01, c: 1.5}),
        entry(config=b, T=512, tokens_per_lora=32, us=1.0, times_us={a: 3.0, b: 1.0, c: 1.2}),
        entry(config=b, T=1024, tokens_per_lora=64, us=1.0, times_us={a: 3.0, b: 1.0}),
    )
    assert shrink_call(T=256, active=16) == named("shrink", b)  # 2, 2 and 4 away
    assert shrink_call(T=128, active=16) == named("shrink", a)  # the first entry's own key
    near = [(1.0, e) for e in read_table(fake_gpu / FILE)["entries"]]
    assert table.pick(near, lambda name: name == c) == c  # (untimed on the third: 2x there)
    assert table.pick(near, lambda name: name != b) == c  # 1.5x, 1.2x, 2x; a 1x, 3x, 3x
    assert table.pick(near[:2], lambda name: name != b) == c  # 1.5x, 1.2x; a 1x, 3x
    assert table.pick(near[:1], lambda name: name != b) == a  # 1x; c 1.5x


def test_a_pick_ties_to_the_nearest_entrys_and_counts_failures_as_untimed():
    """Equal weighed times go to the nearest entry's pick; a configuration that failed on
    an entry counts as untimed there, whatever time it holds."""
    a, b = "rows_t256_m1_n2", "rows_t256_m1_n4"
    first = entry(config=a, times_us={a: 1.0, b: 2.0})
    second = entry(config=b, T=512, times_us={a: 2.0, b: 1.0})
    assert table.pick([(1.0, first), (1.0, second)], lambda name: True) == a
    assert table.pick([(1.0, second), (1.0, first)], lambda name: True) == b
    third = entry(config=b, T=1024, times_us={a: 1.0, b: 1.0}, failed={a: "did not run"})
    assert table.pick([(1.0, first), (1.0, second), (1.0, third)], lambda name: True) == b
    # (a: log 1 + log 2 + log 2 against b: log 2 + log 1 + log 1)
    # An entry of the call's own key answers with its pick, however the others weigh
    own, next_to_it = entry(config=a, times_us={a: 1.0, b: 1.01}), entry(times_us={a: 3.0, b: 1.0})
    assert table.pick([(0.0, own), (1.0, next_to_it)], lambda name: True) == a
    assert table.pick([(0.5, own), (1.0, next_to_it)], lambda name: True) == b
    # Weighed by 2 ** -distance: a near entry outweighs two far ones (not so counted flat)
    near, far = entry(config=a, times_us={a: 1.0, b: 1.5}), entry(times_us={a: 1.4, b: 1.0})
    assert table.pick([(1.0, near), (3.0, far), (3.0, far)], lambda name: True) == a
    no_times = entry(config=b, runner_up=a, runner_up_us=7.0, us=5.0)
    assert table.entry_times(no_times) == {b: 5.0, a: 7.0}


def test_nothing_is_near_past_the_cut_off(fake_gpu):
    save(fake_gpu, entry(T=256, tokens_per_lora=1))
    assert MAX_DISTANCE == 3.0
    assert shrink_call(T=2048, active=2048) is not None  # a factor 8 in T: 3, the cut-off
    assert shrink_call(T=4096, active=4096) is None  # 4
    assert shrink_call(T=256, active=256, rank=32) is not None  # rank 1 and N 1: 2
    assert shrink_call(T=256, active=256, rank=64) is None  # 2 + 2


def test_the_user_folder_comes_first(fake_gpu, tmp_path, monkeypatch):
    save(fake_gpu, entry(config="rows_t256_m1_n4"))
    user = tmp_path / "user"
    save(user, entry(config="rows_t128_m1_n8"))
    assert shrink_call() == named("shrink", "rows_t256_m1_n4")
    reload_tuned_tables()
    monkeypatch.setenv(CONFIG_DIR_VARIABLE, str(user))
    assert shrink_call() == named("shrink", "rows_t128_m1_n8")
    assert tuned_table_path() == user / FILE
    reload_tuned_tables()
    (user / FILE).unlink()  # a user folder without this GPU's table: the package's
    assert shrink_call() == named("shrink", "rows_t256_m1_n4")


def test_a_gpu_without_a_table_reads_one_of_its_compute_capability(fake_gpu, monkeypatch):
    """With the fallback on and no file of this GPU's name, the first table (by name) of
    another GPU that says it was tuned on this compute capability is read, and says whose it
    is; one of another capability, or of none given, is not; this GPU's own file wins.
    Off (by default, or any value but ``"1"``), no other GPU's table is read."""
    save(fake_gpu, entry(config="rows_t128_m1_n8"), gpu="Other GPU", capability=(8, 0))
    save(fake_gpu, entry(config="rows_t256_m4_n4"), gpu="Unsaid GPU")
    (fake_gpu / "Broken.json").write_text("{")
    monkeypatch.setenv(table.FALLBACK_VARIABLE, "1")
    assert shrink_call() is None and table.tuned_table_gpu() is None
    save(fake_gpu, entry(config="rows_t256_m1_n4"), gpu="Twin B", capability=(9, 0))
    save(fake_gpu, entry(config="rows_t128_m4_n4"), gpu="Twin C", capability=(9, 0))
    reload_tuned_tables()
    assert shrink_call() == named("shrink", "rows_t256_m1_n4")
    assert tuned_table_path() == fake_gpu / "Twin_B.json"
    assert table.tuned_table_gpu() == "Twin B"
    for off in (None, "0", "yes"):
        reload_tuned_tables()
        if off is None:
            monkeypatch.delenv(table.FALLBACK_VARIABLE)
        else:
            monkeypatch.setenv(table.FALLBACK_VARIABLE, off)
        assert shrink_call() is None and tuned_table_path() is None, off
    reload_tuned_tables()
    monkeypatch.setenv(table.FALLBACK_VARIABLE, "1")
    save(fake_gpu, entry(config="rows_t256_m1_n2"))
    assert shrink_call() == named("shrink", "rows_t256_m1_n2")
    assert table.tuned_table_gpu() == GPU


def test_a_benchmark_records_whose_table_its_launcher_reads(fake_gpu, monkeypatch):
    assert bench.machine_record(1.23456)["tuned_table"] is None
    reload_tuned_tables()
    monkeypatch.setenv(table.FALLBACK_VARIABLE, "1")
    save(fake_gpu, entry(), gpu="Twin B", capability=(9, 0))
    record = bench.machine_record(1.23456)
    assert record["tuned_table"] == {"gpu": "Twin B", "file": "Twin_B.json"}
    assert record["copy_bandwidth_tbps"] == 1.235 and "gpu" in record


def test_a_table_states_its_compute_capability_as_two_numbers(fake_gpu):
    doc = new_table(GPU, "0.1.0", "abc123", (9, 0))
    assert doc["capability"] == [9, 0] and "capability" not in new_table(GPU, "0", "a")
    validate_table(doc)
    for bad in ((9,), [9, "0"], [9, -1], "9.0", [9, 0.0]):
        doc["capability"] = bad
        with pytest.raises(TunedTableError, match="capability: expected"):
            validate_table(doc)


def test_the_shipped_h200_table_is_a_fallback_for_hopper():
    doc = read_table(table.PACKAGE_DIR / "NVIDIA_H200.json")
    assert doc["gpu"] == "NVIDIA H200" and doc["capability"] == [9, 0]
    assert table.fallback_table((9, 0)) == table.PACKAGE_DIR / "NVIDIA_H200.json"
    assert table.fallback_table((8, 0)) is None


def test_the_table_is_read_once_per_process(fake_gpu):
    save(fake_gpu, entry())
    assert shrink_call() is not None
    (fake_gpu / FILE).unlink()
    assert shrink_call() is not None  # remembered ...
    assert shrink_call(T=512, active=32) is not None  # ... for new keys too
    reload_tuned_tables()
    assert shrink_call() is None and tuned_table_path() is None


def test_a_malformed_table_fails_the_first_lookup(fake_gpu):
    (fake_gpu / FILE).write_text(json.dumps({"format": 1}))
    with pytest.raises(TunedTableError, match=re.escape(f"{fake_gpu / FILE}: gpu")):
        shrink_call()
    reload_tuned_tables()
    save(fake_gpu, entry(), gpu="Fake GPU 9000 ")  # another name, the same file name
    (fake_gpu / "Fake_GPU_9000_.json").rename(fake_gpu / FILE)
    with pytest.raises(TunedTableError, match="a table for 'Fake GPU 9000 '"):
        shrink_call()


def test_the_simulator_never_has_a_table(monkeypatch, tmp_path):
    monkeypatch.setattr(table, "SIMULATOR", True)
    monkeypatch.setattr(table, "PACKAGE_DIR", tmp_path)
    monkeypatch.setenv(CONFIG_DIR_VARIABLE, str(tmp_path))
    doc = new_table("simulator", "0.1.0", "abc123")
    doc["entries"] = [entry(op="expand", config=config_name(launch_configs("expand")[1]))]
    (tmp_path / "simulator.json").write_text(json.dumps(doc))
    reload_tuned_tables()
    try:
        assert tuned_config("expand", torch.bfloat16, 1, 16, 4096, 16, 256, 16) is None
        assert tuned_table_path() is None
    finally:
        reload_tuned_tables()


# --------------------------------------------------------------------------- #
# The launcher
# --------------------------------------------------------------------------- #
def choose(op="shrink", T=256, active=16, rank=16, tensor_cores=True, lanes=True, **key):
    return choose_launch_config(op, T, active, rank, tensor_cores, 1, lanes, **key)


SHRINK_KEY = dict(dtype=torch.bfloat16, K=4096, N=16)


def test_the_launcher_takes_a_tuned_configuration(fake_gpu):
    heuristic = choose()
    tuned = named("shrink", "rows_t256_m1_n2")
    assert heuristic != tuned, "test setup: the heuristic must pick something else"
    save(fake_gpu, entry(config="rows_t256_m1_n2"))
    assert choose(**SHRINK_KEY) == tuned
    assert choose() == heuristic  # without dtype, K and N: no lookup
    assert choose(dtype=torch.bfloat16, K=4096) == heuristic  # (N not given)
    far = dict(SHRINK_KEY, N=2**12)  # nothing near (a long K would change the heuristic's pick)
    assert choose(**far) == heuristic


def test_the_launcher_falls_back_where_the_call_cannot_use_it(fake_gpu):
    save(
        fake_gpu,
        entry(config="mma_t512_m16_n16"),
        entry(config="mma_t512_m16_n0", rank=32, N=32),
        entry(op="expand", config="lanes_t128_m1_n0_v4"),
    )
    assert choose(**SHRINK_KEY) == named("shrink", "mma_t512_m16_n16")
    without = choose(tensor_cores=False)
    assert without.kernel != "mma"
    assert choose(tensor_cores=False, **SHRINK_KEY) == without
    # a rank past the nearest entry's to_rank (40 is 0.64 from 32, 1.32 from 16: both near):
    # the nearest entry whose configuration takes it, and the heuristic where none is near
    key40 = dict(SHRINK_KEY, N=40)
    assert choose(rank=32, **dict(SHRINK_KEY, N=32)) == named("shrink", "mma_t512_m16_n0")
    assert choose(rank=40, **key40) == named("shrink", "mma_t512_m16_n16") != choose(rank=40)
    key64 = dict(SHRINK_KEY, N=64)  # (2 from 32, 4 from 16: only the r=32 entry is near)
    assert choose(rank=64, **key64) == choose(rank=64) != named("shrink", "mma_t512_m16_n0")
    expand_key = dict(dtype=torch.bfloat16, K=16, N=4096)
    assert choose("expand", **expand_key) == named("expand", "lanes_t128_m1_n0_v4")
    no_lanes = choose("expand", lanes=False)
    assert no_lanes.kernel != "lanes"
    assert choose("expand", lanes=False, **expand_key) == no_lanes


def test_a_forced_configuration_still_wins(fake_gpu):
    save(fake_gpu, entry(config="rows_t256_m1_n2"))
    forced = named("shrink", "rows_t128_m4_n4")
    with force_launch_config("shrink", forced):
        assert choose(**SHRINK_KEY) == forced
    assert choose(**SHRINK_KEY) == named("shrink", "rows_t256_m1_n2")


def test_a_moe_call_takes_the_moe_entries_of_its_kernels_first(fake_gpu):
    """``moe_kernels``: the table's MoE entries of those kernels before its dense ones, even
    a farther one; the dense ones where no MoE entry is near or the call cannot run it; a
    dense call (no ``moe_kernels``) never a MoE entry; a forced configuration before all."""
    dense, moe = named("shrink", "rows_t256_m1_n2"), named("shrink", "mma_t512_m16_n8")
    save(
        fake_gpu,
        entry(config="rows_t256_m1_n2"),
        entry(config="mma_t512_m16_n8", layer="moe", T=512, tokens_per_lora=32),  # 2 away
    )
    assert choose(**SHRINK_KEY, moe_kernels=("mma",)) == moe
    assert choose(**SHRINK_KEY) == dense
    assert choose(**SHRINK_KEY, moe_kernels=("rows", "lanes")) == dense  # not of its kernels
    assert choose(tensor_cores=False, **SHRINK_KEY, moe_kernels=("mma",)) == dense
    # T=32 on 2 slots: 3 from the dense entry (near), 5 from the MoE one (far)
    assert choose(T=32, active=2) not in (dense, moe), "test setup: the heuristic differs"
    assert choose(T=32, active=2, **SHRINK_KEY, moe_kernels=("mma",)) == dense
    forced = named("shrink", "rows_t128_m4_n4")
    with force_launch_config("shrink", forced):
        assert choose(**SHRINK_KEY, moe_kernels=("mma",)) == forced
    assert choose(**SHRINK_KEY, moe_kernels=("mma",)) == moe


# --------------------------------------------------------------------------- #
# The MoE op's choice (moe_dense._config), host only
# --------------------------------------------------------------------------- #
#: Qwen3-30B-A3B's MoE layer (:data:`moe_sweep.MOE_MODELS`).
QWEN = moe_sweep.MOE_MODELS["Qwen3-30B-A3B"]


def moe_shrink_config(case: bench_moe.MoECase, path: str):
    """The configuration ``moe_dense`` takes for the shrink of ``case`` on ``path``
    ("tiles" or "pairs"), its rows and average as ``fused_moe_lora`` computes them."""
    rows = case.T * case.top_k
    average = moe_ops.pairs_per_block(rows, case.loras, case.experts)
    key = dict(dtype=torch.bfloat16, K=case.K, N=case.rank)
    if path == "tiles":
        runs = functools.partial(moe_dense._shrink_runs, rank=case.rank)
    else:
        runs = moe_dense._one_token_rows
    return moe_dense._config("shrink", rows, average, case.rank, case.slices, key, runs)


def moe_entry(problem: moe_sweep.MoEProblem, config: str) -> dict:
    """A MoE entry of ``config`` at the key the tuner gives ``problem``."""
    return entry(
        config=config, layer="moe", **dict(zip(table.KEY_FIELDS, moe_sweep.problem_key(problem)))
    )


def test_the_moe_op_looks_up_the_key_the_moe_tuner_writes(fake_gpu, monkeypatch):
    """Each path of the op finds the MoE entry at the key :func:`moe_sweep.problem_key` gives
    its shrink, exactly that key (distance 0), and takes it only where its kernels are the
    path's: the tiles an mma entry, the pairs a row one; otherwise what it takes without."""
    tiles = moe_sweep.MoEProblem(bench_moe.MoECase("w2", 2048, 4, rank=16, **QWEN), "shrink")
    # (64 tokens: past the one launch at every version; 16 over 4 adapters is version 16's)
    pairs = moe_sweep.MoEProblem(bench_moe.MoECase("w13", 64, 4, rank=16, **QWEN), "shrink")
    assert moe_sweep.path_of(tiles.case) == "tiles" and moe_sweep.path_of(pairs.case) == "pairs"
    cases = [(p.case, path) for p in (tiles, pairs) for path in ("tiles", "pairs")]
    without = [moe_shrink_config(*c) for c in cases]  # (no table)
    mma, rows = "mma_t256_m16_n16", "rows_t256_m1_n4"
    assert named("shrink", mma) not in without and named("shrink", rows) not in without
    save(fake_gpu, moe_entry(tiles, mma), moe_entry(pairs, rows))
    reload_tuned_tables()
    looked, real = [], launch.tuned_config

    def tuned(*key, layer="dense", kernels=None):
        found = real(*key, layer=layer, kernels=kernels)
        op, dtype, slices, K, N, rank, T, active = key
        sizes = (K, N, rank, T, tokens_per_lora(T, active))
        looked.append(((op, table.DTYPE_NAMES[dtype], slices, *sizes, layer), kernels, found))
        return found

    monkeypatch.setattr(launch, "tuned_config", tuned)
    assert moe_shrink_config(tiles.case, "tiles") == named("shrink", mma)
    assert looked == [(moe_sweep.problem_key(tiles), moe_dense.TILE_KERNELS, named("shrink", mma))]
    looked.clear()
    assert moe_shrink_config(pairs.case, "pairs") == named("shrink", rows)
    assert looked == [(moe_sweep.problem_key(pairs), moe_dense.ROW_KERNELS, named("shrink", rows))]
    # each path passes over an entry of the other's kernels at its very key: what it took
    # without a table
    assert moe_shrink_config(tiles.case, "pairs") == without[1]
    assert moe_shrink_config(pairs.case, "tiles") == without[2]


# --------------------------------------------------------------------------- #
# The tuner
# --------------------------------------------------------------------------- #
#: Whom the smoke run's table is for: the simulator, or on a GPU a name that is not
#: "simulator": the table names this machine's configurations, and a table is checked
#: against the configurations of the machine its name says
#: (:func:`punica_numba.tuning.table.table_machine`).
SMOKE_GPU = "simulator" if launch.SIMULATOR else "Smoke GPU"
SMOKE_FILE = table.table_file_name(SMOKE_GPU)


@pytest.fixture
def smoke(monkeypatch, tmp_path):
    """The tuner's smoke grid on this machine (the simulator's, also on a GPU); returns
    the output folder, where the table is :data:`SMOKE_FILE`. No table is consulted
    meanwhile."""
    monkeypatch.setattr(sweep, "SIMULATOR", True)
    monkeypatch.setattr(sweep, "gpu_name", lambda: SMOKE_GPU)
    monkeypatch.delenv(CONFIG_DIR_VARIABLE, raising=False)
    reload_tuned_tables()
    yield tmp_path / "out"
    reload_tuned_tables()


#: The smoke grid's table as the first test of this process to ask tuned it (the retime
#: tests start from one: each tuning took 15-20 s on the simulator).
_SMOKE_TABLE: dict = {}


def tuned_smoke(smoke) -> None:
    """The smoke grid's table in ``smoke`` (the folder of the fixture of that name): tuned
    by the first test of this process to ask, a copy of it for the later ones."""
    if "bytes" not in _SMOKE_TABLE:
        assert sweep.main(["--out", str(smoke)]) == 0
        _SMOKE_TABLE["bytes"] = (smoke / SMOKE_FILE).read_bytes()
        return
    smoke.mkdir(parents=True, exist_ok=True)
    (smoke / SMOKE_FILE).write_bytes(_SMOKE_TABLE["bytes"])


def counted(monkeypatch) -> list:
    """Record the key of every problem the tuner sweeps."""
    swept, real = [], sweep.tune_case

    def tune_case(case, *args, **kwargs):
        swept.append(sweep.case_key(case))
        return real(case, *args, **kwargs)

    monkeypatch.setattr(sweep, "tune_case", tune_case)
    return swept


def test_the_smoke_run_writes_a_valid_table(smoke, capsys):
    assert cli.main(["tune", "--quick", "--out", str(smoke)]) == 0
    doc = read_table(smoke / SMOKE_FILE)
    grid = sweep.smoke_grid()
    assert [entry_key(e) for e in doc["entries"]] == sorted(sweep.case_key(c) for c in grid)
    for e in doc["entries"]:
        times = e["times_us"]
        assert e["config"] == min(times, key=times.get) and e["us"] == times[e["config"]]
        assert e["runner_up_us"] == sorted(times.values())[1]
        assert set(times) | set(e["failed"]) | set(e["skipped"]) == {
            config_name(c) for c in launch_configs(e["op"])
        }
        assert "layer" not in e  # a dense entry: the default layer, not written
    fp32 = next(e for e in doc["entries"] if e["dtype"] == "fp32")
    assert [n for n in fp32["skipped"] if n.startswith("mma")], "the tensor cores take no fp32"
    out = capsys.readouterr().out
    assert "3 of 3 problems" in out and "mean nothing for speed" in out


def test_the_moe_smoke_run_writes_a_valid_table(smoke, capsys):
    """``tune --moe``: an entry of layer "moe" for each problem of the MoE smoke grid (one
    call on each path, each op), at the key the op looks it up by, its configuration the
    fastest of those its path runs, its call's tokens, experts and top-k recorded; run
    again with ``--resume``, nothing; the report weighs the op's own picks apart."""
    assert cli.main(["tune", "--moe", "--out", str(smoke)]) == 0
    assert "tune: 4 of 4 problems to measure" in capsys.readouterr().out
    doc = read_table(smoke / SMOKE_FILE)
    problems = sorted(moe_sweep.smoke_grid(), key=moe_sweep.problem_key)
    assert {moe_sweep.path_of(p.case) for p in problems} == {"tiles", "pairs"}
    assert [entry_key(e) for e in doc["entries"]] == [moe_sweep.problem_key(p) for p in problems]
    assert doc["unresolved"] == []
    for e, problem in zip(doc["entries"], problems):
        case, times = problem.case, e["times_us"]
        assert e["layer"] == "moe"
        assert (e["tokens"], e["experts"], e["top_k"]) == (case.T, case.experts, case.top_k)
        assert e["T"] == case.T * case.top_k  # the pairs
        assert e["config"] == min(times, key=times.get) and e["us"] == times[e["config"]]
        configs = {config_name(c): c for c in launch_configs(e["op"])}
        assert set(times) | set(e["failed"]) | set(e["skipped"]) == set(configs)
        path = moe_sweep.path_of(case)
        kernels = moe_dense.TILE_KERNELS if path == "tiles" else moe_dense.ROW_KERNELS
        assert {configs[name].kernel for name in times} <= set(kernels), (path, sorted(times))
        assert e["heuristic"] in times  # the op's own pick, timed
    assert cli.main(["tune", "--moe", "--out", str(smoke), "--resume"]) == 0
    assert "tune: 0 of 4 problems to measure" in capsys.readouterr().out
    assert read_table(smoke / SMOKE_FILE) == doc
    assert cli.main(["tune", "--report", str(smoke / SMOKE_FILE)]) == 0
    lines = capsys.readouterr().out.splitlines()
    for group in ("moe shrink", "moe expand"):
        assert [line for line in lines if line.startswith(f"{group}: 2 problems")], lines
    assert not [line for line in lines if line.startswith(("shrink:", "expand:"))], lines


def test_the_moe_grid_takes_none_of_the_dense_grids_options(smoke, capsys):
    """``--moe`` refuses the dense grid's options; ``--moe-layer H,E,K,I`` gives the grid of a
    layer of the user's own (gpt-oss-20b's here) in place of the models, each problem on one
    of the two paths, each key once; a malformed layer, or one without ``--moe``, is a usage
    error naming the option."""
    assert cli.main(["tune", "--moe", "--dry-run", "--out", str(smoke)]) == 0
    assert f"tune: {len(moe_sweep.smoke_grid())} problems for" in capsys.readouterr().out
    for flag, value in (("--hiddens", "4096"), ("--slices", "2")):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["tune", "--moe", flag, value, "--out", str(smoke)])
        assert stopped.value.code == 2
        assert f"{flag} is not an option of --moe" in capsys.readouterr().err
    expand = config_name(launch_configs("expand")[0])  # (--moe --retime takes shrinks only)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["tune", "--moe", "--retime", expand, "--out", str(smoke)])
    assert stopped.value.code == 2 and "not shrink configurations" in capsys.readouterr().err
    assert not smoke.exists()
    layer = moe_sweep.layer_spec("2880,32,4,2880")
    assert layer == dict(hidden=2880, experts=32, top_k=4, intermediate=2880)
    problems = moe_sweep.quick_grid(layers=[layer])
    assert problems and {
        (p.case.hidden, p.case.experts, p.case.top_k, p.case.intermediate) for p in problems
    } == {(2880, 32, 4, 2880)}
    assert all(moe_sweep.path_of(p.case) in ("tiles", "pairs") for p in problems)
    keys = [moe_sweep.problem_key(p) for p in problems]
    assert len(set(keys)) == len(keys)
    assert {p.case.K for p in problems} == {2880}  # w13 reads hidden, w2 the intermediate
    shipped = {moe_sweep.problem_key(p) for p in moe_sweep.quick_grid()}
    assert not shipped & set(keys)  # other sizes: other keys
    for text in ("2880,32,4", "2880,4,32,2880", "a,b,c,d"):
        with pytest.raises(ValueError, match="expected HIDDEN,EXPERTS,TOP_K,INTERMEDIATE"):
            moe_sweep.layer_spec(text)
        with pytest.raises(SystemExit) as stopped:
            cli.main(["tune", "--moe", "--moe-layer", text, "--out", str(smoke)])
        assert stopped.value.code == 2 and "--moe-layer: expected" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        cli.main(["tune", "--moe-layer", "2880,32,4,2880", "--out", str(smoke)])
    assert stopped.value.code == 2
    assert "--moe-layer is an option of --moe" in capsys.readouterr().err
    assert not smoke.exists()


def test_resume_skips_the_keys_done(smoke, monkeypatch, capsys):
    swept = counted(monkeypatch)
    keys = [sweep.case_key(c) for c in sweep.smoke_grid()]
    assert sweep.main(["--out", str(smoke), "--part", "1/3"]) == 0
    assert swept == keys[:1]
    assert sweep.main(["--out", str(smoke)]) == 2  # the file exists: no --resume, no run
    assert "pass --resume" in capsys.readouterr().err and swept == keys[:1]
    assert sweep.main(["--out", str(smoke), "--resume"]) == 0
    assert swept == keys  # the two left
    assert sweep.main(["--out", str(smoke), "--resume"]) == 0
    assert swept == keys  # nothing left
    assert len(read_table(smoke / SMOKE_FILE)["entries"]) == 3


def test_an_interrupted_run_keeps_its_work(smoke, monkeypatch):
    real = sweep.tune_case
    calls = []

    def interrupted(case, *args, **kwargs):
        calls.append(case)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(case, *args, **kwargs)

    monkeypatch.setattr(sweep, "tune_case", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep.main(["--out", str(smoke)])
    doc = read_table(smoke / SMOKE_FILE)
    assert [entry_key(e) for e in doc["entries"]] == [sweep.case_key(calls[0])]


def _fake_entry(case, *args, **kwargs):
    """A valid entry for ``case`` without measuring anything (0.2 s of work)."""
    time.sleep(0.2)
    name = config_name(launch_configs(case.op)[0])
    return dict(zip(table.KEY_FIELDS, sweep.case_key(case)), config=name, us=1.0) | {
        "runner_up": None,
        "runner_up_us": None,
    }


def test_the_budget_stops_before_a_problem_could_overrun(smoke, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "tune_case", _fake_entry)
    assert sweep.main(["--out", str(smoke), "--budget-s", "0.3"]) == 0
    assert len(read_table(smoke / SMOKE_FILE)["entries"]) == 1  # 0.2 s, then 0.2 + 0.2
    assert "2 problems left" in capsys.readouterr().out
    assert sweep.main(["--out", str(smoke), "--resume"]) == 0
    assert len(read_table(smoke / SMOKE_FILE)["entries"]) == 3


def _wrong_when(target_name: str, monkeypatch) -> None:
    """Make every shrink the tuner runs under the forced configuration ``target_name``
    (or, with "*", every shrink) do nothing: a wrong kernel, and the fastest there is.

    The forced configuration's name is what counts, not the launch's: on a GPU the
    launcher may run a forced configuration in a form of another name (a one-LoRA row
    shrink as the one-token row kernel), and the tuner files the result under the name
    it forced.
    """
    real_launch, real_force = api.shrink_launch, sweep.force_launch_config
    forcing: list[str] = []

    @contextlib.contextmanager
    def force_launch_config(op, config):
        forcing.append(config_name(config))
        try:
            with real_force(op, config):
                yield
        finally:
            forcing.pop()

    def shrink_launch(*args, **kwargs):
        launch_ = real_launch(*args, **kwargs)
        name = forcing[-1] if forcing else config_name(launch_.config)
        if target_name in ("*", name):

            def wrong() -> None:
                pass

            wrong.config = launch_.config
            return wrong
        return launch_

    monkeypatch.setattr(sweep, "force_launch_config", force_launch_config)
    monkeypatch.setattr(api, "shrink_launch", shrink_launch)


def test_a_configuration_that_fails_its_check_is_never_chosen(smoke, monkeypatch):
    case = sweep.smoke_grid()[0]
    target = config_name(launch_configs("shrink")[1])
    _wrong_when(target, monkeypatch)
    got = sweep.tune_case(case)
    assert target in got["failed"] and "relative error" in got["failed"][target]
    assert got["config"] != target and target not in got["times_us"]
    doc = new_table(SMOKE_GPU, "0.1.0", "abc123")
    doc["entries"] = [got]
    validate_table(doc)


def test_a_problem_on_which_every_configuration_fails_is_unresolved(smoke, monkeypatch):
    _wrong_when("*", monkeypatch)
    assert sweep.main(["--out", str(smoke), "--part", "1/3"]) == 0
    doc = read_table(smoke / SMOKE_FILE)
    assert doc["entries"] == [] and len(doc["unresolved"]) == 1
    assert set(doc["unresolved"][0]["failed"]) == {config_name(c) for c in launch_configs("shrink")}
    swept = counted(monkeypatch)
    assert sweep.main(["--out", str(smoke), "--part", "1/3", "--resume"]) == 0
    assert swept == []  # not tried again


def _joint_name() -> str:
    """A shrink of the slices side by side, timed by the tuner only: the simulator's one,
    or on a GPU the first of its unstaged ones (the smoke grid's problems are tiny)."""
    return next(config_name(c) for c in launch_configs("shrink") if c.joint and not c.staged)


def test_retime_weighs_named_configurations_on_the_tables_problems(smoke, monkeypatch, capsys):
    """``--retime``: only the entries of the named configurations' op and of the slice
    counts asked for are timed again, each beside its own configuration, and the faster
    kept; every other entry is as it was."""
    tuned_smoke(smoke)
    before = read_table(smoke / SMOKE_FILE)["entries"]
    name = _joint_name()
    timed = []
    real = sweep._measure

    def measure(case, config, *args):
        timed.append((sweep.case_key(case), config_name(config)))
        return real(case, config, *args)

    monkeypatch.setattr(sweep, "_measure", measure)
    assert sweep.main(["--out", str(smoke), "--retime", name, "--slices", "2"]) == 0
    after = read_table(smoke / SMOKE_FILE)["entries"]
    (k,) = [k for k, e in enumerate(before) if e["op"] == "shrink" and e["slices"] == 2]
    key = entry_key(before[k])
    assert timed == [(key, before[k]["config"]), (key, name)]
    assert after[:k] + after[k + 1 :] == before[:k] + before[k + 1 :]
    new = after[k]
    assert new["retimed_with"] == [name] and name in new["times_us"]
    retimed = {n: new["times_us"][n] for n in (before[k]["config"], name)}
    assert new["config"] == min(retimed, key=retimed.get) and new["us"] == retimed[new["config"]]
    out = capsys.readouterr().out
    assert f"timing 1 problems of {smoke / SMOKE_FILE} again beside {name}" in out
    took = new["config"] != before[k]["config"]
    assert f"{int(took)} of 1 problems" in out
    gain = retimed[before[k]["config"]] / new["us"]
    assert (f"the old pick took {gain:.3f}x the new one's time" in out) == took


def test_retime_on_another_gpu_keeps_only_its_own_times(smoke, monkeypatch, capsys):
    """A table retimed on a GPU it was not tuned on (a copy under that GPU's name): the
    entries timed again hold only this run's times, none of the table's GPU beside them;
    the others are as they were."""
    tuned_smoke(smoke)
    before = read_table(smoke / SMOKE_FILE)["entries"]
    copy = smoke / table.table_file_name("another GPU")
    copy.write_bytes((smoke / SMOKE_FILE).read_bytes())
    monkeypatch.setattr(sweep, "gpu_name", lambda: "another GPU")
    name = _joint_name()
    assert sweep.main(["--out", str(smoke), "--retime", name, "--slices", "2"]) == 0
    after = read_table(copy)["entries"]
    (k,) = [k for k, e in enumerate(before) if e["op"] == "shrink" and e["slices"] == 2]
    assert len(before[k]["times_us"]) > 2  # (the smoke grid timed more than these two)
    assert set(after[k]["times_us"]) == {before[k]["config"], name}
    assert after[:k] + after[k + 1 :] == before[:k] + before[k + 1 :]
    out = capsys.readouterr().out
    assert f"the table is {SMOKE_GPU}'s and this is another GPU" in out


def test_retime_says_how_much_faster_the_new_picks_are(smoke, monkeypatch, capsys):
    """With made-up times (the named configuration 8 µs, the entry's own 10): the entry takes
    it, and the summary gives the old pick's time over the new one's."""
    tuned_smoke(smoke)
    name = _joint_name()

    def measured(case, configs, repeats, seed):
        names = [config_name(c) for c in configs]
        return dict(zip(names, [10.0, 8.0])), {}, [], {}

    monkeypatch.setattr(sweep, "_measure_all", measured)
    capsys.readouterr()
    assert sweep.main(["--out", str(smoke), "--retime", name, "--slices", "2"]) == 0
    out = capsys.readouterr().out
    assert "1 of 1 problems timed again took another configuration" in out
    assert "the old pick took 1.250x the new one's time (geometric mean; at most 1.250x)" in out
    (entry,) = [e for e in read_table(smoke / SMOKE_FILE)["entries"] if e["slices"] == 2]
    assert entry["config"] == name and entry["us"] == 8.0 and entry["runner_up_us"] == 10.0


def test_retime_leaves_the_moe_entries_as_they_are(smoke, monkeypatch, capsys):
    """With made-up times (the named configuration 8 µs, the entry's own 10), of a dense
    entry and a MoE entry of the same key only the dense one is timed again."""
    name, first = _joint_name(), config_name(launch_configs("shrink")[0])
    assert name != first
    dense = entry(config=first, slices=2, widths=[4096, 4096], loras=16)
    moe = dict(dense, layer="moe", tokens=32, experts=64, top_k=8)
    doc = new_table(SMOKE_GPU, "0.1.0", "abc123")
    doc["entries"] = [moe, dense]
    write_table(smoke / SMOKE_FILE, doc)
    timed = []

    def measured(case, configs, repeats, seed):
        timed.append(sweep.case_key(case))
        names = [config_name(c) for c in configs]
        return dict(zip(names, [10.0, 8.0])), {}, [], {}

    monkeypatch.setattr(sweep, "_measure_all", measured)
    assert sweep.main(["--out", str(smoke), "--retime", name]) == 0
    assert "timing 1 problems" in capsys.readouterr().out
    assert timed == [entry_key(dense)]
    after = read_table(smoke / SMOKE_FILE)["entries"]
    assert after[1] == moe
    assert after[0]["config"] == name and after[0]["retimed_with"] == [name]


def test_moe_retime_weighs_named_shrinks_on_the_moe_shrink_entries(smoke, monkeypatch, capsys):
    """``--moe --retime NAME``: each MoE shrink entry's call, made again from its fields
    (:func:`moe_sweep.problem_of`: its own key back; an expand entry gives None), is timed
    under its own configuration and NAME, the faster kept, NAME recorded as skipped where
    the entry's path does not run it (the pairs' row kernels); the expand entries and a
    dense entry are as they were; an entry whose call the op takes in its one launch is
    left out."""
    assert cli.main(["tune", "--moe", "--out", str(smoke)]) == 0
    doc = read_table(smoke / SMOKE_FILE)
    moe_entries = list(doc["entries"])
    shrinks = [e for e in moe_entries if e["op"] == "shrink"]
    for e in moe_entries:
        problem = moe_sweep.problem_of(e)
        assert (problem is None) == (e["op"] == "expand")
        assert problem is None or moe_sweep.problem_key(problem) == entry_key(e)
    tiles = next(e for e in shrinks if moe_sweep.path_of(moe_sweep.problem_of(e).case) == "tiles")
    runs = functools.partial(moe_dense._shrink_runs, rank=tiles["rank"])
    name = next(
        config_name(c)
        for c in launch_configs("shrink")
        if runs(c) and config_name(c) != tiles["config"]
    )
    moe_fields = ("layer", "tokens", "experts", "top_k")
    dense = {k: v for k, v in shrinks[0].items() if k not in moe_fields}
    doc["entries"].append(dense)
    write_table(smoke / SMOKE_FILE, doc)
    measured, real = [], moe_sweep.measure_problem

    def measure_problem(problem, configs, repeats=None):
        measured.append((moe_sweep.problem_key(problem), [config_name(c) for c in configs]))
        return real(problem, configs, repeats)

    monkeypatch.setattr(moe_sweep, "measure_problem", measure_problem)
    capsys.readouterr()
    assert sweep.main(["--moe", "--out", str(smoke), "--retime", name]) == 0
    assert "timing 2 problems" in capsys.readouterr().out
    assert measured == [(entry_key(e), [e["config"], name]) for e in shrinks]
    after = {entry_key(e): e for e in read_table(smoke / SMOKE_FILE)["entries"]}
    assert after[entry_key(dense)] == dense
    for e in moe_entries:
        new = after[entry_key(e)]
        if e["op"] == "expand":
            assert new == e
            continue
        assert new["retimed_with"] == [name]
        if e is tiles:
            retimed = {n: new["times_us"][n] for n in (e["config"], name)}
            assert new["config"] == min(retimed, key=retimed.get)
        else:  # (the pairs' row kernels: the tensor-core shrink is not theirs)
            assert name in new["skipped"] and new["config"] == e["config"]
    # calls the op now takes in its one launch (which reads no table) are not timed again
    monkeypatch.setattr(moe_ops, "ONE_LAUNCH_TO_PAIRS", 1 << 20)
    measured.clear()
    assert sweep.main(["--moe", "--out", str(smoke), "--retime", name]) == 0
    assert "timing 0 problems" in capsys.readouterr().out and measured == []


def test_retime_never_takes_a_configuration_that_fails_its_check(smoke, monkeypatch):
    tuned_smoke(smoke)
    entry = next(e for e in read_table(smoke / SMOKE_FILE)["entries"] if e["slices"] == 2)
    name = _joint_name()
    _wrong_when(name, monkeypatch)
    new = sweep.retime_entry(entry, [name])
    assert new["config"] == entry["config"] and name not in new["times_us"]
    assert "relative error" in new["failed"][name]
    doc = new_table(SMOKE_GPU, "0.1.0", "abc123")
    doc["entries"] = [new]
    validate_table(doc)


def test_slices_keep_the_problems_of_those_slice_counts(smoke, capsys):
    for slices, count in (("2", 1), ("1,2", 3), ("3", 0)):
        assert sweep.main(["--out", str(smoke), "--slices", slices, "--dry-run"]) == 0
        assert f"tune: {count} problems for" in capsys.readouterr().out


def test_retime_needs_a_table_and_names_of_configurations(smoke, capsys):
    assert sweep.main(["--out", str(smoke), "--retime", _joint_name()]) == 2
    assert "no table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep.main(["--out", str(smoke), "--retime", "mma_t1_m2_n3"])
    assert "not configurations" in capsys.readouterr().err


def test_the_tuner_needs_an_output_folder(smoke, capsys):
    with pytest.raises(SystemExit) as stopped:
        sweep.main([])
    assert stopped.value.code == 2 and CONFIG_DIR_VARIABLE in capsys.readouterr().err
    assert cli.main(["tune", "--dry-run", "--out", str(smoke)]) == 0
    assert "3 problems" in capsys.readouterr().out
    assert "tune" in cli.COMMANDS


# --------------------------------------------------------------------------- #
# tune --near: a problem timed under its neighbours' picks
# --------------------------------------------------------------------------- #
def doc_of(*entries, gpu=GPU) -> dict:
    doc = new_table(gpu, "0.1.0", "abc123")
    doc["entries"] = list(entries)
    return doc


def test_near_entries_are_the_launchers_nearest_in_order(fake_gpu):
    """The count nearest entries of the problem's layer, op and slice count whose
    configuration takes its rank, nearest first (ties: the smaller problem); of its own dtype
    where any is near, else of the sibling 16-bit one; none past the cut-off."""
    sizes = dict(K=4096, N=16, rank=16, T=256, tokens_per_lora=16)
    at = entry(config="rows_t256_m1_n2")  # 0 away
    larger = entry(config="rows_t128_m1_n8", T=512, tokens_per_lora=32)  # 2 away
    smaller = entry(config="rows_t256_m1_n4", T=128, tokens_per_lora=8)  # 2 away
    far = entry(config="rows_t128_m4_n4", T=4096, tokens_per_lora=256)  # 8 away
    other = [
        entry(config="rows_t128_m1_n8", slices=3),
        entry(op="expand", config="rows_t128_m1_n128"),
        dict(at, layer="moe"),
    ]
    doc = doc_of(larger, far, at, *other, smaller)
    near = functools.partial(table.nearest_entries, doc, "dense", "shrink")
    assert near("bf16", 1, sizes, 8) == [at, smaller, larger]
    assert near("bf16", 1, sizes, 1) == [at]
    assert near("bf16", 3, sizes, 8) == [other[0]]
    assert near("fp16", 1, sizes, 2) == [at, smaller]  # the sibling's: none of its own
    assert near("fp32", 1, sizes, 2) == []  # no sibling
    assert near("bf16", 1, dict(sizes, T=32768, tokens_per_lora=2048), 8) == []
    made_for_small_ranks = entry(config="mma_t512_m16_n0", rank=32, N=32)  # to_rank 32
    any_rank = entry(config="rows_t128_m1_n8", rank=64, N=64, T=512, tokens_per_lora=32)
    doc["entries"] = [made_for_small_ranks, any_rank]
    at_64 = dict(sizes, rank=64, N=64)
    assert near("bf16", 1, at_64, 8) == [any_rank]  # the other 2 away, but not at r=64
    assert near("bf16", 1, dict(sizes, rank=48, N=48), 8) == [any_rank]
    assert near("bf16", 1, dict(sizes, rank=32, N=32), 8) == [made_for_small_ranks]
    fp16 = entry(config="rows_t256_m1_n4", dtype="fp16", T=4096, tokens_per_lora=256)
    doc["entries"] = [at, fp16]
    assert near("fp16", 1, sizes, 8) == [at]  # its own 8 away: not near
    assert near("fp16", 1, dict(sizes, T=2048, tokens_per_lora=256), 8) == [fp16]


_SIZES = st.sampled_from([1, 2, 4, 16, 64, 256, 4096])
_RANKS = st.sampled_from([8, 16, 32, 64, 128])
_DTYPES = st.sampled_from(["bf16", "fp16"])
_CONFIGS = st.sampled_from(
    ["rows_t256_m1_n2", "rows_t128_m1_n8", "rows_t256_m1_n4", "mma_t512_m16_n0"]
)


@given(
    st.lists(st.tuples(_RANKS, _SIZES, _SIZES, _DTYPES, _CONFIGS), min_size=1, max_size=8),
    _RANKS,
    _SIZES,
    _SIZES,
    _DTYPES,
)
@settings(max_examples=60, deadline=None)
def test_the_tuners_nearest_entry_is_the_launchers(
    tmp_path_factory, entries, rank, T, loras, dtype
):
    """For any table and call, the first of ``nearest_entries`` (what ``tune --near`` starts
    its list with) names the configuration that the launcher's lookup answers with."""
    folder = tmp_path_factory.mktemp("near")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(table, "SIMULATOR", False)
        patch.setattr(launch, "SIMULATOR", False)
        patch.setattr(table, "gpu_name", lambda: GPU)
        patch.setattr(table, "PACKAGE_DIR", folder)
        patch.delenv(CONFIG_DIR_VARIABLE, raising=False)
        made = {}
        for r, t, n, d, config in entries:
            reach = named("shrink", config).to_rank
            if reach is None or r <= reach:  # (a valid entry's configuration takes its rank)
                made_entry = entry(config=config, rank=r, N=r, T=t, dtype=d)
                made_entry["tokens_per_lora"] = tokens_per_lora(t, n)
                made[entry_key(made_entry)] = made_entry
        doc = doc_of(*made.values())
        sizes = dict(K=4096, N=rank, rank=rank, T=T, tokens_per_lora=tokens_per_lora(T, loras))
        first = table.nearest_entries(doc, "dense", "shrink", dtype, 1, sizes, 1)
        write_table(folder / FILE, doc)
        reload_tuned_tables()
        try:
            found = tuned_config("shrink", dtype, 1, 4096, rank, rank, T, loras)
            assert found == (named("shrink", first[0]["config"]) if first else None)
        finally:
            reload_tuned_tables()


def test_the_short_list_is_the_neighbours_fastest_then_the_heuristics(fake_gpu):
    """A neighbour gives its three fastest recorded configurations (its config and
    runner-up where it records no times), nearest neighbour first, then come the
    heuristic's picks with and without the tensor cores and lanes, each name once; no
    neighbour, no list."""
    times = {"mma_t512_m16_n8": 4.0, "rows_t256_m1_n2": 3.0, "rows_t128_m1_n8": 5.0}
    times["rows_t256_m1_n4"] = 9.0
    timed = entry(config="rows_t256_m1_n2", us=3.0, times_us=times, T=128, tokens_per_lora=8)
    untimed = entry(config="rows_t128_m4_n4", runner_up="rows_t256_m1_n4", runner_up_us=6.0)
    untimed.update(T=512, tokens_per_lora=32)
    doc = doc_of(untimed, timed)
    key = ("shrink", "bf16", 1, 4096, 16, 16, 256, 16, "dense")
    names = near.candidate_names(doc, key, 16, 2)
    picks = near.heuristic_names("shrink", 256, 16, 16, 1, 4096, 16, "gpu")
    neighbours = ["rows_t256_m1_n2", "mma_t512_m16_n8", "rows_t128_m1_n8", "rows_t128_m4_n4"]
    neighbours.append("rows_t256_m1_n4")
    assert names == list(dict.fromkeys(neighbours + picks))
    assert near.candidate_names(doc, key, 16, 1) == list(dict.fromkeys(neighbours[:3] + picks))
    with_lanes = choose_launch_config("shrink", 256, 16, 16, True, 1, True, K=4096, machine="gpu")
    without = choose_launch_config("shrink", 256, 16, 16, False, 1, False, K=4096, machine="gpu")
    assert {config_name(with_lanes), config_name(without)} <= set(picks)
    assert near.candidate_names(doc, ("expand", *key[1:]), 16, 2) is None


def test_left_out_ratios_weigh_each_entry_by_its_neighbours_list(fake_gpu, capsys):
    """Each entry left out in turn: the fastest of its short list's recorded times over its
    fastest (the heuristic picks neither entry's configurations here); ``tune --report
    --near`` gives their mean and misses."""
    heuristic = set(near.heuristic_names("shrink", 256, 16, 16, 1, 4096, 16, "gpu"))
    heuristic |= set(near.heuristic_names("shrink", 512, 16, 16, 1, 4096, 16, "gpu"))
    first = {"rows_t256_m1_n2": 2.0, "rows_t128_m1_n8": 3.0}
    second = {"rows_t256_m1_n4": 4.0, "rows_t256_m1_n2": 6.0, "rows_t128_m1_n8": 5.0}
    assert not heuristic & (set(first) | set(second))
    a = entry(config="rows_t256_m1_n2", us=2.0, times_us=first)
    b = entry(config="rows_t256_m1_n4", us=4.0, times_us=second, T=512, tokens_per_lora=32)
    far = entry(config="rows_t256_m1_n4", T=65536, tokens_per_lora=4096)  # no neighbour
    doc = doc_of(a, b, far)
    found = near.left_out_ratios(doc, 1)
    # a's list: b's three (rows_t256_m1_n2 at 2.0 among them); b's: a's two (5.0 the least)
    assert [(ratio, entry["T"]) for ratio, _, entry in found] == [(1.0, 256), (1.25, 512)]
    assert [listed for _, listed, _ in found] == [3 + len(heuristic), 2 + len(heuristic)]
    path = fake_gpu / FILE
    write_table(path, doc)
    assert cli.main(["tune", "--report", str(path), "--near", "1"]) == 0
    out = capsys.readouterr().out
    head = "tune --near 1, each problem left out of the table in turn: 2 problems with a neighbour"
    assert head in out
    assert "geometric mean 1.1180x, largest 1.250x; 1 over 1.10x, 0 over 1.25x" in out


def test_a_near_run_times_a_problem_under_its_short_list(smoke, monkeypatch, capsys):
    """``tune --near 1 --resume`` into a table that holds a neighbour of the one-token shrink
    (made-up times): that problem is timed under its short list alone and records ``near``;
    the two problems with no neighbour, under every configuration; a problem whose list
    all fails its check, under every configuration too."""
    smoke.mkdir(parents=True)
    one_token = sweep.smoke_grid()[0]
    key = dict(zip(table.KEY_FIELDS, sweep.case_key(one_token)))
    names = [config_name(c) for c in launch_configs("shrink")]
    times = {names[2]: 1.0, names[1]: 2.0, names[0]: 3.0}
    seed = dict(key, T=2, tokens_per_lora=2, config=names[2], us=1.0, times_us=times)
    seed.update(runner_up=names[1], runner_up_us=2.0)
    doc = new_table(SMOKE_GPU, "0.1.0", "abc123")
    doc["entries"] = [seed]
    write_table(smoke / SMOKE_FILE, doc)
    timed, failing = {}, set()

    def measured(case, configs, repeats, seed):
        asked = [config_name(c) for c in configs]
        timed.setdefault(sweep.case_key(case), []).append(asked)
        ok = [n for n in asked if n not in failing]
        return (
            {n: float(k + 1) for k, n in enumerate(ok)},
            {n: "wrong" for n in failing & set(asked)},
            [],
            {},
        )

    monkeypatch.setattr(sweep, "_measure_all", measured)
    assert sweep.main(["--out", str(smoke), "--resume", "--near", "1"]) == 0
    listed = near.candidate_names(doc, sweep.case_key(one_token), 1, 1)
    assert listed[:3] == [names[2], names[1], names[0]]
    assert timed[sweep.case_key(one_token)] == [[n for n in names if n in listed]]
    for case in sweep.smoke_grid()[1:]:
        full = [config_name(c) for c in launch_configs(case.op)]
        assert timed[sweep.case_key(case)] == [full]
    assert "--near 1: 1 of 3 problems timed under their neighbours' short lists" in (
        capsys.readouterr().out
    )
    entries = {entry_key(e): e for e in read_table(smoke / SMOKE_FILE)["entries"]}
    assert entries[sweep.case_key(one_token)]["near"] == 1
    assert all("near" not in entries[sweep.case_key(c)] for c in sweep.smoke_grid()[1:])
    write_table(smoke / SMOKE_FILE, doc)  # again, every configuration of the list failing
    timed.clear()
    failing.update(listed)
    assert sweep.main(["--out", str(smoke), "--resume", "--near", "1", "--part", "1/3"]) == 0
    assert timed[sweep.case_key(one_token)] == [[n for n in names if n in listed], names]
    (done,) = [e for e in read_table(smoke / SMOKE_FILE)["entries"] if e["T"] == 1]
    assert "near" not in done and done["config"] not in listed


def test_near_takes_a_count_and_no_retime_or_moe(smoke, capsys):
    for argv, why in (
        (["--near", "0"], "--near takes a count of neighbours, 1 or more, got 0"),
        (["--near", "2", "--retime", _joint_name()], "--near picks what a grid's problems"),
        (["--near", "2", "--moe"], "--near is not an option of --moe"),
    ):
        with pytest.raises(SystemExit) as stopped:
            sweep.main(["--out", str(smoke), *argv])
        assert stopped.value.code == 2 and why in capsys.readouterr().err
    assert not smoke.exists()


def test_the_grids(monkeypatch):
    quick = sweep.quick_grid()
    assert len(quick) == 128
    assert {c.rank for c in quick} == {16, 64} and {c.dtype for c in quick} == {"bf16"}
    assert {len(c.slices) for c in quick} == {1, 3} and {c.hidden for c in quick} == {4096}
    assert {c.T for c in quick} == {1, 16, 64, 256, 1024, 4096}
    full = sweep.full_grid()
    keys = [sweep.case_key(c) for c in full]
    assert len(set(keys)) == len(keys), "each key once"
    assert {k[-1] for k in keys} == {"dense"} and len(keys[0]) == len(table.KEY_FIELDS) + 1
    assert {c.dtype for c in full} == {"bf16", "fp16"}
    assert {c.rank for c in full} == {8, 16, 32, 64, 128, 256}
    assert {len(c.slices) for c in full} == {1, 2, 3}
    assert {c.hidden for c in full if c.op == "shrink"} >= {2560, 4096, 5120, 8192, 14336}
    assert max(c.num_loras for c in full) == sweep.MAX_LORAS
    assert sweep.model_layers()[4] == sweep.Layer("4096.qkv", 4096, (4096, 1024, 1024))
    # the parts of a grid cover it once, in order
    monkeypatch.setattr(sweep, "SIMULATOR", False)
    args = sweep._parser().parse_args(["--out", "x", "--quick"])
    parts = []
    for i in range(1, 8):
        args.part = (i, 7)
        parts += sweep._grid(args)
    args.part = None
    assert parts == sweep._grid(args) == quick


def test_the_full_grid_of_one_model(monkeypatch, capsys):
    """``--hiddens 4096``: Llama-3-8B's four layers alone (its down projection's K is 14336,
    its gate_up has two slices), every problem of which the full grid also has."""
    one = sweep.full_grid(ranks=(16, 128), dtypes=("bf16",), hiddens=(4096,))
    assert {c.hidden for c in one if c.op == "shrink"} == {4096, 14336}
    assert {tuple(c.slices) for c in one} == {(4096, 1024, 1024), (4096,), (14336, 14336)}
    assert {sweep.case_key(c) for c in one} < {sweep.case_key(c) for c in sweep.full_grid()}
    monkeypatch.setattr(sweep, "SIMULATOR", False)
    args = sweep._parser().parse_args(["--out", "x", "--hiddens", "4096", "--ranks", "16,128"])
    args.dtypes = ["bf16"]
    assert sweep._grid(args) == one
    for wrong, why in (
        (["--hiddens", "4000"], "choose from"),
        (["--quick", "--hiddens", "4096"], "quick"),
    ):
        with pytest.raises(SystemExit) as stopped:
            sweep.main(["--out", "x", *wrong])
        assert stopped.value.code == 2 and why in capsys.readouterr().err


# -- the report: the heuristic against a table --------------------------------------------


def _report_table(path) -> dict:
    """A GPU's table of three problems: on the first the GPU heuristic's pick (a token a
    slot, T=1: two ranks a block) took twice the fastest's time; on the second it was the
    fastest; on the third its pick has no time (it failed its check)."""
    doc = new_table(GPU, "0.1.0", "abc1234")
    one = entry(config="rows_t256_m1_n4", us=2.0, T=1, tokens_per_lora=1, loras=1)
    one["times_us"] = {"rows_t256_m1_n2": 4.0, "rows_t256_m1_n4": 2.0}
    two = entry(config="rows_t256_m1_n2", us=3.0, T=2, tokens_per_lora=1, loras=2)
    two["times_us"] = {"rows_t256_m1_n2": 3.0, "rows_t256_m1_n4": 3.5}
    three = entry(config="rows_t256_m1_n4", us=3.0, T=4, tokens_per_lora=1, loras=4)
    three["times_us"] = {"rows_t256_m1_n4": 3.0}
    doc["entries"] = [one, two, three]
    write_table(path, doc)
    return doc


def test_the_report_weighs_the_gpu_heuristic_on_any_machine(tmp_path, capsys):
    """On the simulator too, a GPU's table is read with the GPU's configurations, and each
    problem's ratio is the GPU heuristic's time over the fastest: 2.0 and 1.0 here
    (geometric mean 1.414), the third not timed."""
    path = tmp_path / "table.json"
    doc = _report_table(path)  # (written on the simulator: checked by the GPU's names)
    assert launch.choose_launch_config("shrink", 1, 1, 16, machine="gpu").tile_n == 2
    timed, not_timed = report.heuristic_ratios(read_table(path))
    assert [round(r, 6) for r, _, _ in timed] == [2.0, 1.0]
    assert [name for _, name in not_timed] == ["rows_t256_m1_n2"]
    assert cli.main(["tune", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "shrink: 2 problems, geometric mean 1.414x, largest 2.00x" in out
    assert "1 over 1.10x" in out and "not timed: 1 problems" in out
    assert doc["gpu"] in out


def test_the_report_weighs_the_lookup_with_each_problem_left_out(tmp_path):
    """Each problem left out in turn, the lookup's pick from the other two, timed there:
    at T=1 the weighing takes ``rows_t256_m1_n4`` (T=2's fastest takes 3.5/3 there and has no
    time at T=4), the fastest (the nearest entry's pick alone: 2x); at T=2 the same, 3.5/3;
    at T=4 the fastest again (T=2's pick has no time there)."""
    doc = _report_table(tmp_path / "table.json")
    ratios = [(entry["T"], round(ratio, 4)) for ratio, entry in report.lookup_ratios(doc)]
    assert ratios == [(1, 1.0), (2, 1.1667), (4, 1.0)]
    assert (
        "  dense: 3 problems with a neighbour, geometric mean 1.0527x, largest 1.17x; "
        "1 over 1.10x, 0 over 1.25x"
    ) in report.report(doc).splitlines()
    # The nearest entry's pick alone: T=2's fastest at T=1 (2x), T=1's at T=2, T=2's at T=4
    alone = [(e["T"], round(r, 4)) for r, e in report.lookup_ratios(doc, neighbours=1)]
    assert alone == [(1, 2.0), (2, 1.1667), (4, math.inf)]
    # By the nearest other entry's distance (both 1 here), beside the heuristic's picks
    # (2x at T=1, the fastest at T=2; T=4's has no time: left out): nearest, weighed, heuristic
    ((far, problems, *means),) = report.lookup_by_distance(doc)
    assert (far, problems) == (1, 2)
    assert [round(m, 4) for m in means] == [1.5275, 1.0801, 1.4142]
    # Each problem's whole T left out: the others still near; its tokens a LoRA: none is
    assert len(report.lookup_ratios(doc, apart="T")) == 3
    assert report.lookup_ratios(doc, apart="tokens_per_lora") == []


def test_the_report_weighs_a_moe_entry_by_the_pick_it_recorded(tmp_path):
    """A MoE entry's ratio is its recorded ``heuristic``'s time over the fastest (2.5 here),
    not the GPU heuristic's (its rows_t256_m1_n2 at T=1: 1.5), in groups of their own; one
    whose pick has no time is not timed; one without a pick is left out."""
    doc = _report_table(tmp_path / "table.json")
    times = {"rows_t256_m1_n2": 3.0, "rows_t256_m1_n4": 2.0, "rows_t128_m1_n8": 5.0}
    picked = dict(doc["entries"][0], layer="moe", heuristic="rows_t128_m1_n8", times_us=times)
    untimed = dict(picked, T=2, heuristic="rows_t256_m1_n2", times_us={"rows_t256_m1_n4": 2.0})
    nothing = dict(picked, T=4, heuristic=None)
    doc["entries"] += [picked, untimed, nothing]
    validate_table(doc)
    timed, not_timed = report.heuristic_ratios(doc)
    moe = [(round(r, 6), name) for r, e, name in timed if layer_of(e) == "moe"]
    assert moe == [(2.5, "rows_t128_m1_n8")]
    assert [round(r, 6) for r, e, _ in timed if layer_of(e) == "dense"] == [2.0, 1.0]
    assert [(layer_of(e), e["T"], name) for e, name in not_timed] == [
        ("dense", 4, "rows_t256_m1_n2"),
        ("moe", 2, "rows_t256_m1_n2"),
    ]
    lines = report.report(doc).splitlines()
    assert [
        line for line in lines if line.startswith("moe shrink: 1 problems, geometric mean 2.500x")
    ]
    assert [line for line in lines if line.startswith("shrink: 2 problems, geometric mean 1.414x")]


def test_the_report_refuses_a_bad_table(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("{}")
    assert sweep.main(["--report", str(path)]) == 2
    assert "bad.json" in capsys.readouterr().err
    assert sweep.main(["--report", str(tmp_path / "missing.json")]) == 2
