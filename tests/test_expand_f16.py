"""The fp16 tensor-core expand on two f16 products (``kernels.expand_mma``, "Precision").

fp16 B goes on the f16 tensor cores as it is; each token row of an fp32 buffer is scaled
by a power of two that brings its largest magnitude into [2**14, 2**15), split into fp16
hi + lo, and its sums are scaled back before the old output is added. Checked here,
through the op (forced: the first tensor-core configuration of this machine's table that
reaches the rank, any of them in the property test, and a twin of 64 columns a warp whose
r=64 build reads the buffer first), against the float64 reference:

1. ordinary values at ranks 16, 40, 64 (one chunk: the values held, read whole, element
   by element, or first), 100 and 128 (in chunks: the rows' largest found in a pass
   before the first), fp32 and fp16 buffers; within the suite's tolerance and within a
   tighter bound, on outputs that cancel against the old ones, that only the split's 22
   bits meet (``hi`` alone has 11);
2. rows at the ends of fp32's range, one kind a row of each 16-token tile: ~1e30
   (infinite in fp16: the reference's infinity, never NaN), 2**20 .. 2**25 and 2**-24 ..
   2**-19 (outputs inside fp16's range only through B's small or large columns), ~1e-30,
   large and small values mixed, a row's largest in its last chunk, and a zero row (the
   old output, bit for bit);
3. rows holding an infinity or a NaN: infinite or NaN outputs as the reference's, the
   other rows untouched by them;
4. the device functions of the scaling at the edges of fp32: zero, subnormals, the
   largest finite, infinities and NaN;
5. the checks reject the kernel without the scaling, with a lane's own largest as its
   row's, and without ``lo`` (deliberately wrong device functions, put in for one build).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import float32, uint32

from punica_numba import launch, lora_expand, ops, reference
from punica_numba._cuda import cuda, kernel_array, launch_stream
from punica_numba.kernels import build_mma_expand_kernel, expand_mma
from punica_numba.kernels.dtypes import f16_pair
from punica_numba.kernels.mma import abs_bits, f16_row_scale, split_to_f16
from punica_numba.launch import LaunchConfig, force_launch_config, launch_configs
from punica_numba.meta import LoRAKernelMeta
from punica_numba.ops import choice

from .op_cases import ExpandCase, Problem, check_expand, record_mma_expand_builds
from .strategies import DEVICE, assign_slots
from .tolerance import U32, UNIT_ROUNDOFF, assert_close

#: Each example a kernel of up to 10 rank steps: at most 50 examples.
FEW = settings(max_examples=min(settings().max_examples, 50))

#: For these tests only: a warp of 64 columns (8 tiles), so that at r=64 a block of one
#: column group holds 32 words of B a lane and reads the buffer first (``BUFFER_FIRST``).
WIDE_WARP = LaunchConfig("mma", threads=32, tile_m=16, tile_n=64, from_tokens_per_slot=1e9)

#: The build's positional arguments (``ops.choice``): where each flag sits.
K_STEPS, N_TILES, WIDE_X, ONE_PASS, DTYPE, F16_PRODUCTS = 4, 3, 8, 10, 14, 16


def _table() -> list:
    return [c for c in launch_configs("expand") if c.kernel == "mma"]


def _config(rank: int, wide_warp: bool, monkeypatch) -> LaunchConfig:
    """:data:`WIDE_WARP` (put in this machine's table for the test only), or the table's
    first tensor-core expand that reaches the rank."""
    if wide_warp:
        machine = launch._SIMULATOR_CONFIGS if launch.SIMULATOR else launch._GPU_CONFIGS
        monkeypatch.setitem(machine, "expand", (*launch_configs("expand"), WIDE_WARP))
        return WIDE_WARP
    return next(c for c in _table() if (c.to_rank or rank) >= rank)


def _two_f16_products(args: tuple) -> bool:
    """Whether a build's arguments make the expand of two f16 products: fp16 B, and
    ``f16_products`` left on (the op passes it only to turn it off)."""
    return args[DTYPE] == torch.float16 and (len(args) <= F16_PRODUCTS or args[F16_PRODUCTS])


def _reads_the_buffer_first(args: tuple) -> bool:
    """``BUFFER_FIRST`` of a build (``kernels.expand_mma``, "The buffer before B")."""
    words = args[K_STEPS] * args[N_TILES]
    one_chunk = args[K_STEPS] <= expand_mma.CHUNK_STEPS
    return one_chunk and args[ONE_PASS] and args[WIDE_X] and words > expand_mma.EARLY_B_WORDS


def _expand(x, b, old, slots, config, monkeypatch) -> tuple[torch.Tensor, tuple]:
    """``old + x @ B[slot].T`` by the op under ``config`` (one slice, added to the
    output): the new output (on the CPU) and the build's arguments."""
    builds = record_mma_expand_builds(monkeypatch)
    T = len(slots)
    meta = LoRAKernelMeta.make(b.shape[0], T, DEVICE)
    meta.prepare_tensors(slots.to(DEVICE))
    out = old.to(DEVICE, copy=True)  # (on the CPU, ``to`` alone would give old itself)
    with force_launch_config("expand", config):
        launch_now = ops.prepare_expand(
            x.to(DEVICE), [b.to(DEVICE)], out, *meta.meta_args(T), offset_start=0, add_inputs=True
        )
    launch_now()
    assert launch_now.config == config, (launch_now.config, config)
    (args, _), *_ = builds
    assert _two_f16_products(args), args
    return out.cpu(), args


def _reference(x, b, old, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 reference and its magnitude (every input by its absolute value)."""
    want = reference.lora_expand(x, [b], old, slots, 0, True)
    magnitude = reference.lora_expand(x.abs(), [b.abs()], old.abs(), slots, 0, True)
    return want, magnitude


# 1. Ordinary values --------------------------------------------------------------------

#: (rank, the buffer's dtype, the 64-column warp): one chunk read whole (16, 64), element
#: by element (40: not a multiple of 16) or first (64, wide warp); chunks read element by
#: element (100: 7 steps, 4 + 3) or whole (128); an fp16 buffer, unscaled.
ORDINARY = [
    (16, torch.float32, False),
    (40, torch.float32, False),
    (64, torch.float32, False),
    (64, torch.float32, True),
    (100, torch.float32, False),
    (128, torch.float32, False),
    (64, torch.float16, False),
    (100, torch.float16, True),
]


def _check_ordinary(rank, x_dtype, wide_warp, monkeypatch) -> tuple:
    """Two slots of 16 tokens (and a row of none), 64 columns; normal buffer values (fp32
    with full significands) and B. The old outputs are minus the products rounded to fp16
    (``old = -fp16(x @ B.T)``), so that the new ones are what the rounding left: an
    output cancels to about 2**-11 of its magnitude, and fp16's rounding of it, the
    suite's tolerance, no longer hides a kernel that keeps 11 bits of the buffer rather
    than 22. Each output must lie within

        2**-11 |want| + 2 (r + 4) 2**-24 magnitude + 2 * 2**-24

    (its own rounding, the fp32 sums and the split doubled, fp16's subnormal spacing).
    The build's arguments, for the caller's checks."""
    config = _config(rank, wide_warp, monkeypatch)
    gen = torch.Generator().manual_seed(rank)
    T, width = 33, 64
    slots = torch.tensor([1] * 16 + [-1] + [0] * 16)
    x = torch.randn(1, T, rank, generator=gen).to(x_dtype)  # [1, T, r]
    b = torch.randn(2, width, rank, generator=gen).to(torch.float16)  # [L, N, r]
    products = reference.lora_expand(x, [b], torch.zeros(T, width), slots, 0, True)
    old = (-products).to(torch.float16)  # [T, N]: the products, cancelled to fp16's rounding
    got, args = _expand(x, b, old, slots, config, monkeypatch)
    want, magnitude = _reference(x, b, old, slots)
    assert_close(got, want, magnitude, terms=rank, what="expand f16 products")
    err = (got.double() - want).abs()
    tight = UNIT_ROUNDOFF[torch.float16] * want.abs() + 2 * (rank + 4) * U32 * magnitude
    bad = err > tight + 2 * 2.0**-24
    assert not bool(bad.any()), (
        f"{int(bad.sum())} outputs past the tight bound; first at "
        f"{tuple(torch.nonzero(bad)[0].tolist())}: error {float(err[bad][0]):.3g}, "
        f"bound {float(tight[bad][0]):.3g}"
    )
    lora = slots != -1
    assert bool((want[lora].abs() < magnitude[lora] * 2.0**-8).all())  # (they cancel)
    return args


@pytest.mark.parametrize(
    "rank, x_dtype, wide_warp",
    ORDINARY,
    ids=[f"r{r}-{str(x)[6:]}-buffer{'-64-columns' if w else ''}" for r, x, w in ORDINARY],
)
def test_ordinary_values_meet_the_split_s_bound(rank, x_dtype, wide_warp, monkeypatch):
    """Ordinary values (see ``_check_ordinary``), at each rank and form of reading the
    buffer; the build is the one named (chunks past r=64, the buffer first at r=64 with
    64 columns a warp)."""
    args = _check_ordinary(rank, x_dtype, wide_warp, monkeypatch)
    assert args[0] == x_dtype
    assert (args[K_STEPS] > expand_mma.CHUNK_STEPS) == (rank > 64)
    # (64 columns a warp: the twin, and on the GPU the table's own first tensor-core expand)
    sixty_four = args[N_TILES] == 8
    assert _reads_the_buffer_first(args) == (sixty_four and rank == 64 and x_dtype == torch.float32)


@st.composite
def _cases(draw) -> ExpandCase:
    """An fp16 expand the tensor cores take: a rank of whole 4-element words (4-160),
    slices of whole 4-column words, an fp32 or fp16 buffer (whole or strided), 1-2 slots."""
    num_tokens = draw(st.integers(16, 32), label="T")
    num_loras = draw(st.integers(1, 2), label="L")
    mode = draw(st.sampled_from(("identical", "distinct", "uniform", "zipf")), label="mode")
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    slots = assign_slots(mode, num_tokens, num_loras, seed)
    num_slices = draw(st.integers(1, 2), label="S")
    return ExpandCase(
        problem=Problem(slots, num_tokens, num_loras, seed),
        rank=4 * draw(st.integers(1, 40), label="r / 4"),
        widths=[4 * draw(st.integers(1, 8), label=f"N_{s} / 4") for s in range(num_slices)],
        offset_start=4 * draw(st.integers(0, 1), label="offset_start / 4"),
        extra_columns=4 * draw(st.integers(0, 1), label="columns past the slices / 4"),
        x_dtype=draw(st.sampled_from((torch.float32, torch.float16)), label="buffer dtype"),
        w_dtype=torch.float16,
        out_dtype=torch.float16,
        add_inputs=draw(st.booleans(), label="add_inputs"),
        four_d=draw(st.booleans(), label="4-D weights"),
        strided_input=draw(st.booleans(), label="strided buffer"),
    )


@FEW
@given(_cases(), st.data())
def test_drawn_fp16_expands_match_reference(case, data):
    """Drawn fp16 calls under a drawn tensor-core configuration: within the suite's
    tolerance, on the two f16 products."""
    fits = [c for c in _table() if (c.to_rank or case.rank) >= case.rank]
    config = data.draw(st.sampled_from(fits), label="configuration")
    built = []  # (recorded by hand: a function-scoped monkeypatch outlives the examples)
    build = choice.build_mma_expand_kernel

    def recorded(*args):
        built.append(args)
        return build(*args)

    choice.build_mma_expand_kernel = recorded
    try:
        with force_launch_config("expand", config):
            check_expand(lora_expand, case)
    finally:
        choice.build_mma_expand_kernel = build
    assert all(_two_f16_products(args) for args in built), built


# 2. Rows at the ends of fp32's range ---------------------------------------------------


def _at_scale(gen, shape, exponents) -> torch.Tensor:
    """float64 values of random sign and significand in [1, 2) times ``2 ** exponents``
    (broadcast to ``shape``)."""
    significand = 1 + torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=gen) * 2 - 1
    return sign * significand * 2.0**exponents


#: Each 16-token tile's rows, one kind a row (the tile's remaining rows ordinary).
ROW_KINDS = ("1e30", "large", "tiny", "1e-30", "mixed", "spike", "zero", "ordinary")


def _extreme_problem(rank: int, seed: int):
    """Two tiles of 16 tokens, rows by :data:`ROW_KINDS` (1e30 rows positive, so that
    most of their outputs are far past fp16's range whatever B's signs), fp16 B of 48
    columns in three bands: small (2**-23 .. 2**-17, fp16 subnormals, so that rows of
    2**20 .. 2**25 give outputs inside fp16's range), ordinary, and large (2**9 .. 2**15,
    for rows of 2**-24 .. 2**-19). The spike row: ordinary values and one of 2**24 at
    k = 20, in the rank's second chunk past r=64 (lane 0's steps 4-7 there), so its
    largest is not in the first. Old outputs small (2**-14 .. 2**-9), so that they do not
    hide the products. Returns ``(x [1, T, r] fp32, B [2, 48, r] fp16, old [T, 48] fp16,
    slots, kinds)``."""
    gen = torch.Generator().manual_seed(seed)
    T, width = 32, 48
    kinds = [ROW_KINDS[i % 16] if i % 16 < len(ROW_KINDS) else "ordinary" for i in range(T)]
    exponents = {
        "1e30": torch.full((rank,), 99.0),
        "large": torch.randint(20, 25, (1,), generator=gen).double().expand(rank),
        "tiny": torch.randint(-24, -19, (1,), generator=gen).double().expand(rank),
        "1e-30": torch.full((rank,), -100.0),
        "mixed": torch.where(torch.arange(rank) % 3 == 0, 24.0, -4.0),
        "spike": torch.zeros(rank).index_fill_(0, torch.tensor([20 % rank]), 24.0),
        "zero": torch.zeros(rank),
        "ordinary": torch.zeros(rank),
    }
    x = torch.stack([_at_scale(gen, (rank,), exponents[kind]) for kind in kinds])
    x[[i for i, kind in enumerate(kinds) if kind == "zero"]] = 0.0
    huge = [i for i, kind in enumerate(kinds) if kind == "1e30"]
    x[huge] = x[huge].abs()
    x = x[None].float()  # [1, T, r]
    band = torch.arange(width) * 3 // width  # 0, 1, 2 across the columns
    b_exponents = torch.stack([torch.full((rank,), e) for e in (-20.0, 0.0, 12.0)])[band]
    jitter = torch.randint(-3, 3, (2, width, rank), generator=gen)
    b = _at_scale(gen, (2, width, rank), b_exponents + jitter).to(torch.float16)  # [2, 48, r]
    old = _at_scale(gen, (T, width), torch.randint(-14, -9, (T, width), generator=gen))
    old = old.to(torch.float16)  # [T, 48]
    slots = torch.tensor([0] * 16 + [1] * 16)
    return x, b, old, slots, kinds


def _check_extremes(rank, wide_warp, monkeypatch) -> tuple:
    """The rows of :func:`_extreme_problem` by the op: where the result is inside fp16's
    range (its magnitude at most 2**15) within the suite's tolerance; where it is far
    past it, the infinity of the reference's sign; never NaN; the zero rows the old
    output, bit for bit. The build's arguments, for the caller's checks."""
    config = _config(rank, wide_warp, monkeypatch)
    x, b, old, slots, kinds = _extreme_problem(rank, seed=rank + 7)
    got, args = _expand(x, b, old, slots, config, monkeypatch)
    want, magnitude = _reference(x, b, old, slots)
    assert not bool(torch.isnan(got).any()), f"NaN in rows {torch.isnan(got).any(1).nonzero()}"
    inside = magnitude <= 2**15
    normal = inside & (magnitude >= 2**-14)
    assert_close(got[normal], want[normal], magnitude[normal], rank, "expand f16 extremes")
    small = inside & ~normal
    assert_close(got[small], want[small], magnitude[small], rank, "expand f16 extremes, small")
    far_past = (want.abs() >= 2**17) & (want.abs() >= magnitude / 64)
    assert torch.equal(got[far_past].double(), torch.sign(want[far_past]) * float("inf"))
    zero = torch.tensor([kind == "zero" for kind in kinds])
    assert torch.equal(got[zero].view(torch.int16), old[zero].view(torch.int16))
    # what the data reached: most outputs of the 1e30 rows far past fp16's range, outputs
    # inside it (larger than the old ones) from the large and tiny rows (through B's small
    # and large bands) and from the spike's
    for row, kind in enumerate(kinds):
        if kind == "1e30":
            assert int(far_past[row].sum()) >= len(far_past[row]) // 2, row
        elif kind in ("large", "tiny", "spike"):
            assert int((normal[row] & (want[row].abs() > 2**-8)).sum()) >= 8, (kind, row)
    return args


#: (rank, the 64-column warp): one chunk (16, 64 read first), chunks (100, 128).
EXTREMES = [(16, False), (64, False), (64, True), (100, False), (128, False)]


@pytest.mark.parametrize(
    "rank, wide_warp", EXTREMES, ids=[f"r{r}{'-64-columns' if w else ''}" for r, w in EXTREMES]
)
def test_rows_at_the_ends_of_fp32_s_range(rank, wide_warp, monkeypatch):
    """Rows of ~1e30, 2**20 .. 2**25, 2**-24 .. 2**-19, ~1e-30, mixed, a spike and
    zeros (see ``_check_extremes``) at each form of reading the buffer."""
    args = _check_extremes(rank, wide_warp, monkeypatch)
    assert (args[K_STEPS] > expand_mma.CHUNK_STEPS) == (rank > 64)
    assert _reads_the_buffer_first(args) == (args[N_TILES] == 8 and rank == 64)


# 3. Infinities and NaN -------------------------------------------------------------------


@pytest.mark.parametrize("rank", [32, 128])
def test_rows_holding_an_infinity_or_a_nan(rank, monkeypatch):
    """A row holding +inf (its other values ordinary) gives the reference's outputs: an
    infinity of the sign of B at the infinity, NaN where B is zero there; a row holding
    -inf and a row holding NaN likewise (all NaN for NaN); the other rows of the tile,
    whose scales are their own, meet the suite's tolerance."""
    gen = torch.Generator().manual_seed(rank)
    T, width = 16, 32
    x = torch.randn(1, T, rank, generator=gen)
    x[0, 3, 5], x[0, 8, rank - 1], x[0, 12, 70 % rank] = float("inf"), -float("inf"), float("nan")
    b = torch.randn(1, width, rank, generator=gen)
    b[0, ::5, 5] = 0.0  # (inf * 0: NaN in the reference)
    b = b.to(torch.float16)
    old = torch.randn(T, width, generator=gen).to(torch.float16)
    slots = torch.zeros(T, dtype=torch.int64)
    got, _ = _expand(x, b, old, slots, _config(rank, False, monkeypatch), monkeypatch)
    want, magnitude = _reference(x, b, old, slots)
    special = torch.zeros(T, dtype=torch.bool)
    special[[3, 8, 12]] = True
    assert torch.equal(torch.isnan(got[special]), torch.isnan(want[special]))
    finite_in_want = ~torch.isnan(want[special])
    assert torch.equal(got[special][finite_in_want].double(), want[special][finite_in_want])
    assert bool(torch.isnan(want[3]).any()) and bool(torch.isinf(want[3]).any())  # (both met)
    assert_close(got[~special], want[~special], magnitude[~special], rank, "expand f16 products")


# 4. The scaling's device functions ----------------------------------------------------


def _scale_kernel():
    @cuda.jit
    def scales(values, scale, inverse, hi, lo):
        # values: [2N] fp32, rows of two; scale, inverse: [N] fp32; hi, lo: [N] int64
        i = cuda.grid(1)
        if 2 * i + 1 < values.shape[0]:
            v0, v1 = values[2 * i], values[2 * i + 1]
            scale[i], inverse[i] = f16_row_scale(max(abs_bits(v0), abs_bits(v1)))
            hi[i], lo[i] = split_to_f16(v0 * scale[i], v1 * scale[i])

    return scales


def _f16_halves(pairs: torch.Tensor) -> torch.Tensor:
    """uint32 pairs of fp16 (as int64) -> their values as float64, in order."""
    bits = torch.stack([pairs & 0xFFFF, (pairs >> 16) & 0xFFFF], dim=1).flatten()
    return bits.to(torch.int16).view(torch.float16).double()


def test_row_scales_and_the_split_at_the_edges_of_fp32():
    """Rows of two values. ``f16_row_scale`` of a row's largest magnitude: ``scale *
    largest`` in [2**14, 2**15) and ``scale * inverse == 1``, both normal, from fp32's
    smallest subnormal (there 2**126 only) to its largest finite value; 1 for zero,
    infinities and NaN. ``split_to_f16`` of the scaled values: ``hi`` rounded to fp16,
    ``hi + lo`` within ``2**-22`` of the value (``2**-25`` below 2**-3), an infinity as
    ``(inf, 0)``."""
    gen = torch.Generator().manual_seed(5)
    exponents = torch.randint(-140, 127, (96,), generator=gen)
    spread = torch.randn(96, generator=gen).double() * 2.0**exponents
    edges = [2.0**-149, 2.0**-126, 2.0**-113, 2.0**-112, 3.4028235e38, 65504.0, 2.0**14]
    edges += [2.0**15, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), -1.5]
    rows = torch.tensor([[e, e / 3] for e in edges]).flatten()  # (each edge the largest)
    values = torch.cat([spread.float(), rows.float()])  # [124]: 62 rows of two
    rows_of_two = values.numel() // 2
    scale, inverse = (
        torch.zeros(rows_of_two, device=DEVICE),
        torch.zeros(rows_of_two, device=DEVICE),
    )
    hi = torch.zeros(rows_of_two, dtype=torch.int64, device=DEVICE)
    lo = torch.zeros_like(hi)
    arguments = [kernel_array(t) for t in (values.to(DEVICE), scale, inverse, hi, lo)]
    _scale_kernel()[1, 64, launch_stream()](*arguments)
    scale, inverse = scale.cpu().double(), inverse.cpu().double()
    largest = values.double().view(-1, 2).abs().max(dim=1).values  # (NaN where one is)
    finite = torch.isfinite(largest) & (largest != 0)
    scaled = largest * scale
    assert bool(((scaled[finite] >= 2**14) | (largest[finite] < 2.0**-112)).all())
    assert bool((scaled[finite] < 2**15).all())
    assert bool((scale * inverse == 1).all())
    smallest_normal = torch.finfo(torch.float32).tiny
    assert bool(((scale >= smallest_normal) & (inverse >= smallest_normal)).all())
    assert bool(((scale <= 2.0**126) & (inverse <= 2.0**126)).all())
    assert bool((scale[~finite] == 1).all()) and int((~finite).sum()) == 5
    want = (values.double().view(-1, 2) * scale[:, None]).flatten()  # the scaled values
    hi, lo = _f16_halves(hi.cpu()), _f16_halves(lo.cpu())
    fits = torch.isfinite(want) & (want.abs() < 2**15)
    assert torch.equal(hi[fits], want[fits].to(torch.float16).double())  # hi: rounded
    err = (hi + lo - want)[fits].abs()
    assert bool((err <= torch.clamp(2.0**-22 * want[fits].abs(), min=2.0**-25)).all())
    assert bool((lo[fits] != 0).any())  # lo carries bits hi dropped
    infinite = torch.isinf(hi)
    assert int(infinite.sum()) == 4 and bool((lo[infinite] == 0).all())  # (+-inf, +-inf / 3)


# 5. The checks reject deliberately wrong kernels -------------------------------------


@cuda.jit(device=True)
def _unscaled(largest_bits):
    """A wrong :func:`.mma.f16_row_scale`: every row scaled by 1."""
    return float32(1.0), float32(1.0)


@cuda.jit(device=True)
def _own_lane_only(value, scratch):
    """A wrong :func:`.mma.largest_of_lane_group`: each lane's largest, not its row's."""
    return value


@cuda.jit(device=True)
def _without_lo(v0, v1):
    """A wrong :func:`.mma.split_to_f16`: ``hi`` alone, 11 bits of each value."""
    return f16_pair(v0, v1), uint32(0)


def _built_with(monkeypatch, name: str, wrong) -> None:
    """The expand's builds made, for this test only, with ``wrong`` as the device function
    ``name`` of :mod:`.kernels.expand_mma` (a fresh build, so that a GPU compiles it in)."""
    build_mma_expand_kernel.cache_clear()
    monkeypatch.setattr(expand_mma, name, wrong)


@pytest.fixture
def fresh_builds():
    """No build made with a wrong device function outlives the test."""
    yield
    build_mma_expand_kernel.cache_clear()


@pytest.mark.parametrize(
    "name, wrong, check",
    [
        ("f16_row_scale", _unscaled, functools.partial(_check_extremes, 64, False)),
        ("f16_row_scale", _unscaled, functools.partial(_check_extremes, 128, False)),
        ("largest_of_lane_group", _own_lane_only, functools.partial(_check_extremes, 16, False)),
        ("split_to_f16", _without_lo, functools.partial(_check_ordinary, 64, torch.float32, False)),
        (
            "split_to_f16",
            _without_lo,
            functools.partial(_check_ordinary, 128, torch.float32, False),
        ),
    ],
    ids=["unscaled-r64", "unscaled-r128", "own-lane-r16", "without-lo-r64", "without-lo-r128"],
)
def test_the_checks_reject_wrong_kernels(name, wrong, check, monkeypatch, fresh_builds):
    """Without the rows' scales the rows past fp16's range overflow (NaN); with each
    lane's own largest as its scale a row's products are summed at several scales; without
    ``lo`` the outputs that cancel err by 2**-12 of their terms: the checks above fail on
    each."""
    _built_with(monkeypatch, name, wrong)
    with pytest.raises(AssertionError):
        check(monkeypatch)
