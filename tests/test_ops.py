"""Property tests of ``lora_shrink`` and ``lora_expand`` against the float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from punica_numba import lora_expand, lora_shrink, ops
from punica_numba.launch import config_name, force_launch_config, launch_configs
from punica_numba.meta import host_facts_of
from punica_numba.ops import choice, launching

from .op_cases import (
    check_expand,
    check_shrink,
    expand_cases,
    record_mma_expand_builds,
    rows_at_8_bytes,
    shrink_cases,
)


@given(shrink_cases())
def test_shrink_matches_reference(case):
    check_shrink(lora_shrink, case)


@given(expand_cases())
def test_expand_matches_reference(case):
    check_expand(lora_expand, case)


def _tensor_core_configs():
    return [c for c in launch_configs("expand") if c.kernel == "mma"]


@given(expand_cases(tensor_cores=True), st.data())
def test_tensor_core_expand_matches_reference(case, data):
    """A tensor-core expand configuration (drawn, then forced) on a call it takes (a
    free draw rarely makes one: bf16, an even rank, slices of whole 4-column words). One
    configuration per example: on the GPU each check computes a float64 reference of up
    to 4096 x 6144 outputs, and the draws of ranks compile several kernels each."""
    config = data.draw(st.sampled_from(_tensor_core_configs()), label="configuration")
    with force_launch_config("expand", config):
        check_expand(lora_expand, case)


@given(shrink_cases())
def test_shrink_is_deterministic(case):
    """No atomics: the same inputs give the same bits, run after run."""
    runs = []

    def record(*args):
        lora_shrink(*args)
        runs.append(args[2].clone())

    check_shrink(record, case)
    check_shrink(record, case)
    assert torch.equal(runs[0], runs[1])


@given(expand_cases())
def test_expand_is_deterministic(case):
    runs = []

    def record(*args, **kwargs):
        lora_expand(*args, **kwargs)
        runs.append(args[2].clone())

    check_expand(record, case)
    check_expand(record, case)
    assert torch.equal(runs[0], runs[1])


def test_public_names():
    import punica_numba

    for name in ("lora_shrink", "lora_expand", "LoRAKernelMeta", "LoRAMapping", "convert_mapping"):
        assert hasattr(punica_numba, name), name


@pytest.mark.gpu
def test_offsets_past_two_to_the_31_elements():
    """slot * stride of B exceeds 2**31 elements: the address arithmetic must be 64-bit."""
    from punica_numba.meta import LoRAKernelMeta

    rank, width, slots = 16, 1 << 26, 3  # B: [3, 2**26, 16] bf16, 6 GiB; slot 2 starts at 2**31
    b = torch.zeros(slots, width, rank, dtype=torch.bfloat16, device="cuda")
    b[2, -4:, :] = 1.0  # only the far end of the last slot is non-zero
    b[2, :4, :] = 2.0
    x = torch.ones(1, 2, rank, dtype=torch.float32, device="cuda")
    y = torch.zeros(2, width, dtype=torch.bfloat16, device="cuda")
    meta = LoRAKernelMeta.make(slots, 2, "cuda")
    meta.prepare_tensors(torch.tensor([2, -1], device="cuda"))
    lora_expand(x, [b], y, *meta.meta_args(2), add_inputs=False)
    assert torch.all(y[0, -4:] == rank) and torch.all(y[0, :4] == 2 * rank)
    assert int(torch.count_nonzero(y[0])) == 8 and int(torch.count_nonzero(y[1])) == 0

    a = b.view(slots, rank, width)  # as shrink weights: [3, 16, 2**26], K = 2**26
    xs = torch.ones(2, width, dtype=torch.bfloat16, device="cuda")
    buf = torch.zeros(1, 2, rank, dtype=torch.float32, device="cuda")
    lora_shrink(xs, [a], buf, *meta.meta_args(2), 1.0)
    want = a[2].float().sum(dim=1)  # [16]
    assert torch.equal(buf[0, 0], want) and int(torch.count_nonzero(buf[0, 1])) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden, rank", [(8, 4), (7, 3), (12, 2)])
def test_packed_and_element_paths(dtype, hidden, rank):
    """Rows of whole 8-byte words are read packed, others element by element: both right."""
    from .op_cases import ExpandCase, Problem, ShrinkCase

    problem = Problem(slots=[0, 2, -1, 1, 2, 2, 0], prepared=7, num_loras=3, seed=5)
    check_shrink(
        lora_shrink, ShrinkCase(problem, hidden, rank, 2, 0, dtype, torch.float32, 0.5, True)
    )
    check_expand(
        lora_expand,
        ExpandCase(problem, rank, [5, 3], 1, 1, torch.float32, dtype, dtype, True, False, False),
    )


@pytest.mark.parametrize(
    "config", [c for c in launch_configs("shrink") if c.kernel != "mma"], ids=config_name
)
def test_shrink_covers_every_rank_group(config):
    """Every FFMA shrink configuration is right at r=9: two groups of 4 ranks and a short
    third (or five of 2, two of 8), whether each block does one group (a block for every
    group: the "One pass" build) or walks them all."""
    from .op_cases import Problem, ShrinkCase

    problem = Problem(slots=[1, 0, -1, 1, 1, 0, 1], prepared=7, num_loras=2, seed=13)
    case = ShrinkCase(problem, 24, 9, 2, 0, torch.bfloat16, torch.float32, 0.5, False)
    with force_launch_config("shrink", config):
        check_shrink(lora_shrink, case)


@pytest.mark.parametrize("op", ["shrink", "expand"])
def test_tile_tokens_are_made_only_for_the_tensor_core_expand(op, monkeypatch):
    """On metadata made elsewhere a launch makes what its kernel reads: each tile's
    tokens (``segments.tile_tokens``) only for the tensor-core expand; every other
    configuration of more than one token a tile reads the sorted tokens instead. The
    tables are made as a launch is prepared, so nothing is launched here (the results on
    such metadata: ``test_tensor_core_expand_on_metadata_made_elsewhere``)."""
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    made = []
    make = launching.tile_tokens
    monkeypatch.setattr(
        launching, "tile_tokens", lambda *a, **k: made.append(a[2]) or make(*a, **k)
    )
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, -1, 1, 1, 1, 1])
    T, L, r, widths = len(slots), 2, 16, [32, 32]
    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    args = [t.clone() for t in meta.meta_args(T)]  # no host facts: tables made at launch
    assert host_facts_of(args[4]) is None
    if op == "shrink":
        x = torch.randn(T, 64, generator=gen).to(DEVICE, torch.bfloat16)
        weights = [torch.randn(L, r, 64, generator=gen).to(DEVICE, torch.bfloat16)] * 2
        out = torch.zeros(2, T, r, device=DEVICE)
        prepare = functools.partial(ops.prepare_shrink, x, weights, out, *args, 1.0)
    else:
        x = torch.randn(2, T, r, generator=gen).to(DEVICE)
        weights = [torch.randn(L, n, r, generator=gen).to(DEVICE, torch.bfloat16) for n in widths]
        out = torch.zeros(T, sum(widths), device=DEVICE, dtype=torch.bfloat16)
        prepare = functools.partial(ops.prepare_expand, x, weights, out, *args, add_inputs=True)
    tried = set()
    for config in launch_configs(op):
        made.clear()
        with force_launch_config(op, config):
            chosen = prepare().config  # (the tables are made as the launch is prepared)
        tried.add(chosen.kernel)
        tensor_core_expand = op == "expand" and chosen.kernel == "mma"
        assert made == ([chosen.tile_m] if tensor_core_expand else []), (chosen, made)
    assert "mma" in tried and len(tried) > 1, tried


@pytest.mark.parametrize("aligned", [True, False], ids=["rows-at-16-bytes", "rows-at-8-bytes"])
@pytest.mark.parametrize(
    "config", [c for c in launch_configs("shrink") if c.kernel == "mma"], ids=config_name
)
def test_tensor_core_shrink_loads_16_or_8_bytes(config, aligned, monkeypatch):
    """Every tensor-core shrink reads x and A 16 bytes at a time where every row starts at
    a multiple of 16 bytes, and 8 at a time (the same words) where rows start at 8: both
    right, at r=20 (three groups of 8 ranks where a block takes 8, the last one short)."""
    from .op_cases import Problem, ShrinkCase

    built = []
    build = choice.build_mma_shrink_kernel
    monkeypatch.setattr(
        choice, "build_mma_shrink_kernel", lambda *a: built.append(a[-1]) or build(*a)
    )

    def shrink(x, weights, out, *rest):
        if not aligned:
            x, weights = rows_at_8_bytes(x), [rows_at_8_bytes(w) for w in weights]
        lora_shrink(x, weights, out, *rest)

    slots = [0, 2, -1, 1, 2, 2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 2, 1, 2]
    problem = Problem(slots=slots, prepared=len(slots), num_loras=3, seed=11)
    rank = min(20, config.to_rank or 20)  # (past its to_rank a forced one is not used)
    case = ShrinkCase(problem, 48, rank, 2, 0, torch.bfloat16, torch.float32, 0.5, True)
    with force_launch_config("shrink", config):
        check_shrink(shrink, case)
    assert built and set(built) == {aligned}, built


@pytest.mark.parametrize(
    "config", [c for c in launch_configs("expand") if c.kernel == "mma"], ids=config_name
)
def test_tensor_core_expand_writes_16_or_8_byte_words(config, monkeypatch):
    """The tensor-core expand reads and writes its output 16 bytes at a time where the
    output's rows start at multiples of 16 bytes and the slices at multiples of 8 columns
    (and a warp has a multiple of 4 tiles), 8 at a time otherwise (here: the same slices
    4 columns further right in a 4-column wider output). Both right, and the same bits:
    only the rows of B fed to each tensor-core column differ."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    builds = record_mma_expand_builds(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    slots = torch.tensor([0, 2, -1, 1, 2, 2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 2, 1, 2] * 2)
    T, L, r, widths = len(slots), 3, 24, [72, 16, 8]
    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    x = torch.randn(len(widths), T, r, generator=gen).to(DEVICE)
    weights = [torch.randn(L, n, r, generator=gen).to(DEVICE, torch.bfloat16) for n in widths]
    outputs = []
    for shift in (0, 4):  # 16-byte words, then 8-byte ones
        out = torch.randn(T, sum(widths) + shift, generator=gen).to(DEVICE, torch.bfloat16)
        if outputs:  # the same old outputs, 4 columns further right
            out[:, shift:] = outputs[0][1]
        old = out.clone()
        with force_launch_config("expand", config):
            lora_expand(x, weights, out, *meta.meta_args(T), offset_start=shift, add_inputs=True)
        want = reference.lora_expand(x, weights, old, slots.to(DEVICE), shift, True)
        error = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert error < 1e-2, (shift, error)
        outputs.append((out[:, shift:], old[:, shift:]))
    n_tiles = config.tile_n // (config.threads // 4)
    wide = [a[6] for a, _ in builds]
    assert wide == [n_tiles % 4 == 0, False], wide
    assert torch.equal(outputs[0][0], outputs[1][0])


