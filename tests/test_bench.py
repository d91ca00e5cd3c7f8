"""The benchmark runs end to end (on the simulator: its tiny smoke cases) and writes its files."""

from __future__ import annotations

import json

import pytest
import torch

from punica_numba import bench, bench_moe

KEYS = {
    "op",
    "T",
    "lora_mode",
    "num_loras",
    "hidden",
    "rank",
    "dtype",
    "us",
    "torch_gather_bmm_us",
    "bytes",
    "slices",
}


def test_bench_writes_json_and_plot(tmp_path, capsys):
    out, plot = tmp_path / "bench.json", tmp_path / "roofline.png"
    assert bench.main(["--quick", "--json", str(out), "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    assert {"commit", "gpu", "copy_bandwidth_tbps", "cases", "host_overhead_us"} <= set(result)
    assert "tuned_table" in result
    assert result["cases"] and all(KEYS <= set(c) for c in result["cases"])
    assert {c["lora_mode"] for c in result["cases"]} == {"identical", "uniform", "distinct"}
    assert "add_lora_linear_eager" in result["host_overhead_us"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "shrink" in capsys.readouterr().out


def test_floor_bytes_match_the_issue_table():
    """The copy-bandwidth floors of the issue's table (4.2 TB/s) follow from floor_bytes."""
    for op, t, mode, us in [
        ("shrink", 256, "distinct", 8.5),
        ("expand", 256, "distinct", 9.0),
        ("shrink", 4096, "identical", 8.1),
        ("expand", 4096, "uniform", 18.0),
    ]:
        case = bench.Case(op, t, mode, 4096, 16, "bf16", [4096])
        assert case.floor_bytes() / 4.2e6 == pytest.approx(us, abs=0.06)


def test_a_timed_pool_fills_twice_the_l2(monkeypatch):
    """On a GPU a pool holds enough argument sets to fill twice the L2 (at least 2, at
    most 1024); on the simulator one."""
    monkeypatch.setattr(bench, "SIMULATOR", False)
    r64_expand_256_16 = bench.Case("expand", 256, "uniform", 4096, 64, "bf16", [4096]).floor_bytes()
    assert bench.pool_size(r64_expand_256_16) == 10  # 120 MiB over 12.1 MiB
    assert bench.pool_size(bench.L2_BYTES) == 2
    assert bench.pool_size(bench.L2_BYTES + 1) == 2
    assert bench.pool_size(10**12) == 2
    assert bench.pool_size(1000) == 1024
    assert bench.pool_size(2**20, pool_bytes=3 * 2**20) == 3
    monkeypatch.setattr(bench, "SIMULATOR", True)
    assert bench.pool_size(r64_expand_256_16) == 1


def test_uniform_mode_uses_ceil_sqrt_loras():
    assert bench.Case("shrink", 1024, "uniform", 8, 4, "bf16", [8]).num_loras == 32
    assert bench.Case("shrink", 5, "uniform", 8, 4, "bf16", [8]).num_loras == 3


@pytest.mark.gpu
def test_timing_settles_the_process_graphs_once(monkeypatch):
    """Before the first graph it times, a process makes ``SETTLING_CAPTURES`` captures of
    its own (a process's first three graphs run small kernels faster than the later ones
    on the H200: every case is timed in the later state), and only once."""
    import torch

    made, real = [], torch.cuda.CUDAGraph

    def counted(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", counted)
    monkeypatch.setattr(bench, "_settled", False)
    x = torch.zeros(8, device="cuda")
    counts = []
    for _ in range(2):
        before = len(made)
        bench.time_calls([lambda: x.add_(1.0)], repeats=2)
        counts.append(len(made) - before)
    assert counts == [bench.SETTLING_CAPTURES + 1, 1], counts


def test_bench_moe_writes_json(tmp_path, capsys):
    """``bench --moe``: every case checked against the reference, then timed."""
    out = tmp_path / "moe.json"
    assert bench.main(["--moe", "--quick", "--json", str(out), "--shrink-version", "2"]) == 0
    result = json.loads(out.read_text())
    assert {"commit", "gpu", "copy_bandwidth_tbps", "cases"} <= set(result)
    cases = result["cases"]
    assert {c["projection"] for c in cases} == {"w13", "w2"}
    for c in cases:
        assert c["us"] > 0 and c["floor_bytes"] > 0 and c["relative_error"] <= 1e-2
        assert c["shrink_version"] == 2
    assert "moe w13" in capsys.readouterr().out


def test_bench_moe_floor_counts_each_adapter_and_expert_once():
    """Two tokens on one adapter sharing one of their two experts: three (adapter, expert)
    weights, the rows, and the outputs read and written."""
    case = bench_moe.MoECase("w13", 2, 1, hidden=8, experts=4, top_k=2, intermediate=6, rank=2)
    args = dict(
        slots=torch.tensor([0, 0]),
        topk_ids=torch.tensor([[0, 1], [1, 3]]),
        x=torch.zeros(2, 8),
    )
    weights = 3 * 2 * 2 * (8 + 6)  # (adapter, expert)s x slices x rank x (K + N)
    rows, outputs = 2 * 8, 2 * (2 * 2) * 2 * 6  # x; read + write of 4 pairs x 2 slices x N
    assert bench_moe.floor_bytes(case, args) == 2 * (weights + rows + outputs)


def _peer_script():
    """docs/benchmarks/peers/vllm_moe_lora.py, loaded by path (a script, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "docs" / "benchmarks" / "peers" / "vllm_moe_lora.py"
    spec = importlib.util.spec_from_file_location("vllm_moe_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_vllm_peer_script_picks_the_configurations_vllm_would(tmp_path):
    """The entry nearest the token count; the shrink's BLOCK_SIZE_N and the expand's
    BLOCK_SIZE_K capped at the next power of two of the rank, the latter at least 16."""
    peer = _peer_script()
    folder = tmp_path / "vllm" / "model_executor" / "layers" / "fused_moe" / "configs"
    folder.mkdir(parents=True)
    table = {
        "1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "num_warps": 4},
        "64": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_warps": 8},
    }
    (folder / "E=128,N=768,device_name=NVIDIA_H200.json").write_text(json.dumps(table))
    case = bench_moe.MoECase("w13", 48, 4, rank=16)  # nearest entry: 64
    shrink, expand = peer.configs(tmp_path, case)
    assert shrink == {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 64, "NUM_WARPS": 8}
    assert expand == {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 16, "NUM_WARPS": 8}
    shrink, expand = peer.configs(tmp_path, bench_moe.MoECase("w2", 2, 1, rank=64))
    assert shrink["BLOCK_SIZE_N"] == 64 and expand["BLOCK_SIZE_K"] == 64  # (entry "1")
    shrink, expand = peer.configs(tmp_path, bench_moe.MoECase("w2", 2, 1, rank=4))
    assert shrink["BLOCK_SIZE_N"] == 4 and expand["BLOCK_SIZE_K"] == 16


def test_the_vllm_peer_script_runs_its_cases_through_an_op_of_vllms_signature(tmp_path):
    """The script's plumbing on the simulator: an op with the signature of vLLM 0.33's
    ``_fused_moe_lora``, here ours behind it, gets the blocks (or, sparse, each pair's
    expert) and the configurations, and its result passes the benchmark's check."""
    from punica_numba import fused_moe_lora
    from punica_numba.moe_meta import align_pairs

    peer = _peer_script()
    seen = []

    def op(y, x, a, b, weights, sorted_ids, expert_ids, post, mapping, rank, top_k, lora_ids,
           active, enabled, *settings, mul_routed_weight=False):  # fmt: skip
        assert len(settings) == 14 and rank == a[0].shape[2] and int(active) == a[0].shape[0]
        block = settings[0]
        if sorted_ids is None:  # one block a pair: each pair's expert
            pairs = expert_ids.view(y.shape[0], top_k)
            sorted_ids, expert_ids, post = align_pairs(
                pairs, mapping, a[0].shape[1], 1, a[0].shape[0], enabled
            )
            block = 1
        seen.append(block)
        fused_moe_lora(
            y, x, a, b, weights, sorted_ids, expert_ids, post, enabled, block_size=block,
            mul_routed_weight=mul_routed_weight,
        )  # fmt: skip

    folder = tmp_path / "vllm" / "model_executor" / "layers" / "fused_moe" / "configs"
    folder.mkdir(parents=True)
    small = dict(hidden=8, top_k=2, intermediate=6, rank=2, block_size=2)
    sparse_case = bench_moe.MoECase("w2", 1, 4, experts=32, **small)  # 1 x 2 x 8 <= 32 x 4
    for case in [*bench_moe.default_cases(quick=True), sparse_case]:
        name = f"E={case.experts},N={case.intermediate},device_name=NVIDIA_H200.json"
        (folder / name).write_text(json.dumps({"1": {"BLOCK_SIZE_M": 2, "num_warps": 4}}))
        record = peer.run(tmp_path, case, op, bandwidth=1.0)
        assert record["relative_error"] <= 1e-2 and record["us"] > 0
        sparse = case.T * case.top_k * peer.SPARSITY_FACTOR <= case.experts * case.loras
        assert record["one_block_per_pair"] == sparse
    assert {1, 2} <= set(seen)  # both kinds of block were taken
