"""The demo and the command line: the demo runs, prints its tables, agrees with PEFT, and can fail.

The demo is run in-process at a tiny size (it launches the real kernels, on the
simulator without a GPU); ``python -m punica_numba --help`` runs in a subprocess.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from punica_numba import demo
from punica_numba.wrapper import PunicaWrapperNumba

REPO_ROOT = Path(__file__).resolve().parents[1]

# Tiny, and awkward on purpose: an odd vocabulary, head_dim 4, k/v narrower than q.
TINY = [
    *("--requests", "4", "--adapters", "3", "--max-rank", "4", "--layers", "1"),
    *("--hidden", "16", "--intermediate", "24", "--heads", "4", "--kv-heads", "2"),
    *("--vocab", "61", "--max-prompt", "3", "--new-tokens", "2", "--seed", "1", "--no-progress"),
]


def _result_rows(out: str) -> dict[int, tuple[str, str]]:
    """Request index -> (PEFT name, result) from the per-request table."""
    table = out.split("Per request:", 1)[1].split("Greedy tokens", 1)[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\s+(\d+)\s+\d+\s+(\S+)\s.*\s(agrees|DIFFERS)$", line)
        if match:
            rows[int(match.group(1))] = (match.group(2), match.group(3))
    return rows


def test_demo_agrees_with_peft_and_prints_every_table(capsys):
    code = demo.main(TINY)
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"slot\s+adapter id\s+PEFT name\s+rank\s+alpha\s+scaling\s+targets", out)
    assert "alpha/sqrt(r)" in out, "one adapter uses rsLoRA"
    assert "Requests (4;" in out
    assert re.search(r"slot\s+start\s+count\s+token indices", out), out
    assert re.search(r"-1 \(no LoRA\)\s+0\s+\d+", out), "the no-LoRA segment comes first"
    rows = _result_rows(out)
    assert sorted(rows) == [0, 1, 2, 3], out
    assert {result for _, result in rows.values()} == {"agrees"}, out
    assert {name for name, _ in rows.values()} == {"__base__", "adapter0", "adapter1", "adapter2"}
    for path in (
        "punica_numba engine",
        "PEFT generate(adapter_names=...)",
        "transformers generate",
    ):
        assert re.search(rf"{re.escape(path)}\s+\S+\s+[\d.]+\s+[\d.]+", out), path
    assert "All 4 requests agree with PEFT." in out


def test_demo_reports_a_wrong_lora(capsys, monkeypatch):
    """Test the test: a LoRA layer that halves its input must make the demo fail."""
    real = PunicaWrapperNumba.add_lora_linear

    def half_input(self, y, x, *args, **kwargs):
        return real(self, y, 0.5 * x, *args, **kwargs)

    monkeypatch.setattr(PunicaWrapperNumba, "add_lora_linear", half_input)
    code = demo.main(TINY)
    out = capsys.readouterr().out
    assert code == 1, out
    assert "MISMATCH" in out
    rows = _result_rows(out)
    for name, result in rows.values():
        assert result == ("agrees" if name == "__base__" else "DIFFERS"), out


def test_agreement_bound():
    exact = torch.tensor([[1.0, -2.0]])
    same = exact + torch.tensor([[0.0, 0.01]])  # PEFT in a low precision: off by 0.01
    close = demo.agreement(exact + 0.015, same, exact)
    assert close.scale == 2.0 and close.peft_err == pytest.approx(0.01)
    assert close.bound == pytest.approx(demo.NOISE_FACTOR * 0.01 + demo.REL_FLOOR * 2.0)
    assert close.agrees
    assert not demo.agreement(exact + 0.5, same, exact).agrees
    fp32 = demo.agreement(exact + 1e-5, exact, exact)  # float32: PEFT is the reference
    assert fp32.peft_err == 0 and fp32.agrees
    assert not demo.agreement(exact + 1e-3, exact, exact).agrees


def test_adapter_specs_mix_ranks_targets_and_rslora():
    specs = demo.adapter_specs(4, max_rank=8)
    assert [s.rank for s in specs] == [8, 4, 2, 8]
    assert [s.use_rslora for s in specs] == [False, True, False, False]
    assert [s.adapter_id for s in specs] == [101, 102, 103, 104]
    assert specs[1].scaling == specs[1].lora_alpha / 2  # alpha / sqrt(4)
    assert specs[2].scaling == specs[2].lora_alpha / 2  # alpha / 2
    assert len({s.target_modules for s in specs[:3]}) == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "0"], "--requests must be >= 1"),
        (["--hidden", "30", "--heads", "4"], "multiple of --heads"),
        (["--vocab", "1"], "--vocab must be >= 2"),
    ],
)
def test_demo_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_says_what_to_install_without_peft(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # makes `import peft` fail
    assert demo.main(TINY) == 2
    assert "pip install 'punica-numba[peft]'" in capsys.readouterr().err


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
