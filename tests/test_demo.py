"""The demo, its engine and the command line.

* the demo runs, prints its tables, agrees with PEFT, and can fail; ``--json``,
  ``--plot`` and ``--profile`` write what they say;
* the engine's serving loop (the KV cache, the one-pass prefill, the batched decode
  steps, the buckets, stopping) computes what the Hugging Face model computes, and
  never lets one request see another's tokens (the base path: no adapter, so these
  run fast on the simulator; the adapters' agreement with PEFT is checked by the demo
  here and in tests/test_peft.py);
* on a GPU, decode steps replayed from CUDA graphs equal the eager ones;
* the profiler's clocks count each part's own time.

The demo is run in-process at a tiny size (it launches the real kernels, on the
simulator without a GPU); ``python -m punica_numba --help`` runs in a subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from punica_numba import demo, engine, profile
from punica_numba._cuda import SIMULATOR, device_of
from punica_numba.engine import MultiLoRAEngine, Request, tiny_llama
from punica_numba.kv_cache import KVCache
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


def test_demo_agrees_with_peft_and_prints_every_table(capsys, tmp_path):
    code = demo.main([*TINY, "--json", str(tmp_path / "demo.json")])
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
    assert re.search(r"punica_numba engine\s+none\s+[\d.]+\s+[\d.]+\s+[\d.]+", out), (
        "the engine's base path, with its decode ms/step"
    )
    assert "All 4 requests agree with PEFT." in out
    numbers = json.loads((tmp_path / "demo.json").read_text())
    assert numbers["agreement"]["all_agree"] is True
    assert [r["agrees"] for r in numbers["agreement"]["requests"]] == [True] * 4
    paths = [(t["path"], t["adapters"]) for t in numbers["throughput"]]
    assert paths == [
        ("punica_numba engine", "mixed"),
        ("punica_numba engine", "none"),
        ("PEFT generate(adapter_names=...)", "mixed"),
        ("transformers generate", "none"),
    ]
    assert all(t["tokens_per_s"] > 0 and t["tokens"] == 8 for t in numbers["throughput"])
    assert numbers["sweep"] == [], "no sweep without --plot or --sweep"


def test_demo_plots_throughput_against_distinct_adapters(capsys, tmp_path):
    argv = [*TINY, "--adapters", "4", "--plot", str(tmp_path / "sweep.png")]
    code = demo.main([*argv, "--json", str(tmp_path / "demo.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads((tmp_path / "demo.json").read_text())["sweep"]
    assert [p["distinct"] for p in sweep] == [1, 4], "the sweep's points up to --adapters"
    assert all(p["tokens_per_s"] > 0 and p["step_ms"] > 0 for p in sweep)
    assert re.search(r"distinct adapters\s+seconds\s+tokens/s\s+decode ms/step", out)


def test_demo_profile_times_every_part_of_a_decode_step(capsys, tmp_path):
    argv = [*TINY, "--new-tokens", "3", "--profile", "--json", str(tmp_path / "profile.json")]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"part\s+host ms/step\s+host share", out), out
    numbers = json.loads((tmp_path / "profile.json").read_text())
    mixed, base = numbers["profiles"]
    assert mixed["label"] == "engine, mixed adapters" and base["label"] == "engine, no adapters"
    repeats = 1 if SIMULATOR else profile.GPU_REPEATS  # generate calls timed
    for p in (mixed, base):
        assert p["steps"] == (3 - 2) * repeats and p["batch"] == 4
        assert p["step_ms"] > 0 and p["before_ms"] > 0
        assert list(p["before_parts"]) == list(profile.BEFORE_PARTS)
        assert all(ms >= 0 for ms in list(p["before_parts"].values())[:4])
        shares = {row["part"]: row["host_share"] for row in p["parts"]}
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
        for part in ("attention", "base GEMMs", "norms", "LM head", profile.LOOP):
            assert part in shares, (part, shares)
        assert "update_metadata" not in shares, "the decode steps' metadata is prepared once"
    # Before the first decode step, the prefill's LoRA calls: only with adapters do they
    # launch (on the simulator, Python threads that dwarf everything else).
    prefill_lora = [p["before_parts"]["prefill: its LoRA calls"] for p in (mixed, base)]
    assert prefill_lora[0] > prefill_lora[1]
    assert "in a run with its parts timed" in out
    lora = {p["label"]: _part(p, "LoRA (add_lora_linear)")["host_ms"] for p in (mixed, base)}
    # Without adapters the wrapper launches nothing; on the simulator the LoRA kernels
    # (Python threads) dwarf the rest, on a GPU their launches still cost the host more.
    ratio = 10 if SIMULATOR else 1
    assert lora["engine, mixed adapters"] > ratio * lora["engine, no adapters"], lora


def _part(p: dict, name: str) -> dict:
    return next(row for row in p["parts"] if row["part"] == name)


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


def test_engine_paths_are_timed_in_turn_and_each_gets_its_own_median(monkeypatch):
    """Each round runs every batch once, starting one batch later than the round before,
    and each batch's median comes from its own runs only."""
    calls = []
    clock = iter(range(0, 10_000, 10))  # perf_counter: +10 s a reading

    class Engine:
        device = torch.device("cpu")

        def generate(self, batch, new_tokens, on_step):
            calls.append(batch)
            on_step(1)
            if batch == "slow":  # 3 more readings: the slow batch's run takes 30 s longer
                next(clock), next(clock), next(clock)

    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    fast, slow = demo.time_engines_in_turn(Engine(), ("fast", "slow"), 3, repeats=3)
    assert calls == ["fast", "slow", "slow", "fast", "fast", "slow"]
    assert (fast.seconds, slow.seconds) == (20, 50)  # begin, stamp, end: 2 steps of 10 s
    assert (fast.step_ms, slow.step_ms) == (1e3 * 10 / 2, 1e3 * 40 / 2)


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


