"""``tests/grid_at_tree.py``: this tree's grid run with an older tree's kernels (v29's, which
predates the grid), on the simulator's tiny grid."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
V29 = "dab1d2e"  # the version the grid's target names


def _tool():
    spec = importlib.util.spec_from_file_location(
        "grid_at_tree", ROOT / "tests" / "grid_at_tree.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def v29_tree(tmp_path_factory):
    """v29's package, extracted from git (skipped where the history is not there)."""
    tree = tmp_path_factory.mktemp("v29")
    archive = tree / "v29.tar"
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), V29, "punica_numba"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"git cannot give {V29}'s tree here: {done.stderr.strip()}")
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def test_the_grid_runs_with_v29s_kernels(v29_tree, tmp_path, monkeypatch, capsys):
    from punica_numba import bench, bench_grid

    for name in ("prepare_shrink", "prepare_expand", "LoRAKernelMeta", "config_name"):
        monkeypatch.setattr(bench, name, getattr(bench, name))  # put back after the test
    for name in ("PunicaWrapperNumba", "LoRAMapping", "_write_json"):
        monkeypatch.setattr(bench_grid, name, getattr(bench_grid, name))
    monkeypatch.delitem(sys.modules, "punica_numba_tree", raising=False)
    tool = _tool()
    out = tmp_path / "grid_v29.json"
    args = [str(v29_tree), "--commit", V29, "--harness", "here", "--quick", "--json", str(out)]
    assert tool.main(args) == 0
    result = json.loads(out.read_text())
    assert result["commit"] == V29
    assert result["kernels_from"] == {"tree": str(v29_tree), "commit": V29, "harness": "here"}
    records = result["grid"]["cases"]
    assert len(records) == 3 and not any("error" in r for r in records)
    for r in records:
        assert all(r[run]["relative_error"] <= 1e-2 for run in ("shrink", "expand", "pair"))
    # every op and every layer went through v29's package, not this one
    assert bench_grid.PunicaWrapperNumba.__mro__[1].__module__ == "punica_numba_tree.wrapper"
    assert tool.CALLS["prepare_shrink"] >= 3 and tool.CALLS["prepare_expand"] >= 3
    assert tool.CALLS["add_lora_linear"] >= 3
    assert "the pair faster than torch's gather + bmm" in capsys.readouterr().out


def test_a_folder_without_the_package_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="punica_numba/__init__.py"):
        _tool().load_tree(tmp_path)
    with pytest.raises(SystemExit):
        _tool().main([str(tmp_path), "--commit", "x", "--merge", "a.json"])
