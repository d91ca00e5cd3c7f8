"""How close a kernel's result must be to the float64 reference: stated once, here.

The bound for one output element is

    |got - want| <= (terms + 4) * u32 * magnitude + 2 * u_out * magnitude + 2 * tiny_out

where ``magnitude`` is the same reference computed on absolute values (every input
and the old output replaced by its absolute value), ``terms`` is the number of
products summed into that element, ``u32 = 2**-24`` is fp32's unit roundoff and
``u_out`` the output dtype's.

Why: the kernels multiply exact (widened) inputs and add ``terms`` products in
fp32; any order of fp32 summation of n terms errs by at most about ``n * u32``
times the sum of the absolute values (the classic bound gamma_n); the 4 covers the
scaling, the final add into the old output, and the fp32 buffer between shrink
and expand. Storing the result rounds once more (``u_out``), and the wrapper's
bias add in the output dtype rounds once again (the second ``u_out``). A result in
the output dtype's subnormal range is rounded to a fixed spacing, not a relative
one, so each rounding may also err by ``tiny_out``, that spacing (2**-24 for fp16:
seen on the H200 at outputs near 1e-5). Rows that
must be untouched are compared bit for bit elsewhere, not with this bound.

The bound is tight enough to catch the deliberately wrong kernels: accumulating in
fp16 errs by ~``u16 = 2**-11`` of the magnitude, hundreds of times more than
``terms * u32`` for the sizes drawn.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24

#: The largest error relative to the magnitude seen per check (``what``), for the report
#: printed at the end of the run (see conftest.py).
LARGEST_ERRORS: dict[str, float] = {}
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
#: The spacing of the subnormal numbers of each output dtype.
SUBNORMAL_SPACING = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133, torch.float32: 2.0**-149}


def error_bound(magnitude: torch.Tensor, terms: int, out_dtype: torch.dtype) -> torch.Tensor:
    relative = ((terms + 4) * U32 + 2 * UNIT_ROUNDOFF[out_dtype]) * magnitude
    return relative + 2 * SUBNORMAL_SPACING[out_dtype]


def assert_close(
    got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, terms: int, what: str
) -> float:
    """Assert every element is within the bound; return the largest error relative to
    the magnitude (for reporting). The failure names the first bad index and both values."""
    err = (got.to(torch.float64) - want).abs()
    bound = error_bound(magnitude, terms, got.dtype)
    bad = (err > bound) | torch.isnan(err)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; first at "
            f"{index}: got {got[index].item()!r}, want {want[index].item()!r} "
            f"(error {err[index].item():.3g} > bound {bound[index].item():.3g}); "
            f"shape {tuple(got.shape)}, dtype {got.dtype}"
        )
    scale = magnitude.clamp_min(torch.finfo(torch.float64).tiny)
    largest = float((err / scale).max()) if err.numel() else 0.0
    LARGEST_ERRORS[what] = max(LARGEST_ERRORS.get(what, 0.0), largest)
    return largest
