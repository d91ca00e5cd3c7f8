"""Determinism: the same inputs give the same bits, run after run and at every launch
configuration with the same arithmetic order.

``punica_numba.launch`` promises that configurations with equal
``LaunchConfig.arithmetic(op)`` keys add the same products in the same order (every
FFMA expand, row or tiled; every tensor-core expand; the FFMA shrinks of equal
``threads``; the tensor-core shrinks of equal ``threads``), whatever their token tile,
rank group or kernel. So each op is run, on fresh copies of the same inputs, under
every configuration the heuristic can pick (``force_launch_config``), twice under the
first; every run must be right (the property tests' check passes under each
configuration) and every run in a group of equal keys must give bit-identical outputs.
A run counts under the configuration that ran: where the call cannot use the forced
one (a rank past its ``to_rank``, a kernel the call does not allow), the heuristic's
pick runs instead.
The row expands run once more with the rank read at run time rather than compiled in
(``kernels.expand.COMPILED_WORDS``): the same products in the same order, so the same
bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from unittest import mock

import pytest
import torch
from hypothesis import given, settings

from punica_numba import launch
from punica_numba.kernels import build_mma_expand_kernel
from punica_numba.launch import LaunchConfig, force_launch_config, launch_configs
from punica_numba.ops import choice, launching, prepare_expand, prepare_shrink

from .op_cases import (
    Problem,
    ShrinkCase,
    check_expand,
    check_shrink,
    expand_cases,
    record_mma_expand_builds,
    serving_expand_case,
    shrink_cases,
)
from .strategies import assign_slots, in_shards

OPS = {"shrink": (prepare_shrink, check_shrink), "expand": (prepare_expand, check_expand)}

#: Each example runs an op once per configuration plus once more: at the gpu profile's
#: sizes, fewer examples than the property tests keep the run to a few minutes, in parts
#: that xdist's workers share (``strategies.in_shards``).
FEWER = in_shards(min(settings.default.max_examples, 75))


def _run_under(op: str, config, case, rank_at_run_time: bool = False) -> tuple:
    """Run ``op`` on the case under ``config`` (and, if asked, with no rank compiled into
    the row expand); the check must pass; return the configuration that ran and the
    output. A forced configuration the call cannot use (a kernel it does not allow, a
    rank past the configuration's ``to_rank``) gives way to the heuristic's pick, so the
    configuration that ran is the one its launch names, not always ``config``."""
    prepare, check = OPS[op]
    ran = []
    no_rank_compiled_in = mock.patch.object(choice, "COMPILED_WORDS", -1)

    def forced(*args, **kwargs):
        with force_launch_config(op, config):
            with no_rank_compiled_in if rank_at_run_time else contextlib.nullcontext():
                launch = prepare(*args, **kwargs)
                launch()
        # (a call with nothing to launch changes nothing: any configuration will do)
        ran.append((getattr(launch, "config", config), args[2].clone()))  # output_tensor

    check(forced, case)  # builds the same inputs from the case's seeds on every call
    (run,) = ran
    return run


def check_deterministic(op: str, case) -> None:
    """Bit-identical outputs across repeated runs and across the configurations of equal
    arithmetic keys that ran; each configuration alone is right."""
    configs = launch_configs(op)
    runs = [_run_under(op, configs[0], case)]  # the repeat
    runs += [_run_under(op, config, case) for config in configs]
    if op == "expand":
        rows = [config for config in configs if config.kernel == "rows"]
        runs += [_run_under(op, config, case, True) for config in rows]
    by_order = defaultdict(list)
    for config, output in runs:
        by_order[config.arithmetic(op)].append((config, output))
    for group in by_order.values():
        (first, want), *others = group
        for config, got in others:
            differ = got != want
            assert not bool(differ.any()), (
                f"{op}: {config} and {first} give different bits at "
                f"{tuple(torch.nonzero(differ)[0].tolist())} of {int(differ.sum())} element(s)"
            )


@FEWER
@given(shrink_cases())
def test_shrink_bits_do_not_depend_on_the_launch(shard, case):
    check_deterministic("shrink", case)


@FEWER
@given(expand_cases())
def test_expand_bits_do_not_depend_on_the_launch(shard, case):
    check_deterministic("expand", case)


def test_some_configurations_share_their_arithmetic():
    """Otherwise the cross-configuration comparison would compare nothing."""
    for op in OPS:
        keys = [c.arithmetic(op) for c in launch_configs(op)]
        assert len(keys) > len(set(keys)) or len(keys) == 1, op


def _large_problem() -> Problem:
    T, L = 512, 16
    return Problem(assign_slots("zipf", T, L, seed=7), T, L, seed=11)


@pytest.mark.gpu
def test_shrink_deterministic_at_a_real_size():
    """T=512, H=4096, r=16, 16 LoRAs, bf16: the same bits at every configuration."""
    case = ShrinkCase(_large_problem(), 4096, 16, 3, 0, torch.bfloat16, torch.float32, 0.5, False)
    check_deterministic("shrink", case)


@pytest.mark.gpu
def test_expand_deterministic_at_a_real_size():
    case = serving_expand_case(_large_problem(), 16, [4096, 1024, 1024])
    check_deterministic("expand", case)


def _add_configs(monkeypatch, op: str, *extra) -> None:
    """For the test only: this machine's table of ``op`` holds ``extra`` too, so that
    ``force_launch_config`` takes them and ``check_deterministic`` runs them."""
    table = launch._SIMULATOR_CONFIGS if launch.SIMULATOR else launch._GPU_CONFIGS
    monkeypatch.setitem(table, op, (*launch_configs(op), *extra))


def test_a_forced_configuration_the_call_cannot_use_counts_as_what_ran(monkeypatch):
    """Forced past its ``to_rank``, a tensor-core shrink gives way to the heuristic's FFMA
    pick; that run must be compared with the FFMA runs, not with the tensor cores'
    (whose sums run in another order). A capped twin of the table's first tensor-core
    shrink (same threads: the same arithmetic key) makes such a run at r=5."""
    first = next(c for c in launch_configs("shrink") if c.kernel == "mma")
    capped = dataclasses.replace(first, tile_n=24, spread=True, to_rank=4)
    _add_configs(monkeypatch, "shrink", capped)
    problem = Problem(list(range(8)), 8, 8, seed=5)  # a token per slot: FFMA picked
    case = ShrinkCase(problem, 40, 5, 1, 0, torch.bfloat16, torch.float32, 0.5, False)
    ran, _ = _run_under("shrink", capped, case)
    assert ran != capped and ran.kernel != "mma", ran
    check_deterministic("shrink", case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_expand_bits_do_not_depend_on_its_passes(dtype, monkeypatch):
    """A block that walks several column groups (``passes``) adds the same products as one
    block per group: twins of the table's first tensor-core expand with 1 and 3 passes
    (the same arithmetic key) give the same bits, and so does every other tensor-core
    expand of this machine's table; each is right. Slices of 72, 24 and 8 columns: several
    groups for the widest, one for the narrowest. B and the output bf16 or fp16: every
    configuration takes both."""
    # (the staged expand takes ranks of whole chunks of 32 only: test_staged_expand.py)
    table = [c for c in launch_configs("expand") if c.kernel == "mma" and not c.staged]
    first = table[0]
    twins = [dataclasses.replace(first, passes=p, from_tokens_per_slot=1e9) for p in (1, 3)]
    _add_configs(monkeypatch, "expand", *twins)
    problem = Problem([0] * 12 + [1] * 8, 20, 2, seed=3)  # tiles of several tokens
    case = serving_expand_case(problem, 16, [72, 24, 8], dtype=dtype)
    configs = [*table, *twins]
    runs = [_run_under("expand", config, case) for config in configs]
    assert [config for config, _ in runs] == configs  # the tensor cores ran each
    (_, want), *others = runs
    for config, got in others:
        assert torch.equal(got, want), f"{config} and {first} give different bits"


def test_asking_ahead_does_not_change_the_bits(monkeypatch):
    """A tensor-core expand of one slice whose grid has a block for every column group
    asks ahead (``expand_mma``, "Asking ahead": the next launch placed at once, L2 asked
    for the tile before the wait); the same call built without asking gives the same
    bits, and each is right. (On the simulator there is nothing to ask: both builds run
    the same code, and the test checks which build each call asked for.)"""
    config = LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens_per_slot=1e9)
    _add_configs(monkeypatch, "expand", config)
    built = record_mma_expand_builds(monkeypatch)
    case = serving_expand_case(Problem([0] * 12 + [1] * 8, 20, 2, seed=3), 64, [128])
    _, asked = _run_under("expand", config, case)
    record_mma_expand_builds(
        monkeypatch, change=lambda args: (*args[:12], False, False, *args[14:])
    )
    _, plain = _run_under("expand", config, case)
    assert [a[12] for a, _ in built] == [True, False]  # (ask_ahead)
    assert torch.equal(asked, plain), "asking ahead changed the bits"


@pytest.mark.skipif(not launch.SIMULATOR, reason="the GPU runs this code in every asking call")
def test_the_code_before_the_wait_on_the_simulator(monkeypatch):
    """What an asking build does before its wait (``expand_mma``, "B before the wait": its
    words of B loaded into registers, a block with no tile leaving; built so only behind
    the wrapper's own shrink) runs on the GPU only, where there is a dependent launch. Told
    there is one, and built with B before the wait, the simulator runs it too (its wait,
    the next launch and the asks do nothing there), and on a grid of the tile table's
    bound, with rows past the tiles as on the GPU, the call is right and gives the plain
    build's bits."""
    from punica_numba.kernels import expand_mma

    config = LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens_per_slot=1e9)
    _add_configs(monkeypatch, "expand", config)
    exact_tiles = launching.tiles
    rows = []

    def bound_grid(*args):  # the GPU's grid: every row of the table, empty ones too
        table, tokens, blocks = exact_tiles(*args)
        rows.append((table.shape[0], blocks))
        return table, tokens, table.shape[0]

    monkeypatch.setattr(launching, "tiles", bound_grid)
    built = record_mma_expand_builds(
        monkeypatch, change=lambda args: (*args[:13], args[12], *args[14:])
    )
    case = serving_expand_case(Problem([0] * 12 + [1] * 8, 20, 2, seed=3), 64, [128])
    build_mma_expand_kernel.cache_clear()  # (builds made without a dependent launch)
    try:
        with mock.patch.object(expand_mma, "dependent_launch", lambda: True):
            _, asked = _run_under("expand", config, case)
    finally:
        build_mma_expand_kernel.cache_clear()  # (so no later test takes these builds)
    record_mma_expand_builds(
        monkeypatch, change=lambda args: (*args[:12], False, False, *args[14:])
    )
    _, plain = _run_under("expand", config, case)
    assert [a[12:14] for a, _ in built] == [(True, True), (False, False)]  # (ask_ahead, B early)
    assert all(table_rows > tiles for table_rows, tiles in rows), rows  # empty rows ran
    assert torch.equal(asked, plain), "the code before the wait changed the bits"


def test_only_the_wrappers_expand_loads_b_before_the_wait(monkeypatch):
    """B is loaded before the wait only where nothing still running can be writing it
    (``expand_mma``, "B before the wait"): the bare op knows nothing of the kernel ahead
    of it (a caller's own, saying ``launch_dependents`` early, may be writing the weights)
    and never does; the wrapper's ``add_lora_linear`` does, its expand just behind its own
    shrink; its ``add_expand`` alone does not, and gives ``add_lora_linear``'s bits. (One column
    group of the 64 the blocks take: the simulator's time is in its blocks.)"""
    from punica_numba import LoRAMapping, PunicaWrapperNumba

    config = LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens_per_slot=1e9)
    _add_configs(monkeypatch, "expand", config)
    built = record_mma_expand_builds(monkeypatch)
    slots = [0] * 12 + [1] * 8
    case = serving_expand_case(Problem(slots, 20, 2, seed=3), 64, [64])
    _, bare = _run_under("expand", config, case)
    gen = torch.Generator().manual_seed(9)
    device = bare.device
    x = torch.randn(20, 64, generator=gen).to(device, torch.bfloat16)
    a = torch.randn(2, 64, 64, generator=gen).to(device, torch.bfloat16) / 8
    b = torch.randn(2, 64, 64, generator=gen).to(device, torch.bfloat16) / 8
    wrapper = PunicaWrapperNumba(32, 4, device, max_loras=2)
    mapping = LoRAMapping([s + 1 for s in slots], [1, 2])
    wrapper.update_metadata(mapping, [1, 2], 3, 128, 256)
    outputs = []
    with force_launch_config("expand", config):
        y = torch.zeros(20, 64, dtype=torch.bfloat16, device=device)
        wrapper.add_lora_linear(y, x, (a,), (b,), 1.0, (64,))
        outputs.append(y)
        buffer = torch.zeros(1, 20, 64, device=device)
        wrapper.add_shrink(buffer, x, (a,), 1.0)
        y = torch.zeros(20, 64, dtype=torch.bfloat16, device=device)
        wrapper.add_expand(y, buffer, (b,), (64,), 0, True)
        outputs.append(y)
    # (ask_ahead, B before the wait) of each build: the op, add_lora_linear, add_expand
    assert [args[12:14] for args, _ in built] == [(True, False), (True, True), (True, False)]
    assert torch.equal(outputs[0], outputs[1])


