"""Deliberately wrong kernels: the property suite must reject every one of them.

Each mutant is a small, naive Numba kernel (one block per sorted token position and
slice, one thread per output column) with exactly one planted bug, wrapped in a
host function with the op's vLLM signature. ``test_mutants.py`` runs the same
checks as the property tests on them and expects a failure.

The ``*_EDGE_BUGS`` are the bugs a careless kernel makes only at an edge case (rank 1,
one slot, a full batch, ...): right on ordinary problems, wrong at one extreme, and
caught by ``test_edge_cases.py``'s checks. Every planted bug stays memory-safe (indices
are clamped or wrapped, so the values are wrong, never the addresses): the mutants
run on the GPU too.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import float32

from punica_numba._cuda import cuda, kernel_array, launch_stream
from punica_numba.kernels.dtypes import loader, storer
from punica_numba.meta import LoRAKernelMeta
from punica_numba.reference import squeeze_weight

SHRINK_BUGS = ("ignores -1", "segment end off by one", "drops scaling", "accumulates in fp16")
EXPAND_BUGS = (
    "ignores -1",
    "segment end off by one",
    "accumulates in fp16",
    "writes outside the slice",
)
SHRINK_EDGE_BUGS = (
    "launches nothing at full capacity",  # T == max_num_tokens: `<` where `<=` was meant
    "assumes H >= 2",  # peels two k per step; the second is clamped, so counted twice at H=1
    "no-LoRA batch takes slot -1 as the last slot",  # w[-1]: Python's wrap-around
)
EXPAND_EDGE_BUGS = (
    "assumes r >= 2",  # peels two k per step; the second is clamped, so counted twice at r=1
    "single-slot fast path ignores -1",  # with L == 1 every segment is taken to be slot 0
    "skips a slice of width 1",  # a "degenerate" slice left out
    "treats an empty step as one token on slot 0",  # an empty-grid guard gone wrong
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
    peel = bug in ("assumes H >= 2", "assumes r >= 2")
    one_slot_fast_path = bug == "single-slot fast path ignores -1"

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
        hidden = x.shape[1]
        first_k = 0
        if peel and hidden > 0:  # k = 0 and 1 unrolled; k = 1 clamped into bounds
            k1 = min(1, hidden - 1)
            acc += load_x(x[t, 0]) * load_w(w[slot, n, 0])
            acc += load_x(x[t, k1]) * load_w(w[slot, n, k1])
            first_k = 2
        for k in range(first_k, hidden):
            product = load_x(x[t, k]) * load_w(w[slot, n, k])
            if fp16_sum:
                acc16 = np.float16(acc16 + np.float16(product))
            else:
                acc += product
        total = float32(acc16) if fp16_sum else acc
        old = load_out(out[s, t, n])
        out[s, t, n] = store_out(old + (scaling if use_scaling else float32(1.0)) * total)

    @cuda.jit
    def expand(x, w, out, s, column0, sorted_tokens, counts, starts, lora_ids, add_inputs):
        position = cuda.blockIdx.x  # position in [0, M)
        n = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x  # n in [0, N_s)
        segment = _segment_of(position, starts, counts, lora_ids, extra)
        if segment == -1 or n >= w.shape[1]:
            return
        slot = lora_ids[segment]
        if one_slot_fast_path and lora_ids.shape[0] == 2:  # L == 1: "always slot 0"
            slot = 0
        if slot == -1:
            if skip_no_lora:
                return
            slot = 0
        t = sorted_tokens[position]
        acc = float32(0.0)
        acc16 = np.float16(0.0)
        rank = w.shape[2]
        first_k = 0
        if peel and rank > 0:  # k = 0 and 1 unrolled; k = 1 clamped into bounds
            k1 = min(1, rank - 1)
            acc += load_x(x[s, t, 0]) * load_w(w[slot, n, 0])
            acc += load_x(x[s, t, k1]) * load_w(w[slot, n, k1])
            first_k = 2
        for k in range(first_k, rank):
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
        if inputs.shape[0] == 0:
            return
        if bool(no_lora_flag_cpu.item()):
            if bug != "no-LoRA batch takes slot -1 as the last slot":
                return
            # "No segments, so take the per-token path": slot -1 indexes the last slot.
            num_loras = squeeze_weight(lora_a_weights[0]).shape[0]
            per_token = LoRAKernelMeta.make(num_loras, inputs.shape[0], inputs.device)
            per_token.prepare_tensors(token_lora_mapping[: inputs.shape[0]] % num_loras)
            _, sorted_tokens, counts, starts, lora_ids, _ = per_token.meta_args(inputs.shape[0])
        if bug == "launches nothing at full capacity":
            capacity = token_lora_mapping.untyped_storage().nbytes()
            capacity //= token_lora_mapping.element_size()  # the metadata's max_num_tokens
            if inputs.shape[0] >= capacity:
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
        if inputs.shape[1] == 0:
            return
        if bug == "treats an empty step as one token on slot 0" and int(counts.sum()) == 0:
            sorted_tokens, counts, starts, lora_ids = _one_token_on_slot_0(counts)
        elif bool(no_lora_flag_cpu.item()):
            return
        meta = [kernel_array(t) for t in (sorted_tokens, counts, starts, lora_ids)]
        column = offset_start
        for s, weight in enumerate(lora_b_weights):
            w = squeeze_weight(weight)
            if bug == "skips a slice of width 1" and w.shape[1] == 1:
                column += 1
                continue
            kernel = _build("expand", bug, inputs.dtype, w.dtype, output_tensor.dtype)
            columns = min(w.shape[1], 256)  # at most 1024 threads a block on a GPU
            grid = (inputs.shape[1], -(-w.shape[1] // columns))
            kernel[grid, columns, launch_stream()](
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


def _one_token_on_slot_0(counts):
    """Metadata of one token (row 0) on slot 0, shaped like the real metadata."""
    one = torch.zeros_like(counts)  # [L+1]
    one[0] = 1
    starts = torch.zeros(counts.shape[0] + 1, dtype=counts.dtype, device=counts.device)
    starts[1:] = 1  # [L+2]
    lora_ids = torch.full_like(counts, -1)
    lora_ids[0] = 0
    return torch.zeros(1, dtype=counts.dtype, device=counts.device), one, starts, lora_ids
