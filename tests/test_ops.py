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
from .strategies import in_shards


@in_shards()
@given(shrink_cases())
def test_shrink_matches_reference(shard, case):
    check_shrink(lora_shrink, case)


@in_shards()
@given(expand_cases())
def test_expand_matches_reference(shard, case):
    check_expand(lora_expand, case)


def _tensor_core_configs():
    return [c for c in launch_configs("expand") if c.kernel == "mma"]


def _register_tensor_core_configs():
    """The tensor-core expands that read their operands into registers
    (:mod:`punica_numba.kernels.expand_mma`): not the staged ones, whose builds and what they
    take are another kernel's (test_staged_expand.py)."""
    return [c for c in _tensor_core_configs() if not c.staged]


@in_shards()
@given(expand_cases(tensor_cores=True), st.data())
def test_tensor_core_expand_matches_reference(shard, case, data):
    """A tensor-core expand configuration (drawn, then forced) on a call it takes (a
    free draw rarely makes one: bf16 or fp16, an even rank, slices of whole 4-column
    words). One
    configuration per example: on the GPU each check computes a float64 reference of up
    to 4096 x 6144 outputs, and the draws of ranks compile several kernels each."""
    config = data.draw(st.sampled_from(_tensor_core_configs()), label="configuration")
    with force_launch_config("expand", config):
        check_expand(lora_expand, case)


@in_shards()
@given(shrink_cases())
def test_shrink_is_deterministic(shard, case):
    """No atomics: the same inputs give the same bits, run after run."""
    runs = []

    def record(*args):
        lora_shrink(*args)
        runs.append(args[2].clone())

    check_shrink(record, case)
    check_shrink(record, case)
    assert torch.equal(runs[0], runs[1])


@in_shards()
@given(expand_cases())
def test_expand_is_deterministic(shard, case):
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

    built = []  # the last argument of each build: wide
    builds = ("build_mma_shrink_kernel", "build_split_mma_shrink_kernel")  # (K split)
    builds += ("build_cluster_mma_shrink_kernel",)  # (K split, its runs in one cluster)
    staged = ("build_staged_mma_shrink_kernel", "build_split_staged_mma_shrink_kernel")
    for name in (*builds, "build_joint_mma_shrink_kernel", *staged):  # (side by side; staged)
        build = getattr(choice, name)
        monkeypatch.setattr(
            choice, name, lambda *a, build=build, **k: built.append(a[-1]) or build(*a, **k)
        )  # (the arguments: dtypes, threads, tiles[, splits], accumulate, wide[, ahead=])

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", _register_tensor_core_configs(), ids=config_name)
def test_tensor_core_expand_writes_16_or_8_byte_words(config, dtype, monkeypatch):
    """The tensor-core expand reads and writes its output 16 bytes at a time where the
    output's rows start at multiples of 16 bytes and the slices at multiples of 8 columns
    (and a warp has a multiple of 4 tiles), 8 at a time otherwise (here: the same slices
    4 columns further right in a 4-column wider output). Both right, and the same bits:
    only the rows of B fed to each tensor-core column differ. B and the output bf16 or
    fp16 (whose words are rounded and widened by their own pairs)."""
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
    weights = [torch.randn(L, n, r, generator=gen).to(DEVICE, dtype) for n in widths]
    outputs = []
    for shift in (0, 4):  # 16-byte words, then 8-byte ones
        out = torch.randn(T, sum(widths) + shift, generator=gen).to(DEVICE, dtype)
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
    assert [a[14] for a, _ in builds] == [dtype, dtype]  # (the tensor cores took both)
    assert torch.equal(outputs[0][0], outputs[1][0])