# -- the engine's serving loop, on the base path (no adapter) ---------------------------------

DEVICE = device_of()

# Awkward on purpose: 3 query heads per KV head, head_dim 4, an odd vocabulary.
SIZES = dict(
    vocab_size=53,
    hidden_size=24,
    intermediate_size=40,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    max_positions=24,
)
MAX_BATCHES = 6  # buckets 1, 2, 4, 6


@pytest.fixture(scope="module")
def model():
    return tiny_llama(**SIZES, seed=3)


def _engine(model, **extra) -> MultiLoRAEngine:
    kwargs = dict(max_num_batched_tokens=40, max_batches=MAX_BATCHES, max_loras=1, max_lora_rank=2)
    return MultiLoRAEngine(model, **(kwargs | extra))


@pytest.fixture(scope="module")
def base_engine(model):
    return _engine(model)


def _requests(lengths, seed: int) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Request(torch.randint(1, SIZES["vocab_size"], (n,), generator=gen).tolist())
        for n in lengths
    ]


@torch.no_grad()
def _model_logits(model, request: Request, tokens: list[int]) -> torch.Tensor:
    """The model's own forward over the prompt and the tokens but the last: the
    ``[len(tokens), V]`` rows that predicted each token (no cache, no batch)."""
    sequence = torch.tensor([[*request.prompt, *tokens[:-1]]], device=DEVICE)
    logits = model(sequence).logits[0]  # [S, V]
    start = len(request.prompt) - 1
    return logits[start : start + len(tokens)].float()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-5):
    err = (got - want).abs()
    scale = want.abs().max().item()
    if err.max().item() > rel * scale:
        step, token = divmod(int(err.argmax()), err.shape[1])
        raise AssertionError(
            f"{what}: max |engine - reference| = {err.max().item():.3g} > {rel:g} x {scale:.3g} "
            f"at step {step}, token {token}: {got[step, token].item()!r} vs "
            f"{want[step, token].item()!r}"
        )


@pytest.mark.parametrize("lengths", [(4,), (5, 1, 3), (2, 6, 1, 4, 3)], ids=["1", "3", "5"])
def test_prefill_and_decode_equal_the_models_forward(model, base_engine, lengths):
    """One prefill of every prompt, then batched decode steps over the KV cache, in a
    bucket with padding rows (3 -> 4, 5 -> 6): each request's logits are the model's
    own forward over its sequence, and its tokens the greedy choices."""
    requests = _requests(lengths, seed=len(lengths))
    generations = base_engine.generate(requests, 5, keep_logits=True)
    for i, (r, g) in enumerate(zip(requests, generations)):
        assert len(g.tokens) == 5 and g.logits.shape == (5, SIZES["vocab_size"])
        want = _model_logits(model, r, g.tokens)
        _assert_close(g.logits, want, f"request {i} of {len(requests)}")
        assert g.tokens == g.logits.argmax(-1).tolist(), "greedy"


