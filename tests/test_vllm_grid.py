"""vLLM's own op-test grid (SPEC §6.1) run on our ops: all of it on a GPU, a seeded sample here.

vLLM checks its shrink and expand kernels on two grids, and ours must pass at least as
much:

* the kernel grid: hidden size 2049 x {1, 4, 16, 32} sequences x {1, 8, 32, 128} LoRAs x
  ranks {1, 4, ..., 256} x {1, 2, 3} slices x fp16 / bf16;
* the hidden-size grid: rank 32, 4 LoRAs, 4 sequences, over the hidden sizes of real
  models and their tensor-parallel shards (257 distinct sizes, from 2 to 152064); for
  expand the hidden size is the output width of each slice.

Each is run for shrink (scaling 0.5) and for expand with ``add_inputs`` False and True.
A sequence has a random length of up to 128 tokens (on about half the cases every
sequence is exactly 128 long, as vLLM's data are) and sits on a random slot. vLLM never
has tokens without a LoRA; we do: on about half the GPU cases, and on every simulator
case, some sequences (and a padded row past the prepared tokens) have none.

Every case goes through :func:`tests.op_cases.check_shrink` / ``check_expand``: the
float64 reference within :mod:`tests.tolerance`, rows without a LoRA unchanged bit for
bit. The op is called in vLLM v0.9's six-value metadata form, and (all of them on the
GPU, every other one here) again in vLLM 0.33's seven-value form, which must give the
same bits.

On the GPU (``gpu`` marker) one test per (grid, op, dtype) loops over its cases and names
each one that fails. On the simulator, where each CUDA thread is a Python thread, a
seeded sample of the grid is run with its work cut down (:func:`simulator_cases`).
"""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from punica_numba import lora_expand, lora_shrink

from . import tolerance
from .op_cases import ExpandCase, Problem, ShrinkCase, check_expand, check_shrink

# -- the grid, as vLLM states it ------------------------------------------------------------

#: The hidden sizes of the models vLLM's hidden-size grid lists (74 of them).
MODEL_HIDDEN_SIZES = (
    128, 256, 512, 896, 1024, 1152, 1216, 1280, 1536, 1664, 2048, 2240, 2304, 2368, 2432,
    2560, 2752, 3072, 3328, 3456, 3584, 3712, 4096, 4480, 4608, 4736, 4864, 5120, 5504,
    5632, 5888, 6144, 6400, 6848, 6912, 7168, 7424, 8192, 8960, 9216, 9472, 10240, 11008,
    11264, 13824, 14336, 14784, 14848, 15360, 18944, 22016, 22528, 24576, 27392, 27648,
    29568, 29696, 32000, 32256, 32512, 32768, 33024, 36864, 43264, 49152, 49408, 60544,
    60672, 64000, 64256, 102400, 102656, 128000, 128256,
)  # fmt: skip
#: A model's size is also tried shard by shard, for these tensor-parallel sizes.
TP_SIZES = (2, 4, 8, 16, 32, 64)
#: Tried whole only (a 152k-wide output: a vocabulary-sized slice).
UNSHARDED_SIZE = 152064


