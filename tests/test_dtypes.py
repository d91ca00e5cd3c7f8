"""The word loaders (``kernels.dtypes``) widen every 16-bit pattern exactly, on both machines.

The FFMA kernels read fp16 and bf16 operands four to an int64 word and widen each to
fp32 through :func:`~punica_numba.kernels.dtypes.word_loader`: integer arithmetic on the
simulator, and for fp16 one ``cvt.f32.f16`` on the GPU. Widening is exact, so each
result must be torch's own conversion bit for bit: zeros keep their sign, subnormals
and infinities their values, and a NaN stays a NaN (its payload bits may differ). On
the GPU every one of the 65,536 patterns is checked; on the simulator, where each word
is a Python thread, every pattern with the smallest or the largest exponent (zeros,
subnormals, infinities, NaNs) and a spread sample of the rest.
"""

from __future__ import annotations

import pytest
import torch

from punica_numba._cuda import SIMULATOR, cuda, device_of, kernel_array, launch_stream
from punica_numba.kernels.dtypes import word_loader

#: (dtype, the bits of its exponent field)
FORMATS = [(torch.float16, 0x7C00), (torch.bfloat16, 0x7F80)]


def _widening_kernel(dtype):
    load = word_loader(dtype, True)

    @cuda.jit
    def widen(words, out):
        # words: [N] int64 of four 16-bit patterns; out: [N, 4] fp32
        i = cuda.grid(1)
        if i < words.shape[0]:
            for lane in range(4):
                out[i, lane] = load(words[i], lane)

    return widen


def _patterns(exponent_mask: int) -> torch.Tensor:
    """The 16-bit patterns to check, as int32 in [0, 65536), a multiple of 4 of them."""
    every = torch.arange(65536, dtype=torch.int32)
    if not SIMULATOR:
        return every
    exponent = every & exponent_mask
    edges = every[(exponent == 0) | (exponent == exponent_mask)]
    sample = every[torch.arange(0, 65536, 61)]
    chosen = torch.unique(torch.cat([edges, sample]))
    return chosen[: chosen.numel() // 4 * 4]


@pytest.mark.parametrize("dtype, exponent_mask", FORMATS, ids=["fp16", "bf16"])
def test_every_16_bit_pattern_widens_exactly(dtype, exponent_mask):
    patterns = _patterns(exponent_mask)
    as_int16 = patterns.to(torch.int16)  # wraps the top half to negative: the same bits
    words = as_int16.view(torch.int64)  # four patterns a word, the first in bits 0-15
    device = device_of()
    out = torch.full((words.numel(), 4), 7.0, device=device)
    threads = 128
    _widening_kernel(dtype)[(words.numel() + threads - 1) // threads, threads, launch_stream()](
        kernel_array(words.to(device)), kernel_array(out)
    )
    got = out.cpu().reshape(-1)
    want = as_int16.view(dtype).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), patterns[torch.isnan(got) != nan][:8]
    same = got[~nan].view(torch.int32) == want[~nan].view(torch.int32)
    assert bool(same.all()), [
        (hex(int(p)), float(g), float(w))
        for p, g, w in zip(patterns[~nan][~same][:8], got[~nan][~same], want[~nan][~same])
    ]
    assert int(nan.sum()) > 0 and bool((want == float("inf")).any())  # the edges were drawn
