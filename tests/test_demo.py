"""The demo and the command line: the demo runs, prints its tables, agrees, and can fail.

The demo is run in-process at tiny sizes (it launches the real kernels, on the
simulator without a GPU); ``python -m punica_numba --help`` runs in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from punica_numba import demo, ops

REPO_ROOT = Path(__file__).resolve().parents[1]

# Awkward on purpose: an odd hidden size and a rank that is not a tile multiple.
TINY = ["--requests", "5", "--seed", "1", "--hidden", "13", "--rank", "3", "--loras", "3"]


def _result_rows(out: str) -> dict[int, str]:
    """Request index -> its row of the per-request result table."""
    table = out.split("LoRA output per request", 1)[1]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\s+(\d+)\s+\d+\s+-?\d+\s+\S+\s+\S+\s+\S+\s+(agrees|DIFFERS)\s*$", line)
        if match:
            rows[int(match.group(1))] = match.group(2)
    return rows


def test_demo_agrees_and_prints_every_table(capsys):
    code = demo.main(TINY)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Requests" in out
    assert "Token -> LoRA segments" in out
    assert re.search(r"slot\s+start\s+count\s+token indices", out), out
    assert re.search(r"-1 \(no LoRA\)\s+0\s+\d+", out), "the no-LoRA segment comes first"
    rows = _result_rows(out)
    assert rows == {i: "agrees" for i in range(5)}, out
    assert "All 5 requests agree with the reference" in out


def test_demo_reports_a_wrong_kernel(capsys, monkeypatch):
    """Test the test: a shrink that drops ``scale`` must make the demo fail."""
    real_shrink = ops.lora_shrink

    def shrink_with_wrong_scale(*args):
        real_shrink(*args[:-1], 0.5 * args[-1])

    monkeypatch.setattr(ops, "lora_shrink", shrink_with_wrong_scale)
    code = demo.main(TINY)
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DIFFERS" in out and "MISMATCH" in out
    assert "agrees" in _result_rows(out).values(), "requests without a LoRA still agree"


def test_format_table_aligns_columns():
    lines = demo.format_table(["name", "n"], [("a", 1), ("bcd", 22)])
    assert lines == ["name   n", "----  --", "a      1", "bcd   22"]


def test_token_runs_compresses_consecutive_indices():
    assert demo.token_runs([0, 1, 2, 6, 9, 10]) == "0..2, 6, 9..10"
    assert demo.token_runs(range(3, 4)) == "3"
    assert demo.token_runs([]) == ""
    assert demo.token_runs([0, 2, 4, 6], shown=2) == "0, 2, ... (2 more)"


def test_cli_help_lists_demo():
    result = subprocess.run(
        [sys.executable, "-m", "punica_numba", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"^\s+demo\s", result.stdout, re.MULTILINE), result.stdout


@pytest.mark.parametrize("argv, code", [([], 2), (["nonsense"], 2)])
def test_cli_usage_errors(argv, code, capsys):
    from punica_numba.__main__ import main

    assert main(argv) == code
    assert "usage: python -m punica_numba" in capsys.readouterr().err