def grid_hidden_sizes() -> list[int]:
    """Every model size, each whole and divided by each TP size that divides it, and
    152064; sorted, without repeats."""
    sizes = {UNSHARDED_SIZE, *MODEL_HIDDEN_SIZES}
    sizes |= {h // tp for h in MODEL_HIDDEN_SIZES for tp in TP_SIZES if h % tp == 0}
    return sorted(sizes)


KERNEL_HIDDEN = 2049  # one past a power of two: every tile of H has a ragged end
SEQUENCES = (1, 4, 16, 32)  # vLLM's "batches": sequences per step
LORAS = (1, 8, 32, 128)
RANKS = (1, 4, 8, 16, 32, 64, 128, 256)
SLICES = (1, 2, 3)
GRID_DTYPES = (torch.float16, torch.bfloat16)
HIDDEN_GRID = dict(sequences=4, num_loras=4, rank=32)  # the hidden-size grid's fixed dims
MAX_SEQUENCE_LENGTH = 128
SCALING = 0.5  # vLLM's shrink scaling in these tests
#: ``op`` of a case: shrink, or expand with ``add_inputs`` False / True.
OPS = ("shrink", "expand", "expand add")

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


# -- one case of the grid ------------------------------------------------------------------


@dataclass(frozen=True)
class GridCase:
    """One point of the grid, with how its tokens are laid out.

    ``forms`` lists the ``specialize_active_lora`` values with which the op is also run
    in the seven-value form (empty: the six-value form only).
    """

    grid: str  # "kernels" or "hidden sizes"
    op: str  # one of OPS
    dtype: torch.dtype
    hidden: int  # H of shrink; for expand, N, the output width of every slice
    sequences: int
    num_loras: int
    rank: int
    num_slices: int
    max_length: int = MAX_SEQUENCE_LENGTH  # tokens of a sequence: 1 .. max_length
    full_length: bool = False  # every sequence exactly max_length long (vLLM's own data)
    unmapped: bool = False  # some sequences, and one padded row, have no LoRA
    forms: tuple[bool, ...] = (False, True)

    @property
    def point(self) -> str:
        """The grid point: op, dtype and dims (the same on the GPU and in a sample)."""
        return (
            f"{self.op} {_DTYPE_NAMES[self.dtype]} H={self.hidden} seqs={self.sequences} "
            f"L={self.num_loras} r={self.rank} S={self.num_slices}"
        )

    @property
    def seed(self) -> int:
        layout = f"{self.max_length}/{self.full_length}/{self.unmapped}"
        return zlib.crc32(f"{self.point} {layout}".encode())

    def problem(self) -> Problem:
        """Sequences of random length, each on a random slot (or none, when ``unmapped``):
        the token slots and a seed for the values, both from the case's own seed."""
        rng = np.random.default_rng(self.seed)
        n = self.sequences
        lengths = (
            np.full(n, self.max_length)
            if self.full_length
            else rng.integers(1, self.max_length + 1, n)
        )
        slots = rng.integers(0, self.num_loras, n)  # vLLM: a random LoRA per sequence
        if self.unmapped and n > 1:  # about a quarter of them without one, at least one
            none = rng.random(n) < 0.25
            none[rng.integers(n)] = True
            if none.all():
                none[rng.integers(n)] = False
            slots[none] = -1
        token_slots = [int(s) for s, k in zip(slots, lengths) for _ in range(k)]
        padding = 1 if self.unmapped else 0  # a CUDA-graph padded row: in no segment
        return Problem(token_slots + [-1] * padding, len(token_slots), self.num_loras, self.seed)

    @property
    def name(self) -> str:
        """What a failure prints: the point, the token count, and the layout."""
        p = self.problem()
        unmapped = sum(s == -1 for s in p.slots)
        return f"{self.point} T={p.num_tokens} (tokens without a LoRA: {unmapped})"


def same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Assert ``got`` has exactly the bits of ``want`` (the six-value form's result): the
    same integers under the floats, so -0.0 differs from 0.0 and a NaN is compared too."""
    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    got_bits, want_bits = (t.view(as_int[t.element_size()]) for t in (got, want))
    if got.dtype == want.dtype and torch.equal(got_bits, want_bits):
        return
    differ = torch.nonzero(got_bits != want_bits)
    index = tuple(int(i) for i in differ[0].tolist())
    raise AssertionError(
        f"{what}: {differ.shape[0]} element(s) differ from the six-value form's; first at "
        f"{index}: got {got[index].item()!r}, want {want[index].item()!r}"
    )


def num_active_loras(problem: Problem, specialize: bool) -> torch.Tensor:
    """The seventh value ``meta_args(T, specialize)`` gives for the problem's mapping (from
    a metadata of its own, prepared with the same mapping)."""
    return problem.meta().meta_args(problem.num_tokens, specialize)[6]


def shrink_in_forms(problem: Problem, forms: tuple[bool, ...]):
    """An impl for ``check_shrink``: our shrink in the six-value form, then in the
    seven-value form for each ``specialize_active_lora`` in ``forms`` (on the same
    inputs, a fresh copy of the buffer), which must give the same bits."""
    extra = [(s, num_active_loras(problem, s)) for s in forms]

    def shrink(inputs, weights, out, *meta_and_scaling):
        meta, scaling = meta_and_scaling[:6], meta_and_scaling[6:]
        before = out.clone()
        lora_shrink(inputs, weights, out, *meta_and_scaling)
        for specialize, num_active in extra:
            again = before.clone()
            lora_shrink(inputs, weights, again, *meta, num_active, *scaling)
            same_bits(again, out, f"seven-value shrink, specialize_active_lora={specialize}")

    return shrink


def expand_in_forms(problem: Problem, forms: tuple[bool, ...]):
    """The same for ``check_expand`` (which passes offset_start and add_inputs by name)."""
    extra = [(s, num_active_loras(problem, s)) for s in forms]

    def expand(inputs, weights, out, *meta, **options):
        before = out.clone()
        lora_expand(inputs, weights, out, *meta, **options)
        for specialize, num_active in extra:
            again = before.clone()
            lora_expand(inputs, weights, again, *meta, num_active, **options)
            same_bits(again, out, f"seven-value expand, specialize_active_lora={specialize}")

    return expand


def op_case(case: GridCase, problem: Problem) -> ShrinkCase | ExpandCase:
    """The case as :mod:`tests.op_cases` describes it: vLLM's dtypes (an fp32 shrink
    buffer; expand's input in the test dtype, never fp32), 3-D weights, offset 0."""
    if case.op == "shrink":
        return ShrinkCase(
            problem=problem,
            hidden=case.hidden,
            rank=case.rank,
            num_slices=case.num_slices,
            extra_slices=0,
            dtype=case.dtype,
            out_dtype=torch.float32,
            scaling=SCALING,
            four_d=False,
        )
    return ExpandCase(
        problem=problem,
        rank=case.rank,
        widths=[case.hidden] * case.num_slices,
        offset_start=0,
        extra_columns=0,
        x_dtype=case.dtype,
        w_dtype=case.dtype,
        out_dtype=case.dtype,
        add_inputs=case.op == "expand add",
        four_d=False,
        strided_input=False,
    )


def run_case(case: GridCase, shrink_impl=None, expand_impl=None) -> float:
    """Check one case (our ops, every form, unless an impl is given); return its error."""
    problem = case.problem()
    if case.op == "shrink":
        impl = shrink_impl or shrink_in_forms(problem, case.forms)
        return check_shrink(impl, op_case(case, problem))
    impl = expand_impl or expand_in_forms(problem, case.forms)
    return check_expand(impl, op_case(case, problem))


# -- the whole grid (GPU) ------------------------------------------------------------------


def kernel_grid(op: str, dtype: torch.dtype) -> list[GridCase]:
    """vLLM's kernel grid for one op and dtype: 4 x 4 x 8 x 3 = 384 cases."""
    cases = []
    for sequences, num_loras, rank, num_slices in itertools.product(
        SEQUENCES, LORAS, RANKS, SLICES
    ):
        cases.append(
            GridCase("kernels", op, dtype, KERNEL_HIDDEN, sequences, num_loras, rank, num_slices)
        )
    return [_layout(c) for c in cases]


def hidden_size_grid(op: str, dtype: torch.dtype) -> list[GridCase]:
    """vLLM's hidden-size grid for one op and dtype: 257 sizes x 3 slice counts."""
    return [
        _layout(GridCase("hidden sizes", op, dtype, hidden, num_slices=s, **HIDDEN_GRID))
        for hidden in grid_hidden_sizes()
        for s in SLICES
    ]


def _layout(case: GridCase) -> GridCase:
    """Half the cases with vLLM's full-length sequences, half with tokens without a LoRA
    (chosen from the case's point, so the same every run)."""
    choice = zlib.crc32(case.point.encode()) % 4
    return replace(case, full_length=choice % 2 == 0, unmapped=choice >= 2)


GRIDS = {"kernels": kernel_grid, "hidden sizes": hidden_size_grid}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=_DTYPE_NAMES.get)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("grid", GRIDS)
def test_vllm_grid_on_gpu(grid, op, dtype):
    cases = GRIDS[grid](op, dtype)
    failures = []
    for case in cases:
        try:
            run_case(case)
        except Exception as error:  # every case runs; the failures are named below
            failures.append(f"{case.name}: {type(error).__name__}: {error}")
    if failures:
        shown = "\n".join(failures[:12])
        more = f"\n... and {len(failures) - 12} more" if len(failures) > 12 else ""
        pytest.fail(f"{len(failures)} of {len(cases)} {grid} cases failed:\n{shown}{more}")