def test_buckets_cover_every_batch_size(base_engine):
    assert base_engine.buckets == (1, 2, 4, MAX_BATCHES)
    assert [base_engine._bucket(b) for b in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def test_requests_never_see_each_others_tokens(base_engine):
    """Changing one request's prompt leaves every other request's logits as they were:
    the prefill's mask is block-diagonal and each decode row reads its own cache slot."""
    requests = _requests((3, 4, 2), seed=11)
    changed = list(requests)
    changed[1] = Request([(t + 7) % SIZES["vocab_size"] or 1 for t in requests[1].prompt])
    before = base_engine.generate(requests, 4, keep_logits=True)
    after = base_engine.generate(changed, 4, keep_logits=True)
    assert (before[1].logits - after[1].logits).abs().max() > 1e-2, "the change must matter"
    for i in (0, 2):
        _assert_close(after[i].logits, before[i].logits, f"request {i}", rel=1e-6)


def test_a_reused_cache_holds_nothing_stale(model, base_engine):
    """Short prompts after long ones: what the long ones left in the slots is never read."""
    base_engine.generate(_requests((6, 6, 6, 6), seed=2), 8)
    short = _requests((1, 2, 1), seed=3)
    got = base_engine.generate(short, 3, keep_logits=True)
    fresh = _engine(model).generate(short, 3, keep_logits=True)
    for i, (g, f) in enumerate(zip(got, fresh)):
        assert g.tokens == f.tokens
        _assert_close(g.logits, f.logits, f"request {i}", rel=1e-6)


def test_a_stop_token_ends_its_request_and_no_other(base_engine):
    requests = _requests((3, 1, 5), seed=7)
    full = base_engine.generate(requests, 6, keep_logits=True)
    tokens = full[0].tokens
    k = next(k for k in range(1, 6) if tokens[k] not in tokens[:k])  # a first occurrence
    stop = tokens[k]
    stopped = base_engine.generate(requests, 6, keep_logits=True, stop_token=stop)
    for i, (f, s) in enumerate(zip(full, stopped)):
        want = f.tokens[: f.tokens.index(stop) + 1] if stop in f.tokens else f.tokens
        assert s.tokens == want, i
        assert torch.equal(s.logits, f.logits[: len(want)]), i
    assert stopped[0].tokens[-1] == stop and len(stopped[0].tokens) == k + 1


def test_the_batch_ends_once_every_request_has_stopped(base_engine, monkeypatch):
    monkeypatch.setattr(engine, "STOP_CHECK_EVERY", 1)
    request = _requests((2,), seed=5)
    first = base_engine.generate(request, 3)[0].tokens
    steps = []
    got = base_engine.generate(request, 10, stop_token=first[1], on_step=steps.append)
    assert got[0].tokens == first[:2]
    assert steps == [0, 1], "no decode step after the one that finished the batch"


def test_the_engine_rejects_what_it_cannot_serve(model, base_engine):
    vocab = SIZES["vocab_size"]
    with pytest.raises(ValueError, match=f"token {vocab}, outside the vocabulary"):
        base_engine.generate([Request([1, vocab])], 2)
    with pytest.raises(ValueError, match="stop_token must be None or a token id"):
        base_engine.generate([Request([1])], 2, stop_token=vocab)
    with pytest.raises(ValueError, match=f"need 1 to {MAX_BATCHES} requests, got 7"):
        base_engine.generate([Request([1])] * 7, 2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        base_engine.generate([Request([1])], 0)
    with pytest.raises(ValueError, match="max_seq_len must lie in"):
        _engine(model, max_seq_len=0)
    with pytest.raises(ValueError, match="max_batches must be an int >= 1"):
        _engine(model, max_batches=0)
    with pytest.raises(ValueError, match="more than max_seq_len=8"):
        _engine(model, max_seq_len=8).generate([Request([1, 2, 3])], 6)
    if SIMULATOR:
        with pytest.raises(ValueError, match="use_cuda_graphs=True needs a GPU"):
            _engine(model, use_cuda_graphs=True)


def test_kv_cache_writes_each_token_at_its_slot_and_position():
    cache = KVCache(2, 3, 2, 4, 5, dtype=torch.float32, device=DEVICE)
    k = torch.arange(3 * 2 * 4, dtype=torch.float32, device=DEVICE).view(3, 2, 4)
    slots = torch.tensor([2, 0, 2], device=DEVICE)
    positions = torch.tensor([1, 4, 3], device=DEVICE)
    cache.write(1, slots, positions, k, -k)
    for t in range(3):
        assert torch.equal(cache.k[1, slots[t], :, positions[t]], k[t])
        assert torch.equal(cache.v[1, slots[t], :, positions[t]], -k[t])
    assert not cache.k[0].any(), "another layer is untouched"
    assert int((cache.k[1] != 0).any(-1).sum()) == 3 * 2, "nothing else written"
    assert cache.keys(1, 2).shape == (2, 2, 5, 4) and cache.nbytes == 2 * 4 * 2 * 3 * 2 * 5 * 4
    bias = cache.decode_bias(torch.tensor([0, 3, 4], device=DEVICE))
    assert bias.shape == (3, 1, 1, 5)
    visible = bias[:, 0, 0] == 0
    assert visible.tolist() == [[p <= q for p in range(5)] for q in (0, 3, 4)]
    assert bool((bias[:, 0, 0][~visible] == float("-inf")).all())


@pytest.mark.gpu
def test_decode_graphs_replay_what_the_eager_steps_compute(tmp_path):
    """Graphs captured per (bucket, distinct adapters), replayed for later batches with
    other adapters, sizes and prompts: the same tokens and logits as the eager steps."""
    model = tiny_llama(**SIZES, seed=3)  # its own: PEFT wraps it below
    specs = demo.adapter_specs(3, max_rank=4)
    engines = {
        graphs: _engine(model, use_cuda_graphs=graphs, max_loras=len(specs), max_lora_rank=4)
        for graphs in (True, False)
    }  # built before PEFT wraps the model's projections
    demo.create_peft_adapters(model, specs, tmp_path, seed=0)
    for e in engines.values():
        for s in specs:
            e.load_adapter(s.adapter_id, tmp_path / s.name)
    ids = [s.adapter_id for s in specs]
    batches = [
        [Request(r.prompt, i) for r, i in zip(_requests((3, 1, 4), 1), (ids[0], 0, ids[1]))],
        [Request(r.prompt, i) for r, i in zip(_requests((2, 5, 1), 2), (ids[2], ids[1], 0))],
        [Request(r.prompt, i) for r, i in zip(_requests((1, 2), 3), (0, 0))],  # no adapter
        [Request(r.prompt, ids[0]) for r in _requests((2, 2, 3, 1, 2), 4)],
    ]
    for n, batch in enumerate(batches):
        want = engines[False].generate(batch, 6, keep_logits=True)
        got = engines[True].generate(batch, 6, keep_logits=True)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.tokens == w.tokens, (n, i)
            _assert_close(g.logits, w.logits, f"batch {n}, request {i}")
    assert set(engines[True]._graphs) == {(4, 2), (2, 0), (6, 1)}


def test_probe_counts_each_part_without_the_parts_nested_in_it():
    probe = profile.Probe()
    probe.active = True
    inner = probe.wrap("inner", lambda: time.sleep(0.05))

    def outer_body():
        time.sleep(0.02)
        inner()

    probe.wrap("outer", outer_body)()
    assert 0.02 <= probe.host["outer"] < 0.045, dict(probe.host)
    assert probe.host["inner"] >= 0.05 and probe.calls == {"outer": 1, "inner": 1}
    probe.active = False
    inner()
    assert probe.calls["inner"] == 1, "nothing is counted while the probe is off"


def test_exclusive_times_subtract_the_ranges_nested_in_a_range():
    """The attribution ``--profile`` makes of the device's time, on the host's clock."""
    from torch.profiler import ProfilerActivity

    probe = profile.Probe(ranges=True)
    inner = probe.wrap("inner", lambda: time.sleep(0.05))

    def outer_body():
        time.sleep(0.02)
        inner()

    with profile.one_cycle_profiler([ProfilerActivity.CPU]) as prof:
        probe.active = True
        probe.wrap("outer", outer_body)()
        probe.active = False
    times = profile.exclusive_times(prof.events(), attr="cpu_time_total")
    assert 20e3 <= times["outer"][0] < 45e3, times  # µs
    assert times["inner"][0] >= 50e3, times
