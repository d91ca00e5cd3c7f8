"""The tensors of a checked call as a kernel takes them.

The kernels read 16-bit elements in packed 8-byte words (four fp16/bf16 elements, or
two fp32), and 16 bytes at a time where every row starts at a multiple of 16 bytes.
This module says whether a tensor allows that and gives its views: the int64 words of a
tensor, whether its rows are aligned, and the tensor-core kernels' operands (or None
when those kernels cannot take the call, so that :mod:`.choice` picks an FFMA kernel).
Nothing here copies data: every operand is a view of the caller's memory.

**Ranks.** The tensor cores take ranks up to :data:`MMA_MAX_RANK` (256: r = 128 and 256
are common LoRA ranks), except a tensor-core shrink whose blocks take every rank
(``tile_n == 0``), up to :data:`MMA_ONE_BLOCK_RANK` (64): it keeps the outputs of the
whole rank in registers and its warps' partial tiles in shared memory. A shrink of rank
groups (``tile_n > 0``) holds one group's, whatever the rank: a block per group along
grid.y (at most 256 / 8 = 32 of them, far below CUDA's 65535). The expand walks a rank
past 64 in chunks of 64 (:mod:`..kernels.expand_mma`, "Ranks past 64"), holding one
chunk's buffer fragments at a time. Past 64 neither kernel's registers grow with the
rank; 256 is the largest rank they are tested at.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._checks import Stack
from .._cuda import SIMULATOR, pack_tensors
from ..kernels.mma import MMA_DTYPES

__all__ = [
    "MMA_MAX_RANK",
    "MMA_ONE_BLOCK_RANK",
    "mma_expand_operands",
    "mma_shrink_operands",
    "rows_start_at",
    "weight_forms",
    "weight_words",
    "words",
]

#: The largest rank the tensor-core kernels take: the shrink's blocks of a rank group and
#: the expand, which walks the rank in chunks of 64 (see "Ranks" above).
MMA_MAX_RANK = 256

#: The largest rank of a tensor-core shrink whose blocks take every rank (``tile_n == 0``:
#: the outputs of the whole rank in registers, the warps' partial tiles in shared memory).
MMA_ONE_BLOCK_RANK = 64


def words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as int64 words (8 bytes: four fp16/bf16 or two fp32 elements); None
    when its rows are not whole, aligned words."""
    if t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 8 or not rows_start_at(t, 8):
        return None
    return t.view(torch.int64)


def rows_start_at(t: torch.Tensor, multiple: int) -> bool:
    """Whether every row of ``t`` starts at a multiple of ``multiple`` bytes."""
    size = t.element_size()
    return t.data_ptr() % multiple == 0 and all(s * size % multiple == 0 for s in t.stride()[:-1])


def weight_forms(weights: Sequence[Stack]) -> list[tuple]:
    """Each weight as a kernel can take it: ``(words, elements)``, its packed int64 words
    (None when its rows do not allow them) and its view, each a kernel argument.

    On the GPU both are worked out once per checked weight, described for the launcher
    once (:func:`~punica_numba._cuda.pack_tensors`) and kept in ``Stack.launch``: a
    checked view's memory and layout never change, and a serving engine hands the same
    weights to every call (``check_stack`` returns the same Stack for them).
    """
    if SIMULATOR:
        return [(words(w.view), w.view) for w in weights]
    forms = []
    for w in weights:
        form = w.launch.get("forms")
        if form is None:
            packed = words(w.view)
            form = w.launch["forms"] = (
                None if packed is None else pack_tensors((packed,)),
                pack_tensors((w.view,)),
            )
        forms.append(form)
    return forms


def weight_words(weights: Sequence[Stack]) -> list | None:
    """Each weight's int64 words (as :func:`weight_forms` keeps them), or None when one of
    them has none."""
    packed = [w for w, _ in weight_forms(weights)]
    return None if any(w is None for w in packed) else packed


def mma_shrink_operands(
    inputs: torch.Tensor, weights: Sequence[Stack], tile_n: int
) -> tuple | None:
    """The tensor-core shrink's operands ``(x, weights, wide)`` for a configuration of
    ``tile_n`` ranks a block (0: every rank): x and A as int64 words of four elements,
    and whether all their rows start at multiples of 16 bytes (the kernel's 16-byte
    loads); or None when it cannot take the call: x and A fp16 or bf16, a rank up to
    :data:`MMA_MAX_RANK` (blocks of rank groups) or :data:`MMA_ONE_BLOCK_RANK` (blocks of
    every rank), a hidden size that is a multiple of 8, rows of whole, aligned words
    (:mod:`..kernels.shrink_mma`)."""
    max_rank = MMA_MAX_RANK if tile_n else MMA_ONE_BLOCK_RANK
    if inputs.dtype not in MMA_DTYPES or weights[0].rows > max_rank or inputs.shape[1] % 8:
        return None
    x = words(inputs)
    packed = weight_words(weights) if x is not None else None
    if packed is None:
        return None
    wide = all(rows_start_at(t, 16) for t in (inputs, *(w.view for w in weights)))
    return x, packed, wide


def mma_expand_operands(
    inputs: torch.Tensor,
    weights: Sequence[Stack],
    packed: list | None,
    output: torch.Tensor,
    columns: list[int],
) -> tuple | None:
    """The tensor-core expand's operands ``(x, words, out, wide, wide_x, wide_b)``, or None
    when it cannot take the call; ``wide``: the output can be read and written in 16-byte
    words (its rows start at multiples of 16 bytes, every slice's first column and width
    are multiples of 8); ``wide_x``: the buffer in 16-byte loads (fp32, a rank that is a
    multiple of 16, contiguous rows that start at multiples of 16 bytes); ``wide_b``: B
    in 16-byte loads (a rank that is a multiple of 32, rows at multiples of 16 bytes).
    It takes B and an output of one dtype, bf16 or fp16 (fp16 B as it is, in the f16
    product), a buffer of fp32 (split in two halves of B's dtype, an fp16 row scaled
    first) or of B's dtype (bf16 as its int16 bits, fp16 as it is), 0 < rank <=
    :data:`MMA_MAX_RANK` (past 64 in chunks of 64), B rows of whole int64 words (four
    elements: ``packed``, from :func:`weight_words`, None where there are none), and an
    output it can read and write in words of four columns: every slice's first column and
    width a multiple of 4 (:mod:`..kernels.expand_mma`, "Precision")."""
    dtype = weights[0].dtype
    if (
        dtype not in MMA_DTYPES
        or output.dtype != dtype
        or inputs.dtype not in (torch.float32, dtype)
        or not 0 < weights[0].cols <= MMA_MAX_RANK
        or any(c % 4 or w.rows % 4 for c, w in zip(columns, weights))
    ):
        return None
    out = words(output)
    if packed is None or out is None:
        return None
    x = inputs.view(torch.int16) if inputs.dtype == torch.bfloat16 else inputs
    wide = rows_start_at(output, 16) and all(
        c % 8 == 0 and w.rows % 8 == 0 for c, w in zip(columns, weights)
    )
    wide_x = (
        inputs.dtype == torch.float32
        and weights[0].cols % 16 == 0
        and inputs.stride(-1) == 1
        and rows_start_at(inputs, 16)
    )
    wide_b = weights[0].cols % 32 == 0 and all(rows_start_at(w.view, 16) for w in weights)
    return x, packed, out, wide, wide_x, wide_b
