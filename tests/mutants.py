"""Deliberately wrong kernels: the property suite must reject every one of them.

Each mutant is a small, naive Numba kernel (one block per sorted token position and
slice, one thread per output column) with exactly one planted bug, wrapped in a
host function with the op's vLLM signature. ``test_mutants.py`` runs the same
checks as the property tests on them and expects a failure.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import float32

from punica_numba._cuda import cuda, kernel_array, launch_stream
from punica_numba.kernels.dtypes import loader, storer
from punica_numba.reference import squeeze_weight

SHRINK_BUGS = ("ignores -1", "segment end off by one", "drops scaling", "accumulates in fp16")
EXPAND_BUGS = (
    "ignores -1",
    "segment end off by one",
    "accumulates in fp16",
    "writes outside the slice",
)


@cuda.jit(device=True)
def _segment_of(position, starts, counts, lora_ids, extra):
    """The segment holding sorted position ``position`` (each segment ``extra`` longer)."""
    for i in range(lora_ids.shape[0]):
        if starts[i] <= position < starts[i] + counts[i] + extra and counts[i] > 0:
            return i
    return -1


@functools.cache
def _build(op: str, bug: str, x_dtype, w_dtype, out_dtype):
    load_x, load_w, load_out, store_out = (
        loader(x_dtype),
        loader(w_dtype),
        loader(out_dtype),
        storer(out_dtype),
    )
    skip_no_lora = bug != "ignores -1"
    extra = 1 if bug == "segment end off by one" else 0
    fp16_sum = bug == "accumulates in fp16"
    use_scaling = bug != "drops scaling"
    spill = bug == "writes outside the slice"

    @cuda.jit
    def shrink(x, w, out, s, sorted_tokens, counts, starts, lora_ids, scaling):
        position, n = cuda.blockIdx.x, cuda.threadIdx.x  # position in [0, M), n in [0, r)
        segment = _segment_of(position, starts, counts, lora_ids, extra)
        if segment == -1 or n >= w.shape[1]:
            return
        slot = lora_ids[segment]
        if slot == -1:
            if skip_no_lora:
                return
            slot = 0
        t = sorted_tokens[position]
        acc = float32(0.0)
        acc16 = np.float16(0.0)
        for k in range(x.shape[1]):
            product = load_x(x[t, k]) * load_w(w[slot, n, k])
            if fp16_sum:
                acc16 = np.float16(acc16 + np.float16(product))
            else:
                acc += product
        total = float32(acc16) if fp16_sum else acc
        out[s, t, n] += (scaling if use_scaling else float32(1.0)) * total

    @cuda.jit
    def expand(x, w, out, s, column0, sorted_tokens, counts, starts, lora_ids, add_inputs):
        position, n = cuda.blockIdx.x, cuda.threadIdx.x  # n in [0, N_s)
        segment = _segment_of(position, starts, counts, lora_ids, extra)
        if segment == -1 or n >= w.shape[1]:
            return
        slot = lora_ids[segment]
        if slot == -1:
            if skip_no_lora:
                return
            slot = 0
        t = sorted_tokens[position]
        acc = float32(0.0)
        acc16 = np.float16(0.0)
        for k in range(w.shape[2]):
            product = load_x(x[s, t, k]) * load_w(w[slot, n, k])
            if fp16_sum:
                acc16 = np.float16(acc16 + np.float16(product))
            else:
                acc += product
        value = float32(acc16) if fp16_sum else acc
        column = column0 + n
        if add_inputs:
            value += load_out(out[t, column])
        out[t, column] = store_out(value)
        if spill and n == w.shape[1] - 1 and column + 1 < out.shape[1]:
            out[t, column + 1] = store_out(value)

    return shrink if op == "shrink" else expand


def mutant_shrink(bug: str):
    """A host function with lora_shrink's signature whose kernel has ``bug``."""

    def lora_shrink(
        inputs,
        lora_a_weights,
        output_tensor,
        token_lora_mapping,
        sorted_tokens,
        counts,
        starts,
        lora_ids,
        no_lora_flag_cpu,
        scaling,
    ):
        if bool(no_lora_flag_cpu.item()) or inputs.shape[0] == 0:
            return
        meta = [kernel_array(t) for t in (sorted_tokens, counts, starts, lora_ids)]
        for s, weight in enumerate(lora_a_weights):
            w = squeeze_weight(weight)
            kernel = _build("shrink", bug, inputs.dtype, w.dtype, output_tensor.dtype)
            kernel[inputs.shape[0], w.shape[1], launch_stream()](
                kernel_array(inputs),
                kernel_array(w),
                kernel_array(output_tensor),
                s,
                *meta,
                np.float32(scaling),
            )

    lora_shrink.__name__ = f"shrink that {bug}"
    return lora_shrink


def mutant_expand(bug: str):
    """A host function with lora_expand's signature whose kernel has ``bug``."""

    def lora_expand(
        inputs,
        lora_b_weights,
        output_tensor,
        token_lora_mapping,
        sorted_tokens,
        counts,
        starts,
        lora_ids,
        no_lora_flag_cpu,
        offset_start=0,
        add_inputs=False,
    ):
        if bool(no_lora_flag_cpu.item()) or inputs.shape[1] == 0:
            return
        meta = [kernel_array(t) for t in (sorted_tokens, counts, starts, lora_ids)]
        column = offset_start
        for s, weight in enumerate(lora_b_weights):
            w = squeeze_weight(weight)
            kernel = _build("expand", bug, inputs.dtype, w.dtype, output_tensor.dtype)
            kernel[inputs.shape[1], w.shape[1], launch_stream()](
                kernel_array(inputs),
                kernel_array(w),
                kernel_array(output_tensor),
                s,
                column,
                *meta,
                add_inputs,
            )
            column += w.shape[1]

    lora_expand.__name__ = f"expand that {bug}"
    return lora_expand