def test_only_one_slice_found_in_the_tile_table_asks_ahead(monkeypatch):
    """Asking ahead was measured to pay only for launches of one slice in one pass whose
    blocks read the tile table, of up to ``ops.choice.ASK_AHEAD_TOKENS`` tokens: three slices
    (the QKV layer), one slot and more tokens do not ask."""
    config = LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens_per_slot=1e9)
    _add_configs(monkeypatch, "expand", config)
    monkeypatch.setattr(choice, "ASK_AHEAD_TOKENS", 20)  # (so that 21 tokens are more)
    built = record_mma_expand_builds(monkeypatch)
    two_loras = Problem([0] * 12 + [1] * 8, 20, 2, seed=3)
    one_lora = Problem([0] * 20, 20, 1, seed=4)
    more = Problem([0] * 12 + [1] * 9, 21, 2, seed=5)
    cases = ((two_loras, [128]), (two_loras, [64, 32, 32]), (one_lora, [128]), (more, [128]))
    for problem, widths in cases:
        _run_under("expand", config, serving_expand_case(problem, 64, widths))
    # (one_pass, one_slot, ask_ahead) of each build
    assert [a[10:13] for a, _ in built] == [
        (True, False, True),
        (True, False, False),
        (True, True, False),
        (True, False, False),
    ]
    with pytest.raises(ValueError, match="one_slot"):
        build_mma_expand_kernel(torch.float32, 32, 1, 8, 4, True, one_slot=True, ask_ahead=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tensor_core_expand_bits_do_not_depend_on_reading_the_buffer_first(dtype, monkeypatch):
    """At r=64 a warp of 64 columns holds 32 words of B a lane; built for one pass (a block
    per column group) it reads the buffer's rows before B, and walking two groups after
    it (``expand_mma``, "The buffer before B"). The two give the same bits on a slice of
    128 columns, each is right, and the first was built to read the buffer first; with
    bf16 or fp16 B and output."""
    from punica_numba.kernels.expand_mma import EARLY_B_WORDS

    one_pass, two_passes = (
        LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, passes=p, from_tokens_per_slot=1e9)
        for p in (1, 2)
    )
    _add_configs(monkeypatch, "expand", one_pass, two_passes)
    built = record_mma_expand_builds(monkeypatch)
    problem = Problem([0] * 12 + [1] * 8, 20, 2, seed=3)  # tiles of several tokens
    case = serving_expand_case(problem, 64, [128], dtype=dtype)
    runs = [_run_under("expand", config, case) for config in (one_pass, two_passes)]
    assert [config for config, _ in runs] == [one_pass, two_passes]
    assert torch.equal(runs[0][1], runs[1][1]), "reading the buffer first changed the bits"
    # (n_tiles, k_steps, wide_x, one_pass) of each build: the first reads the buffer first
    shapes = [(a[3], a[4], a[8], a[10], a[14]) for a, _ in built]
    assert shapes == [(8, 4, True, True, dtype), (8, 4, True, False, dtype)], shapes
    assert 8 * 4 > EARLY_B_WORDS
