"""The tensor-core product (``kernels.mma``) against torch, on both machines.

On the GPU this checks that the fragment layout the kernels assume is the one the
hardware uses; on the simulator, that the emulation adds the same products. The
operands are small integers times powers of two, so every product and every sum is
exact in fp32: the result must equal the float64 product bit for bit, whatever the
order of the additions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numba import uint32

from punica_numba._cuda import cuda, device_of, kernel_array, launch_stream
from punica_numba.kernels.mma import FRAGMENT_WORDS, mma_m16n8k16, pair_of, split_pair

DTYPES = [torch.bfloat16, torch.float16]


def _product_kernel(dtype):
    mma = mma_m16n8k16(dtype)

    @cuda.jit
    def product(a, b, c, d):
        # a: [16, 16], b: [16 (k), 8 (n)] as 16-bit bits; c, d: [16, 8] fp32; one warp
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        scratch = cuda.shared.array((32, FRAGMENT_WORDS), uint32)
        d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = mma(
            pair_of(a[g, 2 * t], a[g, 2 * t + 1]),
            pair_of(a[g + 8, 2 * t], a[g + 8, 2 * t + 1]),
            pair_of(a[g, 8 + 2 * t], a[g, 9 + 2 * t]),
            pair_of(a[g + 8, 8 + 2 * t], a[g + 8, 9 + 2 * t]),
            pair_of(b[2 * t, g], b[2 * t + 1, g]),
            pair_of(b[8 + 2 * t, g], b[9 + 2 * t, g]),
            c[g, 2 * t],
            c[g, 2 * t + 1],
            c[g + 8, 2 * t],
            c[g + 8, 2 * t + 1],
            scratch,
        )

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