@pytest.mark.parametrize("config", _register_tensor_core_configs(), ids=config_name)
def test_tensor_core_expand_without_clamps_gives_the_same_bits(config, monkeypatch):
    """Where every slice's width is a multiple of a warp's columns, the tensor-core expand
    is built without clamping B's rows and the output words to the slice's end, or checking
    its stores against it (``whole_groups``). Right, and the same bits as the build that
    clamps and checks (forced here): a group inside its slice never needed either."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    clamped = []  # [True] while the builds are forced to clamp and check
    builds = record_mma_expand_builds(
        monkeypatch, lambda a: (*a[:7], False, *a[8:]) if clamped else a
    )  # (argument 7: whole_groups)
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


def _expand_problem(slots, num_loras, rank, widths, seed, meta_tokens=None, dtype=torch.bfloat16):
    """``(meta, x, weights, old, want)`` on the test device: metadata for ``slots`` (made
    for ``meta_tokens`` tokens, all of them by default), an fp32 buffer, B for each width
    and old outputs of ``dtype`` (bf16 unless given), and the reference's result of adding
    into them."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE

    gen = torch.Generator().manual_seed(seed)
    meta = LoRAKernelMeta.make(num_loras, meta_tokens or len(slots), DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    x = torch.randn(len(widths), len(slots), rank, generator=gen).to(DEVICE)
    weights = [torch.randn(num_loras, n, rank, generator=gen).to(DEVICE, dtype) for n in widths]
    old = torch.randn(len(slots), sum(widths), generator=gen).to(DEVICE, dtype)
    want = reference.lora_expand(x, weights, old, slots.to(DEVICE), 0, True)
    return meta, x, weights, old, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", _register_tensor_core_configs(), ids=config_name)
def test_tensor_core_expand_loads_and_passes_give_the_same_bits(config, dtype, monkeypatch):
    """At r=32 the tensor-core expand reads the buffer and B 16 bytes at a time where their
    rows start at multiples of 16 bytes (``wide_x``, ``wide_b``), and where the grid has a
    block for every column group (a slice no wider than a block's columns here) it is built
    for one pass (``one_pass``: B loaded ahead, no second group). Right, and the same bits
    as the build with all three off (forced), and as the call whose buffer and B start 8
    bytes past (where the ops must turn the loads off); for bf16 and fp16 B alike."""
    forced_off = []  # [True] while the builds are forced to turn the three off
    builds = record_mma_expand_builds(
        monkeypatch, lambda a: a[:8] + (False, False, False) + a[11:] if forced_off else a
    )
    slots = torch.tensor([2, 0, 1, -1, 1, 0, 2, 2, 0, 1, 1, 2, 0, 0, 1, 2, 2, 1])
    width = config.columns_per_block("expand")
    rank = min(32, config.to_rank or 32)  # (B's 16-byte words need a rank of 32)
    meta, x, weights, old, want = _expand_problem(slots, 3, rank, [width], 13, dtype=dtype)
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
    assert {a[14] for a, _ in builds} == {dtype}
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


@pytest.mark.parametrize("config", _register_tensor_core_configs(), ids=config_name)
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


BUFFERS = [torch.float32, torch.float16]


@pytest.mark.parametrize("x_dtype", BUFFERS, ids=["fp32-buffer", "fp16-buffer"])
def test_fp16_expand_of_8_tokens_a_slot_takes_the_tensor_cores(x_dtype, monkeypatch):
    """An fp16 expand (B and output fp16, the buffer fp32 or fp16) of 8 tokens a slot, the
    tensor cores' threshold on the GPU, is chosen for the tensor-core expand (its
    configuration's kernel is "mma") and built for fp16: the configuration a bf16 call of
    the same shapes gets. Right within the suite's fp16 tolerance."""
    from .op_cases import ExpandCase, Problem

    builds = record_mma_expand_builds(monkeypatch)
    problem = Problem([0] * 8 + [2] * 8 + [1] * 8, 24, 3, seed=17)
    chosen = []

    def expand(*args, **kwargs):
        launch = ops.prepare_expand(*args, **kwargs)
        launch()
        chosen.append(launch.config)

    for dtype in (torch.float16, torch.bfloat16):
        buffer = x_dtype if dtype == torch.float16 else torch.float32
        case = ExpandCase(problem, 16, [64, 32], 4, 4, buffer, dtype, dtype, True, False, False)
        check_expand(expand, case)
    fp16, bf16 = chosen
    assert fp16.kernel == "mma" and fp16 == bf16, (fp16, bf16)
    assert [(a[0], a[14]) for a, _ in builds] == [
        (x_dtype, torch.float16),
        (torch.float32, torch.bfloat16),
    ]


def _at_scale(gen: torch.Generator, shape, exponents) -> torch.Tensor:
    """float64 values of random sign and significand in [1, 2) times ``2 ** (exponents +
    j)``, j drawn from -2..2 per element (``exponents`` broadcast to ``shape``)."""
    significand = 1 + torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    jitter = torch.randint(-2, 3, shape, generator=gen)
    return sign * significand * 2.0 ** (exponents + jitter)


def _fp16_b_at_its_edges(gen: torch.Generator, slots: int, width: int, rank: int):
    """fp16 B ``[slots, width, rank]`` in four bands of columns: large (up to 65504, which
    every eighth element is), around the smallest normal (2**-14, every eighth), subnormal
    (multiples of 2**-24: 2**-24 and 1023 * 2**-24 among them), and every element of the
    last band from any of these or ordinary (2**-8 .. 2**9). Full significands elsewhere, so
    that most elements need the bits a bf16 drops; even columns positive."""
    shape = (slots, width, rank)
    largest = torch.tensor(65504.0, dtype=torch.float64)
    large = _at_scale(gen, shape, 14).clamp(-largest, largest)
    large[..., ::8] = largest * torch.sign(large[..., ::8])
    smallest_normal = _at_scale(gen, shape, -13)
    smallest_normal[..., 1::8] = 2.0**-14 * torch.sign(smallest_normal[..., 1::8])
    subnormal = torch.randint(1, 1024, shape, generator=gen).double() * 2.0**-24
    subnormal[..., 2::8], subnormal[..., 3::8] = 2.0**-24, 1023 * 2.0**-24
    subnormal *= torch.randint(0, 2, shape, generator=gen) * 2 - 1
    ordinary = _at_scale(gen, shape, torch.randint(-6, 7, shape, generator=gen))
    kinds = torch.stack([large, smallest_normal, subnormal, ordinary])  # [4, L, N, r]
    band = torch.arange(width) * 4 // width  # 0..3 across the columns
    kind = torch.where(band[:, None] == 3, torch.randint(0, 4, shape, generator=gen), band[:, None])
    b = kinds.gather(0, kind.expand(shape)[None])[0]
    b[:, ::2] = b[:, ::2].abs()  # even columns positive (see the caller)
    return b.to(torch.float16)


@pytest.mark.parametrize("x_dtype", BUFFERS, ids=["fp32-buffer", "fp16-buffer"])
def test_fp16_tensor_core_expand_at_the_range_edges(x_dtype):
    """The fp16 tensor-core expand splits the buffer and B into bf16 halves
    (``kernels.expand_mma``, "Precision"). Against the float64 reference, at the edges of
    both ranges: buffer rows from fp32's subnormals (2**-140) through 2**-126 and tiny
    rows (2**-44 ..) to large ones (2**40, and 2**100), or for an fp16 buffer from its
    subnormals to 65504; B large (65504), at fp16's smallest normal and subnormal
    (2**-24); zeros and values exact in bf16 (whose low half is zero) in the buffer.
    Where the result is inside fp16's range (its magnitude at most 2**15) it meets the
    suite's fp16 tolerance (subnormal results too); where it is far past it, it is the
    infinity of the reference's sign."""
    from punica_numba import reference
    from punica_numba.meta import LoRAKernelMeta

    from .strategies import DEVICE
    from .tolerance import assert_close

    gen = torch.Generator().manual_seed(23)
    T, r, width, L = 32, 32, 64, 2
    slots = torch.tensor([0] * 16 + [1] * 16)  # a tile of 16 tokens each
    if x_dtype == torch.float32:
        rows = torch.linspace(-44, 40, T).round().double()
        rows[0], rows[1], rows[16], rows[-1] = -140, -126, -130, 100
        x = _at_scale(gen, (1, T, r), rows[:, None])
        x[..., 5::16] = 0.0
        x[..., 6::16] = x[..., 6::16].to(torch.bfloat16).double()  # lo = 0
    else:
        rows = torch.linspace(-24, 15, T).round().double()
        x = _at_scale(gen, (1, T, r), rows[:, None]).clamp(-65504.0, 65504.0)
        x[..., 5::16] = 0.0
    # Even rows positive, like B's even columns: their products all have one sign, so that
    # an error of the split (a dropped low half: a cut toward zero) adds up, not cancels.
    x[:, ::2] = x[:, ::2].abs()
    x = x.to(x_dtype)
    b = _fp16_b_at_its_edges(gen, L, width, r)
    old = torch.zeros(T, width, dtype=torch.float64)
    old[:, 48:] = _at_scale(gen, (T, 16), torch.randint(-26, 10, (T, 16), generator=gen))
    old = old.to(torch.float16)
    want = reference.lora_expand(x, [b], old, slots, 0, True)
    magnitude = reference.lora_expand(x.abs(), [b.abs()], old.abs(), slots, 0, True)

    meta = LoRAKernelMeta.make(L, T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    out = old.to(DEVICE)
    launch = ops.prepare_expand(
        x.to(DEVICE), [b.to(DEVICE)], out, *meta.meta_args(T), offset_start=0, add_inputs=True
    )
    launch()
    assert launch.config.kernel == "mma", launch.config
    out = out.cpu()

    inside = magnitude <= 2**15
    normal = inside & (magnitude >= 2**-14)  # (below, the error is fp16's fixed spacing)
    assert_close(out[normal], want[normal], magnitude[normal], r, "expand fp16 range edges")
    small = inside & ~normal
    assert_close(out[small], want[small], magnitude[small], r, "expand fp16 edges, subnormal")
    far_past = (want.abs() >= 2**17) & (want.abs() >= magnitude / 64)
    infinity = torch.sign(want[far_past]) * float("inf")
    assert torch.equal(out[far_past].double(), infinity)
    # what the data reached: most results inside, some past, some fp16 subnormals
    assert int(inside.sum()) >= T * width // 2 and int(far_past.sum()) > 0
    tiny = inside & (want.abs() < 2**-14) & (want.abs() >= 2**-22)
    assert int(tiny.sum()) > 0


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
        mark = {  # one_slot: the last argument, but for the row shrink's (8; x_rows follows)
            "build_token_shrink_kernel": lambda a: "token",  # and the tensor-core expand's (11)
            "build_shrink_kernel": lambda a: a[8],
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