@pytest.mark.parametrize(
    "config", [c for c in launch_configs("expand") if c.kernel == "mma"], ids=config_name
)
def test_tensor_core_expand_without_clamps_gives_the_same_bits(config, monkeypatch):
    """Where every slice's width is a multiple of a warp's columns, the tensor-core expand
    is built without clamping B's rows and the output words to the slice's end, or checking
    its stores against it (``whole_groups``). Right, and the same bits as the build that
    clamps and checks (forced here): a group inside its slice never needed either."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    clamped = []  # [True] while the builds are forced to clamp and check
    builds = record_mma_expand_builds(monkeypatch, lambda a: a[:7] + (False,) if clamped else a)
    gen = torch.Generator().manual_seed(9)
    slots = torch.tensor([1, 0, 2, 2, -1, 0, 1, 1, 2, 0, 0, 2, 1, 2, 0, 1, 2, 1])
    per_warp = config.tile_n // (config.threads // 32)  # (128 columns for one warp of 128)
    T, L, r, widths = len(slots), 3, 16, [max(128, 2 * per_warp), max(64, per_warp)]
    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    x = torch.randn(len(widths), T, r, generator=gen).to(DEVICE)
    weights = [torch.randn(L, n, r, generator=gen).to(DEVICE, torch.bfloat16) for n in widths]
    old = torch.randn(T, sum(widths) + 8, generator=gen).to(DEVICE, torch.bfloat16)
    want = reference.lora_expand(x, weights, old, slots.to(DEVICE), 8, True)
    outputs = []
    for clamps in (False, True):
        clamped[:] = [True] if clamps else []
        out = old.clone()
        with force_launch_config("expand", config):
            lora_expand(x, weights, out, *meta.meta_args(T), offset_start=8, add_inputs=True)
        error = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert error < 1e-2, (clamps, error)
        outputs.append(out)
    whole_groups = [a[7] for a, _ in builds]
    assert whole_groups == [True, False], whole_groups
    assert torch.equal(outputs[0], outputs[1])


def _expand_problem(slots, num_loras, rank, widths, seed, meta_tokens=None):
    """``(meta, x, weights, old, want)`` on the test device: metadata for ``slots`` (made
    for ``meta_tokens`` tokens, all of them by default), an fp32 buffer, bf16 B for each
    width, old bf16 outputs, and the reference's result of adding into them."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    gen = torch.Generator().manual_seed(seed)
    meta = LoRAKernelMeta.make(num_loras, meta_tokens or len(slots), DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    x = torch.randn(len(widths), len(slots), rank, generator=gen).to(DEVICE)
    weights = [
        torch.randn(num_loras, n, rank, generator=gen).to(DEVICE, torch.bfloat16) for n in widths
    ]
    old = torch.randn(len(slots), sum(widths), generator=gen).to(DEVICE, torch.bfloat16)
    want = reference.lora_expand(x, weights, old, slots.to(DEVICE), 0, True)
    return meta, x, weights, old, want


@pytest.mark.parametrize(
    "config", [c for c in launch_configs("expand") if c.kernel == "mma"], ids=config_name
)
def test_tensor_core_expand_loads_and_passes_give_the_same_bits(config, monkeypatch):
    """At r=32 the tensor-core expand reads the buffer and B 16 bytes at a time where their
    rows start at multiples of 16 bytes (``wide_x``, ``wide_b``), and where the grid has a
    block for every column group (a slice no wider than a block's columns here) it is built
    for one pass (``one_pass``: B loaded ahead, no second group). Right, and the same bits
    as the build with all three off (forced), and as the call whose buffer and B start 8
    bytes past (where the ops must turn the loads off)."""
    forced_off = []  # [True] while the builds are forced to turn the three off
    builds = record_mma_expand_builds(
        monkeypatch, lambda a: a[:8] + (False, False, False) + a[11:] if forced_off else a
    )
    slots = torch.tensor([2, 0, 1, -1, 1, 0, 2, 2, 0, 1, 1, 2, 0, 0, 1, 2, 2, 1])
    width = config.columns_per_block("expand")
    rank = min(32, config.to_rank or 32)  # (B's 16-byte words need a rank of 32)
    meta, x, weights, old, want = _expand_problem(slots, 3, rank, [width], seed=13)
    outputs = []
    for run in ("aligned", "forced off", "8 bytes past"):
        forced_off[:] = [True] if run == "forced off" else []
        x_run, w_run = x, weights
        if run == "8 bytes past":
            x_run, w_run = rows_at_8_bytes(x), [rows_at_8_bytes(w) for w in weights]
        out = old.clone()
        with force_launch_config("expand", config):
            lora_expand(x_run, w_run, out, *meta.meta_args(len(slots)), add_inputs=True)
        error = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert error < 1e-2, (run, error)
        outputs.append(out)
    aligned = (True, rank % 32 == 0, True)
    built = [a[8:11] for a, _ in builds]  # wide_x, wide_b, one_pass
    assert built == [aligned, (False, False, False), (False, False, True)], built
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize(
    "config", [c for c in launch_configs("expand") if c.kernel == "mma"], ids=config_name
)
def test_tensor_core_expand_on_metadata_made_elsewhere(config):
    """vLLM's six metadata tensors made without ``LoRAKernelMeta`` (copies: no host-side
    facts) have no tile table or tile tokens kept for them; the launch makes both on the
    device. Right, and the same bits as with the meta's own."""
    slots = torch.tensor([2, 2, -1, 0, 2, 1, 2, 2, 0, 2, 2, 1, 2, 0, 2, 2, 2, -1, 2, 2])
    T = len(slots)
    meta, x, weights, old, want = _expand_problem(slots, 3, 16, [64, 32], 13, meta_tokens=T + 5)
    outputs = []
    for args in (meta.meta_args(T), [t.clone() for t in meta.meta_args(T)]):
        assert (host_facts_of(args[4]) is None) == (len(outputs) == 1)
        out = old.clone()
        with force_launch_config("expand", config):
            lora_expand(x, weights, out, *args, offset_start=0, add_inputs=True)
        error = ((out.double() - want).abs().max() / want.abs().max()).item()
        assert error < 1e-2, (len(outputs), error)
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("aligned", [True, False], ids=["rows-at-16-bytes", "rows-at-8-bytes"])
@pytest.mark.parametrize("rank", [3, 8, 16, 20, 64, 256])
def test_lane_split_expand_at_every_lane_count(rank, aligned, monkeypatch):
    """The lane-split expand shares a row of B among 1 (r=3: single elements; r=8, 20:
    one lane reads the whole row), 2 (r=16), 8 (r=64) or 32 (r=256) lanes, reading pairs
    of words with one 16-byte load where every row of B starts at a multiple of 16
    bytes, and two 8-byte loads where rows start at 8 (or, r=20, are 40 bytes long):
    every case right."""
    from .op_cases import Problem, serving_expand_case

    built = []
    build = choice.build_lanes_expand_kernel
    monkeypatch.setattr(
        choice, "build_lanes_expand_kernel", lambda *a: built.append(a[6:9]) or build(*a)
    )

    def expand(x, weights, out, *rest, **kwargs):
        if not aligned:
            weights = [rows_at_8_bytes(w) for w in weights]
        lora_expand(x, weights, out, *rest, **kwargs)

    problem = Problem(slots=[0, 2, -1, 1, 2, 2, 0], prepared=7, num_loras=3, seed=3)
    case = serving_expand_case(problem, rank, [5, 3], offset_start=1, extra_columns=1)
    config = next(c for c in launch_configs("expand") if c.kernel == "lanes")
    with force_launch_config("expand", config):
        check_expand(expand, case)
    packed = rank % 4 == 0  # rows of whole 8-byte words
    words = rank // 4 if packed else rank
    wide = aligned and rank % 8 == 0  # every row at a multiple of 16 bytes (not r=20's)
    assert built and set(built) == {(packed, words, wide)}, built


@pytest.mark.parametrize("num_loras", [1, 2])
@pytest.mark.parametrize("kernel", ["shrink token", "shrink rows", "expand lanes", "expand mma"])
def test_one_slot_gives_the_tables_bits(kernel, num_loras, monkeypatch):
    """On weight stacks of one slot, blocks take their tokens by their own index and load
    the weights before they know the tokens' slots (``kernels.shrink``,
    ``kernels.shrink_token`` and ``kernels.expand_mma``, "One slot"): right, with tokens
    of no LoRA and padded rows past the prepared tokens, over two slices, and the same
    bits as the table's blocks (``ops.choice.one_slot`` turned off). Stacks of two slots keep
    the table. The shrink takes the one-token kernel where its rows are packed words (H
    = 64 here) and the row kernel's one-slot blocks where they are not (H = 62). The
    tensor-core expand's tiles of 16 tokens are two here, the second partly past the
    last token."""
    from .op_cases import Problem, ShrinkCase, serving_expand_case

    op, kind = kernel.split()
    builds = {
        "token": ["build_shrink_kernel", "build_token_shrink_kernel"],
        "rows": ["build_shrink_kernel"],
        "lanes": ["build_lanes_expand_kernel"],
        "mma": ["build_mma_expand_kernel"],
    }[kind]
    built = []  # one_slot of each build; "token" for the one-token shrink
    for name in builds:
        build = getattr(choice, name)
        mark = {  # one_slot: the last argument, but for the tensor-core expand's (11)
            "build_token_shrink_kernel": lambda a: "token",
            "build_mma_expand_kernel": lambda a: a[11],
        }.get(name, lambda a: a[-1])
        monkeypatch.setattr(
            choice, name, lambda *a, build=build, mark=mark: built.append(mark(a)) or build(*a)
        )
    pattern = (1, -1, 0, 1, 0) * (4 if kind == "mma" else 1)
    slots = [min(s, num_loras - 1) for s in pattern] + [-1]  # the last: padding
    problem = Problem(slots=slots, prepared=len(pattern), num_loras=num_loras, seed=29)
    kernel_kind = "rows" if kind == "token" else kind
    config = next(
        c
        for c in launch_configs(op)
        if c.kernel == kernel_kind and (kind == "mma" or c.tile_m == 1)
    )
    outputs, one_slot = [], choice.one_slot

    def recorded(impl):
        def run(*args, **kwargs):
            impl(*args, **kwargs)
            outputs.append(args[2].clone())

        return run

    for allowed in (True, False):
        monkeypatch.setattr(choice, "one_slot", one_slot if allowed else lambda *a: False)
        with force_launch_config(op, config):
            if op == "shrink":
                hidden = 64 if kind == "token" else 62  # rows of packed words, or not
                case = ShrinkCase(
                    problem, hidden, 8, 2, 0, torch.bfloat16, torch.float32, 0.5, False
                )
                check_shrink(recorded(lora_shrink), case)
            else:
                # (the tensor cores take slices of whole 4-column words)
                case = serving_expand_case(problem, 16, [40, 24], 4 if kind == "mma" else 3)
                check_expand(recorded(lora_expand), case)
    first = ("token" if kind == "token" else True) if num_loras == 1 else False
    assert built == [first, False], built
    assert torch.equal(outputs[0], outputs[1])
