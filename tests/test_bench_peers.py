"""``bench --peers``: the ten layers where the strongest peers were timed, and a tiny run."""

from __future__ import annotations

import json
import math

from punica_numba import bench, bench_peers

# The cases as they were measured, written out here rather than read from the module, so
# that a changed shape, mix or figure fails this test: (in_features, output widths, rank,
# T, LoRAs, best peer µs).
MEASURED = [
    (4096, (4096, 1024, 1024), 32, 32, 8, 14.5),
    (4096, (14336, 14336), 32, 32, 8, 27.2),
    (14336, (4096,), 32, 32, 8, 13.3),
    (4096, (4096, 1024, 1024), 32, 128, 8, 21.2),
    (14336, (4096,), 32, 128, 8, 43.8),
    (4096, (4096,), 128, 64, 8, 27.6),
    (4096, (4096,), 16, 64, 8, 11.2),
    (4096, (4096,), 16, 4096, 1, 44.5),
    (4096, (4096, 1024, 1024), 16, 64, 64, 31.6),
    (4096, (4096,), 16, 256, 256, 54.8),
]


def test_the_peer_cases_are_the_measured_layers():
    got = [
        (p.case.layer.in_features, p.case.layer.slices, p.case.rank, p.case.T)
        + (p.case.num_loras, p.peer_us)
        for p in bench_peers.PEER_CASES
    ]
    assert got == MEASURED
    assert all(p.case.dtype == "bf16" for p in bench_peers.PEER_CASES)


def test_a_tiny_run_writes_each_case_beside_its_peer(tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert bench.main(["--peers", "--quick", "--json", str(out), "--commit", "abc"]) == 0
    result = json.loads(out.read_text())
    assert result["commit"] == "abc"
    assert result["target_ratio"] == bench_peers.TARGET_RATIO
    assert len(result["cases"]) == len(bench_peers.QUICK_CASES)
    for case in result["cases"]:
        for run in ("shrink", "expand", "pair"):
            assert case[run]["us"] > 0 and case[run]["relative_error"] < 1e-2, (run, case)
        assert math.isnan(case["peer"]["us"]) and case["ratio"] is None  # no figure to rate
    printed = capsys.readouterr().out
    assert "qkv_proj" in printed and "gate_up_proj" in printed


def test_the_ratio_is_the_pair_over_the_peer(monkeypatch):
    """A record's ratio is its pair's µs over the peer's; a failed case has none."""
    peer = bench_peers.PEER_CASES[0]
    monkeypatch.setattr(bench_peers.bench_grid, "run_grid_case", lambda *a: {"pair": {"us": 7.25}})
    assert bench_peers.run_peer_case(peer, 4.0)["ratio"] == round(7.25 / 14.5, 3)
    assert bench_peers.meets_target(bench_peers.run_peer_case(peer, 4.0))
    monkeypatch.setattr(bench_peers.bench_grid, "run_grid_case", lambda *a: {"error": "x"})
    assert bench_peers.run_peer_case(peer, 4.0)["ratio"] is None
    assert bench_peers.meets_target(bench_peers.run_peer_case(peer, 4.0)) is None


def test_a_pair_meets_the_target_by_its_time_not_its_rounded_ratio(monkeypatch):
    """A pair of 0.6703x the peer's time is recorded as 0.67 and misses the 0.67x aim."""
    peer = bench_peers.PEER_CASES[0]  # 14.5 µs
    assert peer.peer_us == 14.5
    pair = {"pair": {"us": 9.72}}  # 0.67034x
    monkeypatch.setattr(bench_peers.bench_grid, "run_grid_case", lambda *a: dict(pair))
    record = bench_peers.run_peer_case(peer, 4.0)
    assert record["ratio"] == 0.67 and bench_peers.meets_target(record) is False
