"""Drawn shrink and expand problems, and the one check each op must pass.

``check_shrink(impl, case)`` and ``check_expand(impl, case)`` run an implementation
with vLLM's op signature on a drawn case and compare it with the float64 reference:
within :mod:`tests.tolerance` where the op writes, bit for bit where it must not.
The property tests pass the library's ops; the mutation tests pass deliberately
wrong kernels and expect these checks to fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from punica_numba import reference
from punica_numba.meta import LoRAKernelMeta

from .strategies import DEVICE, DTYPES, KERNEL_LIMITS, random_tensor, slot_lists
from .tolerance import assert_close

#: The six metadata arguments of lora_shrink / lora_expand, as ``meta_args`` returns them.
META_ARG_NAMES = (
    "token_lora_mapping",
    "token_indices_sorted_by_lora_ids",
    "num_tokens_per_lora",
    "lora_token_start_loc",
    "lora_ids",
    "no_lora_flag_cpu",
)


def meta_kwargs(meta: LoRAKernelMeta, num_tokens: int) -> dict:
    """``meta.meta_args(num_tokens)`` as keyword arguments of the ops."""
    return dict(zip(META_ARG_NAMES, meta.meta_args(num_tokens)))


@dataclass
class Problem:
    """A prepared problem: slots (padded rows are -1), metadata, and seeds for the data."""

    slots: list[int]  # [T] including padded rows (-1)
    prepared: int  # tokens given to prepare_tensors; rows past it are CUDA-graph padding
    num_loras: int
    seed: int

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    def meta(self) -> LoRAKernelMeta:
        meta = LoRAKernelMeta.make(self.num_loras, self.num_tokens + 2, DEVICE)
        meta.prepare_tensors(torch.tensor(self.slots[: self.prepared], dtype=torch.int64))
        return meta

    def slot_tensor(self) -> torch.Tensor:
        return torch.tensor(self.slots, dtype=torch.int64, device=DEVICE)


@st.composite
def problems(draw, limits=KERNEL_LIMITS) -> Problem:
    """Dims first (tokens, slots, graph padding), then the assignment mode, then values."""
    num_tokens = draw(st.integers(0, limits.tokens), label="T")
    num_loras = draw(st.integers(1, limits.loras), label="L")
    padding = draw(st.integers(0, min(2, num_tokens)), label="padded rows")
    prepared = num_tokens - padding
    slots = draw(slot_lists(prepared, num_loras)) + [-1] * padding
    seed = draw(st.integers(0, 2**31 - 1), label="data seed")
    return Problem(slots, prepared, num_loras, seed)


def record_mma_expand_builds(monkeypatch, change=None) -> list[tuple]:
    """Have the ops build their tensor-core expands through a recorder, for this test: each
    build's positional arguments (first passed through ``change``, which may turn a flag
    off) go into the list returned, with the kernel built from them: ``(args, kernel)``."""
    from punica_numba.ops import choice

    build = choice.build_mma_expand_kernel
    built = []

    def build_recorded(*args):
        if change is not None:
            args = change(args)
        built.append((args, build(*args)))
        return built[-1][1]

    monkeypatch.setattr(choice, "build_mma_expand_kernel", build_recorded)
    return built


def rows_at_8_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (16-bit elements) whose storage starts 8 bytes past a multiple of 16
    (rows of a multiple of 16 bytes then all start there: the kernels' 8-byte loads)."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    skip = (8 - flat.data_ptr() % 16) % 16 // t.element_size()
    return flat[skip : skip + t.numel()].view(t.shape).copy_(t)


def _stack(weight: torch.Tensor, four_d: bool) -> torch.Tensor:
    return weight.unsqueeze(1) if four_d else weight  # [L, N, K] -> [L, 1, N, K]


@dataclass
class ShrinkCase:
    problem: Problem
    hidden: int
    rank: int
    num_slices: int
    extra_slices: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    scaling: float
    four_d: bool


@st.composite
def shrink_cases(draw, limits=KERNEL_LIMITS) -> ShrinkCase:
    problem = draw(problems(limits))
    return ShrinkCase(
        problem=problem,
        hidden=draw(st.integers(1, limits.hidden), label="H"),
        rank=draw(st.integers(1, limits.rank), label="r"),
        num_slices=draw(st.integers(1, 3), label="S"),
        extra_slices=draw(st.integers(0, 1), label="extra buffer slices"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        out_dtype=draw(
            st.sampled_from((torch.float32, torch.float32, torch.float16, torch.bfloat16)),
            label="buffer dtype",
        ),
        scaling=draw(st.sampled_from((1.0, 0.5, -0.25, 2.0)), label="scaling"),
        four_d=draw(st.booleans(), label="4-D weights"),
    )


def check_shrink(impl, case: ShrinkCase, stores: bool = False) -> float:
    """Run ``impl`` (lora_shrink's signature) on the case; return the relative error. With
    ``stores``, ``impl`` stores its products instead of adding them (``accumulate=False``):
    where a token has a LoRA the buffer holds the reference's products alone."""
    p, seed = case.problem, case.problem.seed
    T, H, r, L, S = p.num_tokens, case.hidden, case.rank, p.num_loras, case.num_slices
    x = random_tensor((T, H), case.dtype, seed)  # [T, H]
    weights = [
        _stack(random_tensor((L, r, H), case.dtype, seed + 1 + s), case.four_d) for s in range(S)
    ]  # S x [L, r, H]
    out = random_tensor((S + case.extra_slices, T, r), case.out_dtype, seed + 9)  # [S', T, r]
    before = out.clone()
    meta = p.meta()

    impl(x, weights, out, *meta.meta_args(T), case.scaling)

    slots = p.slot_tensor()
    base = torch.zeros_like(before) if stores else before
    want = reference.lora_shrink(x, weights, base, slots, case.scaling)
    magnitude = reference.lora_shrink(
        x.abs(), [w.abs() for w in weights], base.abs(), slots, abs(case.scaling)
    )
    untouched = slots == -1
    assert torch.equal(out[:, untouched], before[:, untouched]), "rows without a LoRA changed"
    assert torch.equal(out[S:], before[S:]), "buffer slices past the weights changed"
    if stores:  # (the rows above are as they were, not the reference's zeros)
        used = ~untouched
        out, want, magnitude = out[:S, used], want[:S, used], magnitude[:S, used]
    return assert_close(out, want, magnitude, terms=H, what=f"shrink {case.dtype}")


@dataclass
class ExpandCase:
    problem: Problem
    rank: int
    widths: list[int]
    offset_start: int
    extra_columns: int
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    out_dtype: torch.dtype
    add_inputs: bool
    four_d: bool
    strided_input: bool


def serving_expand_case(
    problem: Problem,
    rank: int,
    widths: list[int],
    offset_start: int = 0,
    extra_columns: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> ExpandCase:
    """An expand as a served layer makes it: the fp32 shrink buffer in, weights and output
    of ``dtype`` (bf16 unless given), added to the output, 3-D weights, a contiguous
    buffer."""
    return ExpandCase(
        problem,
        rank,
        widths,
        offset_start,
        extra_columns,
        torch.float32,
        dtype,
        dtype,
        add_inputs=True,
        four_d=False,
        strided_input=False,
    )


@st.composite
def expand_cases(draw, limits=KERNEL_LIMITS, tensor_cores: bool = False) -> ExpandCase:
    """Any expand the op takes; with ``tensor_cores``, only those the tensor-core expand
    takes (``ops.operands.mma_expand_operands``: bf16 or fp16 B with an output of its
    dtype, an even rank, slices of whole 4-column words), which a free draw rarely makes."""
    problem = draw(problems(limits))
    word = 4 if tensor_cores else 1  # columns
    rank = draw(st.integers(1, limits.rank // (1 + tensor_cores)), label="r") * (1 + tensor_cores)
    num_slices = draw(st.integers(1, 3), label="S")
    widths = [
        draw(st.integers(1, limits.width // word), label=f"N_{s}") * word for s in range(num_slices)
    ]
    w_dtypes = (torch.bfloat16, torch.float16) if tensor_cores else DTYPES
    w_dtype = draw(st.sampled_from(w_dtypes), label="weight dtype")
    out_dtypes = (w_dtype,) if tensor_cores else (w_dtype, w_dtype, torch.float32)
    return ExpandCase(
        problem=problem,
        rank=rank,
        widths=widths,
        offset_start=draw(st.integers(0, 5 // word), label="offset_start") * word,
        extra_columns=draw(st.integers(0, 3), label="columns past the slices") * word,
        x_dtype=draw(st.sampled_from((w_dtype, torch.float32)), label="input dtype"),
        w_dtype=w_dtype,
        out_dtype=draw(st.sampled_from(out_dtypes), label="out dtype"),
        add_inputs=draw(st.booleans(), label="add_inputs"),
        four_d=draw(st.booleans(), label="4-D weights"),
        strided_input=draw(st.booleans(), label="strided input"),
    )


def check_expand(impl, case: ExpandCase) -> float:
    """Run ``impl`` (lora_expand's signature) on the case; return the relative error."""
    p, seed = case.problem, case.problem.seed
    T, r, L, S = p.num_tokens, case.rank, p.num_loras, len(case.widths)
    if case.strided_input:  # a view with gaps between rows: expand takes any strides
        x = random_tensor((S, T, r + 3), case.x_dtype, seed)[:, :, 1 : r + 1]
    else:
        x = random_tensor((S, T, r), case.x_dtype, seed)  # [S, T, r]
    weights = [
        _stack(random_tensor((L, n, r), case.w_dtype, seed + 1 + s), case.four_d)
        for s, n in enumerate(case.widths)
    ]  # [L, N_s, r]
    width = case.offset_start + sum(case.widths) + case.extra_columns
    out = random_tensor((T, width), case.out_dtype, seed + 9)  # [T, W]
    before = out.clone()
    meta = p.meta()

    impl(
        x,
        weights,
        out,
        *meta.meta_args(T),
        offset_start=case.offset_start,
        add_inputs=case.add_inputs,
    )

    slots = p.slot_tensor()
    want = reference.lora_expand(x, weights, before, slots, case.offset_start, case.add_inputs)
    magnitude = reference.lora_expand(
        x.abs(),
        [w.abs() for w in weights],
        before.abs(),
        slots,
        case.offset_start,
        case.add_inputs,
    )
    untouched = slots == -1
    assert torch.equal(out[untouched], before[untouched]), "rows without a LoRA changed"
    first, last = case.offset_start, case.offset_start + sum(case.widths)
    assert torch.equal(out[:, :first], before[:, :first]), "columns before the slices changed"
    assert torch.equal(out[:, last:], before[:, last:]), "columns past the slices changed"
    return assert_close(
        out, want, magnitude, terms=r, what=f"expand {case.x_dtype}->{case.out_dtype}"
    )