def test_grid_is_vllms():
    """The grid has the size its lists give it (so a typo in a list shows here): 74 model
    sizes, 257 with their shards and 152064 (SPEC §6.1 counts 228, dividing by 2, 8, 16
    and 64 only; these shards by 4 and 32 too, and 152064, are a superset)."""
    sizes = grid_hidden_sizes()
    assert len(MODEL_HIDDEN_SIZES) == len(set(MODEL_HIDDEN_SIZES)) == 74
    assert (sizes[0], sizes[-1], len(sizes)) == (2, UNSHARDED_SIZE, 257)
    assert {128 // 64, 6848 // 64, 128256 // 64, 14784 // 32} <= set(sizes)  # 2, 107, 2004, 462
    assert 152064 // 2 not in sizes  # 152064 is tried whole only
    kernels = kernel_grid("shrink", torch.float16)
    assert len(kernels) == 384 and len({c.point for c in kernels}) == 384
    layouts = {(c.full_length, c.unmapped) for c in kernels}
    assert layouts == {(a, b) for a in (False, True) for b in (False, True)}
    every = [c for op in OPS for d in GRID_DTYPES for g in GRIDS.values() for c in g(op, d)]
    assert len(every) == len(OPS) * len(GRID_DTYPES) * (384 + 3 * 257)


# -- a sample of it, cut down for the simulator --------------------------------------------

#: On the simulator 2049 becomes 2**4 + 1 (still a tile plus one), ...
SIMULATOR_KERNEL_HIDDEN = 17
#: ... the hidden-size grid keeps its own sizes up to this, ...
SIMULATOR_MAX_HIDDEN = 64
#: ... and a case keeps at most 3 sequences of at most 2 tokens, fewer where its work
#: would exceed SIMULATOR_WORK: the work of a shrink on the simulator, tokens x ceil(r / 4)
#: blocks of 16 threads, each walking H / 16 elements, per slice, in units of
#: tokens x ceil(r / 4) x H x S (about 2 s of the simulator at the budget).
SIMULATOR_SEQUENCES, SIMULATOR_MAX_LENGTH = 3, 2
SIMULATOR_WORK = 2400
SIMULATOR_KERNEL_CASES, SIMULATOR_HIDDEN_CASES = 6, 4
SIMULATOR_SEED = 2049


def _simulator_work(case: GridCase) -> int:
    tokens = case.sequences * case.max_length
    return tokens * -(-case.rank // 4) * case.hidden * case.num_slices


def _cut_down(case: GridCase) -> GridCase | None:
    """The case with at most 3 sequences of at most 2 tokens, then shorter sequences and
    fewer of them until its work fits; None if even one token does not fit."""
    case = replace(
        case,
        sequences=min(case.sequences, SIMULATOR_SEQUENCES),
        max_length=SIMULATOR_MAX_LENGTH,
    )
    while _simulator_work(case) > SIMULATOR_WORK:
        if case.max_length > 1:
            case = replace(case, max_length=case.max_length - 1)
        elif case.sequences > 1:
            case = replace(case, sequences=case.sequences - 1)
        else:
            return None
    return case


def simulator_cases() -> list[GridCase]:
    """A seeded sample of the grid, each point cut down for the simulator: each op and
    dtype in turn, the other dims drawn from the grid's lists; H = 2049 becomes 17, the
    hidden-size grid keeps its sizes up to 64; sequences and tokens as :func:`_cut_down`
    leaves them (a point whose one token would still be too much is drawn again); a
    sequence (when there are two) and a padded row without a LoRA. Every other case is
    also run in the seven-value form, alternating ``specialize_active_lora``."""
    rng = random.Random(SIMULATOR_SEED)
    small_sizes = [h for h in grid_hidden_sizes() if h <= SIMULATOR_MAX_HIDDEN]
    cases = []
    for i in range(SIMULATOR_KERNEL_CASES + SIMULATOR_HIDDEN_CASES):
        op, dtype = OPS[i % len(OPS)], GRID_DTYPES[i % 2]
        case = None
        while case is None:
            if i < SIMULATOR_KERNEL_CASES:
                dims = dict(
                    grid="kernels",
                    hidden=SIMULATOR_KERNEL_HIDDEN,
                    sequences=rng.choice(SEQUENCES),
                    num_loras=rng.choice(LORAS),
                    rank=rng.choice(RANKS),
                )
            else:
                dims = dict(grid="hidden sizes", hidden=rng.choice(small_sizes), **HIDDEN_GRID)
            drawn = GridCase(
                op=op,
                dtype=dtype,
                num_slices=rng.choice(SLICES),
                unmapped=True,
                forms=((False,), (), (True,), ())[i % 4],
                **dims,
            )
            case = _cut_down(drawn)
        cases.append(case)
    return cases


SIMULATOR_CASES = simulator_cases()


@pytest.mark.parametrize("case", SIMULATOR_CASES, ids=lambda c: c.point)
def test_vllm_grid_sample(case):
    run_case(case)


def test_sample_has_tokens_without_a_lora():
    """vLLM's grid never has a token without a LoRA; every case of our sample does, and
    the sample reaches every op, both dtypes, both grids and both seven-value forms."""
    for case in SIMULATOR_CASES:
        p = case.problem()
        assert -1 in p.slots and any(s >= 0 for s in p.slots), case.name
    assert {c.op for c in SIMULATOR_CASES} == set(OPS)
    assert {c.dtype for c in SIMULATOR_CASES} == set(GRID_DTYPES)
    assert {c.grid for c in SIMULATOR_CASES} == set(GRIDS)
    assert {f for c in SIMULATOR_CASES for f in c.forms} == {False, True}


# -- the check itself must fail on a wrong op ----------------------------------------------


def _drop_last_slice(op):
    def wrong(inputs, weights, out, *rest, **options):
        op(inputs, list(weights)[:-1], out, *rest, **options)

    return wrong


def _double_scaling(inputs, weights, out, *rest):
    lora_shrink(inputs, weights, out, *rest[:-1], 2 * rest[-1])


def _flip_add_inputs(inputs, weights, out, *meta, add_inputs, **options):
    lora_expand(inputs, weights, out, *meta, add_inputs=not add_inputs, **options)


#: A small grid point (3 slices) and a wrong op the grid check must reject.
WRONG_OPS = {
    "shrink scales twice": ("shrink", dict(shrink_impl=_double_scaling)),
    "shrink drops a slice": ("shrink", dict(shrink_impl=_drop_last_slice(lora_shrink))),
    "expand drops a slice": ("expand add", dict(expand_impl=_drop_last_slice(lora_expand))),
    "expand ignores add_inputs": ("expand add", dict(expand_impl=_flip_add_inputs)),
}


@pytest.mark.parametrize("bug", WRONG_OPS)
def test_grid_check_rejects(bug):
    op, impl = WRONG_OPS[bug]
    case = GridCase(
        "kernels", op, torch.bfloat16, 19, 3, 8, 4, 3, max_length=2, unmapped=True, forms=()
    )
    saved = dict(tolerance.LARGEST_ERRORS)
    try:
        with pytest.raises(AssertionError):
            run_case(case, **impl)
    finally:  # a wrong op's errors are not our kernels' (the report at the end)
        tolerance.LARGEST_ERRORS.clear()
        tolerance.LARGEST_ERRORS.update(saved)
