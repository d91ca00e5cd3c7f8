"""The tensor-core product (``kernels.mma``) against torch, on both machines.

On the GPU this checks that the fragment layout the kernels assume is the one the
hardware uses; on the simulator, that the emulation adds the same products. The
operands are small integers times powers of two, so every product and every sum is
exact in fp32: the result must equal the float64 product bit for bit, whatever the
order of the additions.

Then the splits that put fp32 and fp16 values on the bf16 tensor cores, and the fp16
pairs the tensor-core expand writes (``kernels.expand_mma``, "Precision").
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from numba import uint32

from punica_numba._cuda import SIMULATOR, cuda, device_of, kernel_array, launch_stream
from punica_numba.kernels.dtypes import f16_pair, f16_pair_values
from punica_numba.kernels.mma import (
    FRAGMENT_WORDS,
    largest_of_lane_group,
    mma_m16n8k16,
    pair_of,
    split_f16_pair,
    split_pair,
)

DTYPES = [torch.bfloat16, torch.float16]


@cuda.jit(device=True)
def _fragments(a, b, g, t):
    """Lane ``4 g + t``'s fragments a0..a3, b0, b1 of a [16, 16] tile ``a`` and a [16 (k),
    8 (n)] tile ``b`` (16-bit bits), in the layout of ``kernels.mma``."""
    return (
        pair_of(a[g, 2 * t], a[g, 2 * t + 1]),
        pair_of(a[g + 8, 2 * t], a[g + 8, 2 * t + 1]),
        pair_of(a[g, 8 + 2 * t], a[g, 9 + 2 * t]),
        pair_of(a[g + 8, 8 + 2 * t], a[g + 8, 9 + 2 * t]),
        pair_of(b[2 * t, g], b[2 * t + 1, g]),
        pair_of(b[8 + 2 * t, g], b[9 + 2 * t, g]),
    )


def _product_kernel(dtype):
    mma = mma_m16n8k16(dtype)

    @cuda.jit
    def product(a, b, c, d):
        # a: [16, 16], b: [16 (k), 8 (n)] as 16-bit bits; c, d: [16, 8] fp32; one warp
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((32, FRAGMENT_WORDS), uint32)
        a0, a1, a2, a3, b0, b1 = _fragments(a, b, g, t)
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = mma(
            a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t],
            c[g + 8, 2 * t + 1], scratch,
        )  # fmt: skip

    return product


def _exact_operand(shape, generator, dtype):
    """Integers in [-8, 8] times 2**e, e in [-3, 3]: exact in both 16-bit dtypes, and
    every sum of 16 of their products is exact in fp32."""
    ints = torch.randint(-8, 9, shape, generator=generator).to(torch.float64)
    scale = 2.0 ** torch.randint(-3, 4, shape, generator=generator).to(torch.float64)
    return (ints * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_product_tile_equals_torch_bit_for_bit(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    a = _exact_operand((16, 16), generator, dtype)
    b = _exact_operand((16, 8), generator, dtype)
    c = _exact_operand((16, 8), generator, torch.float32)
    want = (a.double() @ b.double() + c.double()).float()
    device = device_of()
    a16 = a.to(device).view(torch.int16).contiguous()
    b16 = b.to(device).view(torch.int16).contiguous()
    c = c.to(device)
    d = torch.full((16, 8), float("nan"), device=device)
    _product_kernel(dtype)[1, 32, launch_stream()](
        kernel_array(a16), kernel_array(b16), kernel_array(c), kernel_array(d)
    )
    assert torch.equal(d.cpu(), want), (d.cpu() - want).abs().max()


PRODUCTS_IN_A_ROW, WARPS = 6, 2
_products_in_a_row_mma = mma_m16n8k16(torch.bfloat16)


@cuda.jit
def _products_in_a_row(a, b, d, largest):
    # a: [WARPS, PRODUCTS_IN_A_ROW, 16, 16], b: [.., 16 (k), 8 (n)] as 16-bit bits; d: [.., 16,
    # 8] fp32; largest: [.., 32]. Simulator only: the lanes wait different times.
    warp, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
    g, t = lane // 4, lane % 4
    scratch = cuda.shared.array((WARPS, 32, FRAGMENT_WORDS), uint32)
    for p in range(PRODUCTS_IN_A_ROW):
        time.sleep(0.0005 * ((lane + p) % 3))
        a0, a1, a2, a3, b0, b1 = _fragments(a[warp, p], b[warp, p], g, t)
        out = d[warp, p]
        out[g, 2 * t], out[g, 2 * t + 1], out[g + 8, 2 * t], out[g + 8, 2 * t + 1] = (
            _products_in_a_row_mma(a0, a1, a2, a3, b0, b1, 0.0, 0.0, 0.0, 0.0, scratch[warp])
        )
        largest[warp, p, lane] = largest_of_lane_group(np.int32(lane * (p + 1) % 7), scratch[warp])


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's exchange of fragments between lanes")
def test_products_in_a_row_each_trade_their_own_fragments():
    """Two warps each make six products one after another, and find the largest of a value
    over each group of four lanes after each, their lanes delayed by different times: every
    product is the float64 one bit for bit, every largest the group's. The lanes trade their
    fragments through the warp's scratch at one barrier an exchange (``kernels.mma``,
    ``_scratch_turn``): a lane that posted its next words over those another lane had yet
    to read would fail it."""
    generator = torch.Generator().manual_seed(3)
    shape = (WARPS, PRODUCTS_IN_A_ROW)
    a = _exact_operand((*shape, 16, 16), generator, torch.bfloat16)
    b = _exact_operand((*shape, 16, 8), generator, torch.bfloat16)
    want = (a.double() @ b.double()).float()
    d = torch.full((*shape, 16, 8), float("nan"))
    largest = torch.full((*shape, 32), -1, dtype=torch.int32)
    _products_in_a_row[1, 32 * WARPS](
        kernel_array(a.view(torch.int16).contiguous()),
        kernel_array(b.view(torch.int16).contiguous()),
        kernel_array(d),
        kernel_array(largest),
    )
    assert torch.equal(d, want), (d - want).abs().max()
    lanes, p = torch.arange(32), torch.arange(1, PRODUCTS_IN_A_ROW + 1)[:, None]
    values = (lanes * p % 7).view(PRODUCTS_IN_A_ROW, 8, 4)
    groups = values.amax(dim=2, keepdim=True).expand(-1, -1, 4).reshape(PRODUCTS_IN_A_ROW, 32)
    assert torch.equal(largest, groups.expand(WARPS, -1, -1).to(torch.int32))


def _split_kernel():
    @cuda.jit
    def split(values, hi, lo):
        i = cuda.grid(1)
        if 2 * i + 1 < values.shape[0]:
            hi[i], lo[i] = split_pair(values[2 * i], values[2 * i + 1])

    return split


def _halves(pairs: torch.Tensor) -> torch.Tensor:
    """uint32 pairs of bf16 (as int64) -> their bf16 values as float64, in order."""
    low, high = pairs & 0xFFFF, (pairs >> 16) & 0xFFFF
    bits = torch.stack([low, high], dim=1).flatten().to(torch.int16)
    return bits.view(torch.bfloat16).double()


def test_split_keeps_sixteen_bits_and_special_values():
    generator = torch.Generator().manual_seed(3)
    finite = torch.randn(200, generator=generator) * 2.0 ** torch.randint(-60, 60, (200,))
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38])
    values = torch.cat([finite, special]).float()
    device = device_of()
    hi = torch.zeros(values.numel() // 2, dtype=torch.int64, device=device)
    lo = torch.zeros_like(hi)
    on_device = values.to(device)
    _split_kernel()[(values.numel() + 63) // 64, 64, launch_stream()](
        kernel_array(on_device), kernel_array(hi), kernel_array(lo)
    )
    top_bits = (values.view(torch.int32) >> 16).to(torch.int16)
    hi, lo = _halves(hi.cpu()), _halves(lo.cpu())
    assert torch.equal(hi.to(torch.bfloat16).view(torch.int16), top_bits)  # hi: the cut
    got = hi[:200] + lo[:200]
    assert bool(((got - values[:200].double()).abs() <= 2.0**-16 * values[:200].abs()).all())
    assert bool((got != hi[:200]).any())  # lo carries bits hi dropped
    # zeros split into zeros, +-inf into (+-inf, 0), NaN into NaN
    assert hi[200:202].tolist() == [0.0, 0.0] and lo[200:202].tolist() == [0.0, 0.0]
    assert hi[202:204].tolist() == [float("inf"), float("-inf")] and lo[202:204].tolist() == [0, 0]
    assert np.isnan(hi[204].item())
    assert hi[205].item() + lo[205].item() == pytest.approx(3.4e38, rel=2.0**-16)  # no inf


def _fp16_patterns() -> torch.Tensor:
    """fp16 bit patterns as int32 in [0, 65536), an even number of them: on the GPU every
    one; on the simulator (a Python thread a pair) every zero, subnormal, infinity and
    quiet NaN, every pattern of the smallest normal binade and of the largest (65504
    among them) and a spread sample. (A signalling NaN widens to one in numpy, whose
    subtraction then warns; the GPU's ``cvt.f32.f16`` makes it quiet.)"""
    every = torch.arange(65536, dtype=torch.int32)
    if not SIMULATOR:
        return every
    exponent = every & 0x7C00
    signalling = (exponent == 0x7C00) & (every & 0x3FF != 0) & (every & 0x200 == 0)
    edges = (exponent == 0) | (exponent == 0x0400) | (exponent >= 0x7800)
    sample = torch.zeros_like(edges)
    sample[::97] = True
    chosen = every[(edges | sample) & ~signalling]
    return chosen[: chosen.numel() // 2 * 2]


def _f16_split_kernel():
    @cuda.jit
    def split(pairs, hi, lo):
        # pairs: [N] int32, two fp16 each (the first in bits 0-15); hi, lo: [N] int64
        i = cuda.grid(1)
        if i < pairs.shape[0]:
            hi[i], lo[i] = split_f16_pair(pairs[i])

    return split


def test_fp16_splits_into_two_bf16_exactly():
    """``split_f16_pair``, which puts fp16 B on the bf16 tensor cores: ``hi`` is the fp16
    value cut to bf16 and ``hi + lo`` is the value exactly, for every finite pattern
    (subnormals and +-65504 included); an infinity is (inf, 0) and a NaN stays a NaN."""
    patterns = _fp16_patterns()
    as_int16 = patterns.to(torch.int16)
    device = device_of()
    pairs = as_int16.view(torch.int32).to(device)
    hi = torch.zeros(pairs.numel(), dtype=torch.int64, device=device)
    lo = torch.zeros_like(hi)
    _f16_split_kernel()[(pairs.numel() + 63) // 64, 64, launch_stream()](
        kernel_array(pairs), kernel_array(hi), kernel_array(lo)
    )
    hi, lo = _halves(hi.cpu()), _halves(lo.cpu())
    values = as_int16.view(torch.float16).double()
    finite = torch.isfinite(values)
    cut = (values.float().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(hi[finite], cut.double()[finite])  # hi: the cut
    exact = (hi + lo)[finite] == values[finite]
    assert bool(exact.all()), [
        (hex(int(p)), float(v))
        for p, v in zip(patterns[finite][~exact][:8], values[finite][~exact])
    ]
    assert bool((lo[finite] != 0).any())  # lo carries the bits hi dropped
    infinite = torch.isinf(values)
    assert torch.equal(hi[infinite], values[infinite]) and bool((lo[infinite] == 0).all())
    nan = torch.isnan(values)
    assert bool((torch.isnan(hi[nan]) | torch.isnan(lo[nan])).all())
    drawn = set(values[finite].abs().tolist())
    assert {65504.0, 2.0**-24, 1023 * 2.0**-24, 2.0**-14} <= drawn  # the edges were split


def _f16_pair_kernel():
    @cuda.jit
    def round_pairs(values, pairs, back):
        # values: [2N] fp32; pairs: [N] int64 (the uint32 pairs); back: [2N] fp32
        i = cuda.grid(1)
        if 2 * i + 1 < values.shape[0]:
            pair = f16_pair(values[2 * i], values[2 * i + 1])
            pairs[i] = pair
            back[2 * i], back[2 * i + 1] = f16_pair_values(pair)

    return round_pairs


def test_f16_pair_rounds_like_torch():
    """``f16_pair``, which rounds the tensor-core expand's fp16 outputs two at a time
    (``cvt.rn.f16x2.f32`` on the GPU): the first value in bits 0-15, each rounded to
    nearest, ties to even, as torch rounds: halfway cases, fp16 subnormals and the
    underflow below them, 65504 and the overflow past it, signed zeros and NaN.
    ``f16_pair_values`` widens the pair back exactly."""
    generator = torch.Generator().manual_seed(4)
    spread = torch.randn(400, generator=generator) * 2.0 ** torch.randint(-28, 17, (400,))
    ulp = 2.0**-10
    edges = [1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 65504.0, 65519.99, 65520.0, -7e4]
    edges += [2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 3 * 2.0**-25, 2.0**-14 - 2.0**-25, 0.0, -0.0]
    edges += [float("inf"), float("nan"), 3.4e38, 1e-40]
    values = torch.cat([spread, torch.tensor(edges)]).float()
    values = values[: values.numel() // 2 * 2]
    device = device_of()
    pairs = torch.zeros(values.numel() // 2, dtype=torch.int64, device=device)
    back = torch.zeros(values.numel(), device=device)
    _f16_pair_kernel()[(pairs.numel() + 63) // 64, 64, launch_stream()](
        kernel_array(values.to(device)), kernel_array(pairs), kernel_array(back)
    )
    pairs = pairs.cpu()
    bits = torch.stack([pairs & 0xFFFF, (pairs >> 16) & 0xFFFF], dim=1).flatten()
    got = bits.to(torch.int16).view(torch.float16)
    want = values.to(torch.float16)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    same = got[~nan].view(torch.int16) == want[~nan].view(torch.int16)
    assert bool(same.all()), [
        (float(v), float(g), float(w))
        for v, g, w in zip(values[~nan][~same][:8], got[~nan][~same], want[~nan][~same])
    ]
    widened = back.cpu()
    assert torch.equal(torch.isnan(widened), nan)
    assert torch.equal(widened[~nan].view(torch.int32), got[~nan].float().view(torch.int32))
